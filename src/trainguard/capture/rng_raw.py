"""Raw reads of the Mersenne Twisters of Python's ``random`` and NumPy's legacy global
generator: their state copied from the generator's own memory (about 1 us each, where
``random.getstate()`` takes about 11 us and ``np.random.get_state()`` 45-75 us).

Each layout is found once by searching the generator object's memory for what the official
state call says, and kept only if the raw read reproduces that state exactly, for the
global generator and for private ones; otherwise (another interpreter, a free-threaded
build, another layout or bit generator) the official call is used. ``rng.RngSnapshot``
takes these per step; ``rng.rng_state()`` and ``set_rng_state()`` stay on the official
calls. ``python_raw()`` and ``numpy_raw(module)`` hand out the reader of the moment (made
once, and anew when ``numpy.random`` is another module).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import random
import struct
import sys
import sysconfig
from typing import Any

from trainguard.capture.rng_fingerprint import view_at

logger = logging.getLogger(__name__)

_MT_WORDS = 624
_MT_FORMAT = f"=i{_MT_WORDS}I"  # CPython's RandomObject: int index; uint32_t state[624]
_MT_BYTES = struct.calcsize(_MT_FORMAT)


class PythonRaw:
    """Reads the state of ``random``'s global generator as raw bytes (CPython only).

    The offset of ``index, state[624]`` in the generator object is found once by searching
    the object's memory for what ``getstate()`` says, and kept only if it reproduces
    ``getstate()`` exactly for the global generator and for a second, private one (after
    some draws). Otherwise (another interpreter, a free-threaded build, another layout)
    ``offset`` is None and ``getstate()`` is used."""

    def __init__(self) -> None:
        self.generator: Any = getattr(random.getstate, "__self__", None)
        self.offset: int | None = None
        self.view: memoryview | None = None
        try:
            self.offset = self._find()
        except Exception as exc:  # any surprise: the plain getstate() path
            logger.debug("trainguard: random's state is read with getstate(): %s", exc)
            self.offset = None
        if self.offset is not None:  # the generator is held: its memory stays where it is
            self.view = view_at(id(self.generator) + self.offset, _MT_BYTES)

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
            and self.view is not None
            and getattr(random.getstate, "__self__", None) is self.generator
        )

    def take(self) -> Any:
        """The raw state (materialized by ``state``); ``getstate()``'s tuple on fallback."""
        if not self.readable():
            return random.getstate()
        view: Any = self.view
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


_PYTHON: PythonRaw | None = None


def python_raw() -> PythonRaw:
    global _PYTHON
    if _PYTHON is None:
        _PYTHON = PythonRaw()
    return _PYTHON


_NP_KEY_WORDS = 624
_NP_STATE_FORMAT = f"={_NP_KEY_WORDS}Ii"  # numpy's mt19937_state: uint32_t key[624]; int pos
_NP_STATE_BYTES = struct.calcsize(_NP_STATE_FORMAT)
_NP_GAUSS_FORMAT = "=i4xd"  # aug_bitgen_t after its bitgen_t*: int has_gauss; double gauss
_NP_GAUSS_BYTES = struct.calcsize(_NP_GAUSS_FORMAT)
_POINTER = struct.Struct("=Q") if ctypes.sizeof(ctypes.c_void_p) == 8 else struct.Struct("=I")


class NumpyRaw:
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
        self.views: tuple[memoryview, memoryview] | None = None
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
        self.views = (
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
            and self.views is not None
            and getattr(self.module.get_state, "__self__", None) is generator
            and getattr(generator, "_bit_generator", None) is self.bit_generator
        )

    def take(self) -> Any:
        """The raw state (``numpy_value`` materializes it); ``get_state()``'s on fallback."""
        if not self.readable():
            return self.module.get_state()
        views: Any = self.views
        with self.lock:  # as get_state(): a draw in another thread holds it (without the GIL)
            return (views[0].tobytes(), views[1].tobytes())


def numpy_value(taken: Any) -> Any:
    """A ``NumpyRaw.take()`` as ``get_state()`` gives it."""
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


_NUMPY: NumpyRaw | None = None


def numpy_raw(module: Any) -> NumpyRaw:
    global _NUMPY
    if _NUMPY is None or _NUMPY.module is not module:
        _NUMPY = NumpyRaw(module)
    return _NUMPY
