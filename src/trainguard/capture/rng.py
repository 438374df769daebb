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
- NumPy's legacy global generator: ``np.random.get_state()`` (about 45 us), only when
  ``numpy.random`` was imported (before that no global NumPy generator exists: nothing
  draws from it). A program whose step's forward is the first to import ``numpy.random``
  and draw from it is not replayed exactly (its state was seeded at that import);
- CUDA: ``torch.cuda.get_rng_state_all()`` once CUDA is initialized.
"""

from __future__ import annotations

import ctypes
import logging
import random
import struct
import sys
import sysconfig
from typing import Any

import torch

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
        try:
            self.offset = self._find()
        except Exception as exc:  # any surprise: the plain getstate() path
            logger.debug("trainguard: random's state is read with getstate(): %s", exc)
            self.offset = None

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

    def take(self) -> Any:
        """The raw state (materialized by ``state``); ``getstate()``'s tuple on fallback."""
        generator = self.generator
        if self.offset is None or generator is None:
            return random.getstate()
        if getattr(random.getstate, "__self__", None) is not generator:
            return random.getstate()  # the module's generator was replaced
        return (_read(generator, self.offset), getattr(generator, "gauss_next", None))

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


class RngSnapshot:
    """The states of every generator at one moment, copied cheaply; ``state()`` gives them as
    ``rng_state()`` does (built on the first call, then kept)."""

    __slots__ = ("_cuda", "_numpy", "_python", "_state", "_torch")

    def __init__(self) -> None:
        self._torch = torch.default_generator.get_state()
        self._python = _python_raw().take()
        numpy_random = sys.modules.get("numpy.random")
        self._numpy = numpy_random.get_state() if numpy_random is not None else None
        cuda = torch.cuda.is_initialized() and torch.cuda.is_available()  # type: ignore[no-untyped-call]
        self._cuda = torch.cuda.get_rng_state_all() if cuda else None
        self._state: dict[str, Any] | None = None

    @classmethod
    def take(cls) -> RngSnapshot:
        return cls()

    def state(self) -> dict[str, Any]:
        """``rng_state()``'s dict of the moment the snapshot was taken."""
        if self._state is None:
            state: dict[str, Any] = {
                "python": _python_raw().state(self._python),
                "torch": self._torch,
            }
            if self._numpy is not None:
                state["numpy"] = self._numpy
            if self._cuda is not None:
                state["cuda"] = self._cuda
            self._state = state
        return self._state
