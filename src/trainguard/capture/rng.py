"""Snapshot and restore of every random number generator a training step may use.

``rng_state()`` returns the states as plain values (saved in bundles and checkpoints).
``RngSnapshot.take()`` is the per-step form (the guard takes one at every step's first
forward, and needs it only when that step goes bad): the same states, copied as cheaply
as exactness allows, turned into ``rng_state()``'s dict only when read (``state()``):

- torch's CPU generator: ``get_state()`` (a 5 KB copy, about 1 us);
- Python's ``random``: the Mersenne Twister's 2.5 KB read raw from the generator object
  (about 1 us, where ``random.getstate()`` builds 625 ints: about 11 us) plus
  ``gauss_next``; CPython only, and only after the layout was checked against
  ``getstate()`` (``rng_raw.PythonRaw``), else ``getstate()``;
- NumPy's legacy global generator, only when ``numpy.random`` was imported (before that
  no global NumPy generator exists: nothing draws from it; a program whose step's forward
  is the first to import ``numpy.random`` and draw from it is not replayed exactly, its
  state was seeded at that import): the MT19937 key and position read raw from the bit
  generator's ``ctypes.state_address`` and the legacy gaussian cache (``has_gauss``,
  ``gauss``) raw from the ``RandomState`` object (about 1 us, where ``get_state()`` takes
  about 45-75 us); CPython only, and only after the layout was checked against
  ``get_state()`` (``rng_raw.NumpyRaw``), else ``get_state()``;
- CUDA: ``torch.cuda.get_rng_state_all()`` once CUDA is initialized.

A step that draws nothing leaves every generator as it was: then ``take()`` hands out the
last snapshot again, after reading a few words of each generator (``rng_fingerprint.py``).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

import torch

from trainguard.capture.rng_fingerprint import (
    NUMPY_FINGERPRINT,
    PYTHON_FINGERPRINT,
    TORCH_FINGERPRINT,
    torch_view,
)
from trainguard.capture.rng_raw import numpy_raw, numpy_value, python_raw


def rng_state() -> dict[str, Any]:
    """Python, NumPy (when installed), torch CPU and every CUDA device's generator state."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        pass
    else:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` saved (generators absent here are left alone)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            np.random.set_state(state["numpy"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])


class _Marks:
    """What ``_fingerprint`` reads, bound once for the ``numpy.random`` module of the moment
    (None: not imported): the raw readers and each generator's ``struct`` read (``reads``
    None when one of them is not read raw)."""

    __slots__ = ("numpy", "numpy_random", "python", "reads")

    def __init__(self, numpy_random: Any) -> None:
        self.numpy_random = numpy_random
        self.python = python_raw()
        self.numpy = numpy_raw(numpy_random) if numpy_random is not None else None
        self.reads: tuple[Callable[[], tuple[Any, ...]], ...] | None = None
        torch_memory, python_memory = torch_view(), self.python.view
        if torch_memory is None or python_memory is None:
            return
        reads: tuple[Callable[[], tuple[Any, ...]], ...] = (
            partial(TORCH_FINGERPRINT.unpack_from, torch_memory),
            partial(PYTHON_FINGERPRINT.unpack_from, python_memory),
        )
        if self.numpy is not None:
            if self.numpy.views is None:
                return
            reads += (partial(NUMPY_FINGERPRINT.unpack_from, self.numpy.views[0]),)
        self.reads = reads


_MARKS: _Marks | None = None


def _fingerprint() -> tuple[Any, ...] | None:
    """Every generator's fingerprint now (``rng_fingerprint.py``); None when one is not read
    raw (``readable``: the layout, the module's generator). CUDA's generators exist once
    CUDA is initialized (``default_generators`` filled): their part is empty before, so
    that the first step after the initialization takes a new snapshot. NumPy's is read
    without its lock: a draw in another thread at that moment is seen either before or
    after it (a torn read differs from the last fingerprint, and the snapshot is then taken
    under the lock)."""
    global _MARKS
    marks = _MARKS
    numpy_random: Any = sys.modules.get("numpy.random")
    if marks is None or marks.numpy_random is not numpy_random:
        marks = _MARKS = _Marks(numpy_random)
    reads, python = marks.reads, marks.python
    if reads is None or not python.readable():
        return None  # not read raw
    cuda = _cuda_fingerprint() if torch.cuda.default_generators else ()
    if cuda is None:
        return None
    gauss_next = getattr(python.generator, "gauss_next", None)
    numpy = marks.numpy
    if numpy is None:
        return (reads[0](), reads[1](), gauss_next, cuda)
    if not numpy.readable():
        return None
    views: Any = numpy.views
    return (reads[0](), reads[1](), gauss_next, cuda, reads[2](), views[1].tobytes())


def _cuda_fingerprint() -> tuple[tuple[int, int], ...] | None:
    """Each CUDA device's generator as its seed and Philox offset, the whole of its state
    (what ``get_state()`` packs): every draw moves the offset, and a seed or a state set
    sets both. Host values, read without a sync. None where this torch cannot read them
    (or refuses, inside a CUDA graph's capture): every snapshot is then taken afresh."""
    try:
        return tuple((g.initial_seed(), g.get_offset()) for g in torch.cuda.default_generators)
    except (AttributeError, RuntimeError):
        return None


def states_of(found: RngSnapshot | dict[str, Any] | None) -> dict[str, Any] | None:
    """``rng_state()``'s dict from a snapshot (built when first read), a dict or None."""
    return found.state() if isinstance(found, RngSnapshot) else found


class RngSnapshot:
    """The states of every generator at one moment, copied cheaply; ``state()`` gives them as
    ``rng_state()`` does (built on the first call, then kept)."""

    __slots__ = ("_cuda", "_mark", "_numpy", "_python", "_state", "_torch")

    _last: ClassVar[RngSnapshot | None] = None
    """The last snapshot taken with a fingerprint (``take`` may hand it out again)."""

    def __init__(self) -> None:
        self._torch = torch.default_generator.get_state()
        self._python = python_raw().take()
        numpy_random = sys.modules.get("numpy.random")
        self._numpy = numpy_raw(numpy_random).take() if numpy_random is not None else None
        cuda = torch.cuda.is_initialized() and torch.cuda.is_available()  # type: ignore[no-untyped-call]
        self._cuda = torch.cuda.get_rng_state_all() if cuda else None
        self._state: dict[str, Any] | None = None
        self._mark: tuple[Any, ...] | None = None

    @classmethod
    def prepare(cls) -> None:
        """Find and validate the raw layouts now (when the guard is built), not inside the
        first step: the torch generator's validation makes a few state tensors and takes a
        few milliseconds once."""
        _fingerprint()

    @classmethod
    def take(cls) -> RngSnapshot:
        """The states now: the last snapshot again when no generator moved since it was
        taken (their fingerprints are the same), else a new one."""
        mark = _fingerprint()
        last = cls._last
        if mark is not None and last is not None and last._mark == mark:
            return last
        snapshot = cls()
        snapshot._mark = mark
        cls._last = snapshot if mark is not None else None
        return snapshot

    def parts(self) -> tuple[Any, ...]:
        """The raw states as bytes and plain values (picklable, cheap): ``from_parts`` makes
        the snapshot again (a rank's step-start record, ``recovery/failure/mirror.py``)."""
        cuda = [t.numpy().tobytes() for t in self._cuda] if self._cuda is not None else None
        return (self._torch.numpy().tobytes(), self._python, self._numpy, cuda)

    @classmethod
    def from_parts(cls, parts: tuple[Any, ...]) -> RngSnapshot:
        """The snapshot ``parts()`` came from (its ``state()`` as that one's)."""
        torch_bytes, python, numpy, cuda = parts
        snapshot = cls.__new__(cls)
        snapshot._torch = _byte_tensor(torch_bytes)
        snapshot._python = python
        snapshot._numpy = numpy
        snapshot._cuda = [_byte_tensor(b) for b in cuda] if cuda is not None else None
        snapshot._state = None
        snapshot._mark = None
        return snapshot

    def state(self) -> dict[str, Any]:
        """``rng_state()``'s dict of the moment the snapshot was taken."""
        if self._state is None:
            state: dict[str, Any] = {
                "python": python_raw().state(self._python),
                "torch": self._torch,
            }
            if self._numpy is not None:
                state["numpy"] = numpy_value(self._numpy)
            if self._cuda is not None:
                state["cuda"] = self._cuda
            self._state = state
        return self._state


def _byte_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
