"""Snapshot and restore of every random number generator a training step may use.

``rng_state()`` returns the states as plain values (saved in bundles and checkpoints).
``RngSnapshot.take()`` is the per-step form (the guard takes one at every step's first
forward, and needs it only when that step goes bad): the same states, copied as cheaply
as exactness allows, turned into ``rng_state()``'s dict only when read (``state()``):

- torch's CPU generator: ``get_state()`` (a 5 KB copy, about 1 us);
- Python's ``random``: the Mersenne Twister's 2.5 KB read raw from the generator object
  (about 1 us, where ``random.getstate()`` builds 625 ints: about 11 us) plus
  ``gauss_next``; CPython only, and only after the layout was checked against
  ``getstate()`` (``_PythonRaw``), else ``getstate()``;
- NumPy's legacy global generator, only when ``numpy.random`` was imported (before that
  no global NumPy generator exists: nothing draws from it; a program whose step's forward
  is the first to import ``numpy.random`` and draw from it is not replayed exactly, its
  state was seeded at that import): the MT19937 key and position read raw from the bit
  generator's ``ctypes.state_address`` and the legacy gaussian cache (``has_gauss``,
  ``gauss``) raw from the ``RandomState`` object (about 1 us, where ``get_state()`` takes
  about 45-75 us); CPython only, and only after the layout was checked against
  ``get_state()`` (``_NumpyRaw``), else ``get_state()``;
- CUDA: ``torch.cuda.get_rng_state_all()`` once CUDA is initialized.

A step that draws nothing leaves every generator as it was: then ``take()`` hands out the
last snapshot again, after reading a few words of each generator (``rng_fingerprint.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import random
import struct
import sys
import sysconfig
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

import torch

from trainguard.capture.rng_fingerprint import (
    NUMPY_FINGERPRINT,
    PYTHON_FINGERPRINT,
    TORCH_FINGERPRINT,
    torch_view,
    view_at,
)

logger = logging.getLogger(__name__)

_MT_WORDS = 624
_MT_FORMAT = f"=i{_MT_WORDS}I"  # CPython's RandomObject: int index; uint32_t state[624]
_MT_BYTES = struct.calcsize(_MT_FORMAT)


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


class _PythonRaw:
    """Reads the state of ``random``'s global generator as raw bytes (CPython only).

    The offset of ``index, state[624]`` in the generator object is found once by searching
    the object's memory for what ``getstate()`` says, and kept only if it reproduces
    ``getstate()`` exactly for the global generator and for a second, private one (after
    some draws). Otherwise (another interpreter, a free-threaded build, another layout)
    ``offset`` is None and ``getstate()`` is used."""

    def __init__(self) -> None:
        self.generator: Any = getattr(random.getstate, "__self__", None)
        self.offset: int | None = None
        self._view: memoryview | None = None
        try:
            self.offset = self._find()
        except Exception as exc:  # any surprise: the plain getstate() path
            logger.debug("trainguard: random's state is read with getstate(): %s", exc)
            self.offset = None
        if self.offset is not None:  # the generator is held: its memory stays where it is
            self._view = view_at(id(self.generator) + self.offset, _MT_BYTES)

    def _find(self) -> int | None:
        if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
            return None
        generator = self.generator
        if generator is None or type(generator) is not random.Random:
            return None
        size = sys.getsizeof(generator)
        if size < _MT_BYTES:
            return None
        version, words, _ = generator.getstate()
        expected = struct.pack(_MT_FORMAT, words[-1], *words[:-1])
        offset = ctypes.string_at(id(generator), size).find(expected)
        if offset < 16:  # not found, or inside the object header
            return None
        other = random.Random(20260)
        other.gauss(0.0, 1.0)  # leaves gauss_next set
        candidates: list[random.Random] = [generator, other]
        for candidate in candidates:
            gauss_next = getattr(candidate, "gauss_next", None)
            if _python_state(_read(candidate, offset), gauss_next, version) != (
                candidate.getstate()
            ):
                return None
        return offset

    def readable(self) -> bool:
        """Whether the state is read raw: the layout was found and the module still uses
        the generator it was found in (not replaced)."""
        return (
            self.offset is not None
            and self._view is not None
            and getattr(random.getstate, "__self__", None) is self.generator
        )

    def take(self) -> Any:
        """The raw state (materialized by ``state``); ``getstate()``'s tuple on fallback."""
        if not self.readable():
            return random.getstate()
        view: Any = self._view
        return (view.tobytes(), getattr(self.generator, "gauss_next", None))

    def state(self, taken: Any) -> Any:
        if self.offset is None or not isinstance(taken[0], bytes):
            return taken
        return _python_state(taken[0], taken[1], random.Random.VERSION)


def _read(generator: object, offset: int) -> bytes:
    return ctypes.string_at(id(generator) + offset, _MT_BYTES)


def _python_state(raw: bytes, gauss_next: Any, version: int) -> tuple[Any, ...]:
    index, *words = struct.unpack(_MT_FORMAT, raw)
    return (version, (*words, index), gauss_next)


_PYTHON: _PythonRaw | None = None


def _python_raw() -> _PythonRaw:
    global _PYTHON
    if _PYTHON is None:
        _PYTHON = _PythonRaw()
    return _PYTHON


_NP_KEY_WORDS = 624
_NP_STATE_FORMAT = f"={_NP_KEY_WORDS}Ii"  # numpy's mt19937_state: uint32_t key[624]; int pos
_NP_STATE_BYTES = struct.calcsize(_NP_STATE_FORMAT)
_NP_GAUSS_FORMAT = "=i4xd"  # aug_bitgen_t after its bitgen_t*: int has_gauss; double gauss
_NP_GAUSS_BYTES = struct.calcsize(_NP_GAUSS_FORMAT)
_POINTER = struct.Struct("=Q") if ctypes.sizeof(ctypes.c_void_p) == 8 else struct.Struct("=I")


class _NumpyRaw:
    """Reads the state of NumPy's legacy global generator (``np.random.get_state()``) raw.

    The MT19937 state (``uint32 key[624]; int pos``) lives at the bit generator's public
    ``ctypes.state_address``. The legacy gaussian cache lives in the ``RandomState`` object:
    its ``aug_bitgen_t`` (``bitgen_t *bit_generator; int has_gauss; double gauss``) points
    at the object's own ``bitgen_t``, whose first field is that same state address; both
    offsets are found once by searching the object's memory, and kept only if the raw reads
    reproduce ``get_state()`` exactly for the global generator and for a private one (with
    a cached gaussian and without). Otherwise (another interpreter or layout, a bit
    generator other than MT19937) ``offset`` is None and ``get_state()`` is used."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.generator: Any = getattr(module.get_state, "__self__", None)
        self.bit_generator: Any = getattr(self.generator, "_bit_generator", None)
        self.offset: int | None = None
        self.address = 0
        self._views: tuple[memoryview, memoryview] | None = None
        self.lock: Any = contextlib.nullcontext()
        try:
            self.offset = self._find()
        except Exception as exc:  # any surprise: the plain get_state() path
            logger.debug("trainguard: NumPy's state is read with get_state(): %s", exc)
            self.offset = None

    def _find(self) -> int | None:
        if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
            return None
        generator = self.generator
        if generator is None or type(generator).__name__ != "RandomState":
            return None
        if type(self.bit_generator).__name__ != "MT19937":
            return None
        offset = _aug_offset(generator)
        if offset is None:
            return None
        other = type(generator)(20260)
        other.standard_normal()  # leaves has_gauss set
        plain = type(generator)(20261)
        plain.random_sample()  # has_gauss 0
        for candidate in (generator, other, plain):
            if not _same_numpy_state(_numpy_state(_numpy_read(candidate, offset)), candidate):
                return None
        self.address = int(self.bit_generator.ctypes.state_address)
        # The RandomState's lock is its bit generator's: its draws and get_state() hold it.
        self.lock = self.bit_generator.lock
        # Both held (self.generator, self.bit_generator): their memory stays where it is
        self._views = (
            view_at(self.address, _NP_STATE_BYTES),
            view_at(id(generator) + offset, _NP_GAUSS_BYTES),
        )
        return offset

    def readable(self) -> bool:
        """Whether the state is read raw: the layout was found and the module still uses
        the generator and bit generator it was found in."""
        generator = self.generator
        return (
            self.offset is not None
            and self._views is not None
            and getattr(self.module.get_state, "__self__", None) is generator
            and getattr(generator, "_bit_generator", None) is self.bit_generator
        )

    def take(self) -> Any:
        """The raw state (``_numpy_value`` materializes it); ``get_state()``'s on fallback."""
        if not self.readable():
            return self.module.get_state()
        views: Any = self._views
        with self.lock:  # as get_state(): a draw in another thread holds it (without the GIL)
            return (views[0].tobytes(), views[1].tobytes())


def _numpy_value(taken: Any) -> Any:
    """A ``_NumpyRaw.take()`` as ``get_state()`` gives it."""
    if isinstance(taken, tuple) and len(taken) == 2 and isinstance(taken[0], bytes):
        return _numpy_state(taken)
    return taken


def _aug_offset(generator: Any) -> int | None:
    """Where ``has_gauss`` starts in a ``RandomState`` object (None when not found)."""
    size = type(generator).__basicsize__
    memory = ctypes.string_at(id(generator), size)
    address = int(generator._bit_generator.ctypes.state_address)
    bitgen = memory.find(_POINTER.pack(address))  # bitgen_t's first field: void *state
    if bitgen < 16:
        return None
    aug = memory.find(_POINTER.pack(id(generator) + bitgen))  # aug_bitgen_t.bit_generator
    if aug < 16 or aug + _POINTER.size + _NP_GAUSS_BYTES > size:
        return None
    return aug + _POINTER.size


def _numpy_read(generator: Any, offset: int) -> tuple[bytes, bytes]:
    address = int(generator._bit_generator.ctypes.state_address)
    return (
        ctypes.string_at(address, _NP_STATE_BYTES),
        ctypes.string_at(id(generator) + offset, _NP_GAUSS_BYTES),
    )


def _numpy_state(taken: tuple[bytes, bytes]) -> tuple[Any, ...]:
    """``get_state()``'s legacy tuple: ('MT19937', key uint32[624], pos, has_gauss, gauss)."""
    import numpy as np

    raw, gauss_raw = taken
    key = np.frombuffer(raw, dtype=np.uint32, count=_NP_KEY_WORDS).copy()
    (pos,) = struct.unpack_from("=i", raw, 4 * _NP_KEY_WORDS)
    has_gauss, gauss = struct.unpack(_NP_GAUSS_FORMAT, gauss_raw)
    return ("MT19937", key, pos, has_gauss, gauss)


def _same_numpy_state(found: tuple[Any, ...], generator: Any) -> bool:
    import numpy as np

    expected = generator.get_state()
    return (
        isinstance(expected, tuple)
        and len(expected) == 5
        and found[0] == expected[0]
        and found[1].dtype == expected[1].dtype
        and bool(np.array_equal(found[1], expected[1]))
        and found[2:] == tuple(expected[2:])
        and all(type(a) is type(b) for a, b in zip(found[2:], expected[2:], strict=True))
    )


_NUMPY: _NumpyRaw | None = None


def _numpy_raw(module: Any) -> _NumpyRaw:
    global _NUMPY
    if _NUMPY is None or _NUMPY.module is not module:
        _NUMPY = _NumpyRaw(module)
    return _NUMPY


class _Marks:
    """What ``_fingerprint`` reads, bound once for the ``numpy.random`` module of the moment
    (None: not imported): the raw readers and each generator's ``struct`` read (``reads``
    None when one of them is not read raw)."""

    __slots__ = ("numpy", "numpy_random", "python", "reads")

    def __init__(self, numpy_random: Any) -> None:
        self.numpy_random = numpy_random
        self.python = _python_raw()
        self.numpy = _numpy_raw(numpy_random) if numpy_random is not None else None
        self.reads: tuple[Callable[[], tuple[Any, ...]], ...] | None = None
        torch_raw, python_raw = torch_view(), self.python._view
        if torch_raw is None or python_raw is None:
            return
        reads: tuple[Callable[[], tuple[Any, ...]], ...] = (
            partial(TORCH_FINGERPRINT.unpack_from, torch_raw),
            partial(PYTHON_FINGERPRINT.unpack_from, python_raw),
        )
        if self.numpy is not None:
            if self.numpy._views is None:
                return
            reads += (partial(NUMPY_FINGERPRINT.unpack_from, self.numpy._views[0]),)
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
    views: Any = numpy._views
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
        self._python = (_PYTHON or _python_raw()).take()
        numpy_random = sys.modules.get("numpy.random")
        if numpy_random is None:
            self._numpy = None
        elif _NUMPY is not None and _NUMPY.module is numpy_random:  # the usual case
            self._numpy = _NUMPY.take()
        else:
            self._numpy = _numpy_raw(numpy_random).take()
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

    def state(self) -> dict[str, Any]:
        """``rng_state()``'s dict of the moment the snapshot was taken."""
        if self._state is None:
            state: dict[str, Any] = {
                "python": _python_raw().state(self._python),
                "torch": self._torch,
            }
            if self._numpy is not None:
                state["numpy"] = _numpy_value(self._numpy)
            if self._cuda is not None:
                state["cuda"] = self._cuda
            self._state = state
        return self._state
