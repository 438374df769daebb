"""Whether the random generators moved since the last snapshot: a few words read raw.

``RngSnapshot.take()`` runs at every step's first forward and copies some 10 KB of generator
state (torch's CPU generator, Python's ``random``, NumPy's legacy global). A step that draws
nothing (no dropout, no random op inside the step: most language models train with dropout
0, many small policies and tabular nets too) leaves them as they were, and the snapshot of
the step before is still exact: ``take()`` hands it out again when the fingerprint of every
generator is the one it had then. On the tiny model of ``benchmarks/fixed_cost.py`` the
copies took 10 of the guard's 88 us a step, the fingerprint 5 (``git show
3c1ebd7:docs/benchmarks.md``, "Round 9").

The fingerprint of a Mersenne Twister (all three are MT19937) is its position (Python's
``index``, torch's ``left_``/``next_`` and seed, NumPy's ``pos``), three of its 624 state words
(0, 311 and 623) and its cached normal sample (Python's ``gauss_next``, torch's float and
double caches, NumPy's ``has_gauss``/``gauss``). Why that tells: each 32-bit draw moves the
position by one, so the same position after draws means a multiple of 624 words was drawn,
and every 624 words the whole state is regenerated (each word a new value); seeding rewrites
every word too. A moved generator thus shows the same fingerprint only if three
regenerated 32-bit words all equal the old ones (a chance of 2**-96 per step). What it does
not see: a state set by hand (``setstate``) that differs from the last one only in words
other than those three, between two steps.

Each read is a ``struct`` unpack at a fixed offset of the generator's own memory, found once
and validated against the generator's official state (``_TorchRaw``; Python's and NumPy's
raw readers in ``rng_raw.py``). A CUDA device's generator (Philox) is its seed and offset,
read as they are (``rng._cuda_fingerprint``). Without a validated layout (another
interpreter or torch build, a replaced or non-MT19937 generator) or a CUDA offset this torch
cannot read, ``rng._fingerprint`` gives None and every snapshot is taken afresh.
The reads take no lock (torch's engine has a mutex, NumPy's generator a lock): a draw in
another thread at that moment is seen either before or after it, as a locked read would
order it; a torn read differs from the last fingerprint, and the copy is then made as
before (``get_state()``, NumPy's under its lock).
"""

from __future__ import annotations

import ctypes
import logging
import struct
from typing import Any

import torch

logger = logging.getLogger(__name__)

_WORDS = 624
_SAMPLED = (0, 311, 623)
"""The state words read: the first, one in the middle, the last."""


def _sampled_words(head: str, tail: str = "") -> struct.Struct:
    """``head``, then the sampled uint32 words of a 624-word state that follows it, then
    ``tail`` right after the state."""
    fields, at = [head], 0
    for word in _SAMPLED:
        fields.append(f"{4 * (word - at)}x" if word > at else "")
        fields.append("I")
        at = word + 1
    fields.append(f"{4 * (_WORDS - at)}x" if at < _WORDS else "")
    return struct.Struct("=" + "".join(fields) + tail)


_TORCH_HEADER = struct.Struct("=QiBxxxI")
"""at::mt19937's data before its state: ``uint64 seed_; int left_; bool seeded_; uint32
next_``."""
_TORCH_CACHES = "4xf?3xd?"
"""What follows the engine's state: its padding to 8 bytes, then ``std::optional<float>`` and
``std::optional<double>`` (the cached normal samples, each a value and a flag)."""
_TORCH_FIELDS = _sampled_words("QiB3xI", _TORCH_CACHES)
"""The fingerprint's fields one by one (the layout's validation)."""
TORCH_FINGERPRINT = _sampled_words("QiB3xI", f"4x{struct.calcsize('=' + _TORCH_CACHES) - 4}s")
"""The per-step read: ``_TORCH_FIELDS`` with the caches as raw bytes. A cache's value bytes
hold whatever was copied there while its flag is clear, but they change only when the
optional is written (a draw or ``set_state``): at worst a snapshot taken afresh."""
PYTHON_FINGERPRINT = _sampled_words("i")
"""CPython's ``RandomObject`` raw (``rng_raw.PythonRaw``): ``int index`` then the state."""
NUMPY_FINGERPRINT = _sampled_words("", "i")
"""NumPy's ``mt19937_state`` raw (``rng_raw.NumpyRaw``): the key, then ``int pos``."""
_LEGACY = struct.Struct(f"=QiiQ{_WORDS}Q")
"""The head of ``get_state()``'s legacy layout: seed, left, seeded, next, the words as
uint64."""
_SEARCH = range(8, 264, 4)
"""Where the engine may start in a ``CPUGeneratorImpl`` (after ``GeneratorImpl``'s fields)."""


class _TorchRaw:
    """Reads the fingerprint of torch's default CPU generator raw: its ``CPUGeneratorImpl``
    (``Generator._cdata``) holds the MT19937 engine and the normal caches at an offset found
    once by matching ``get_state()``, then checked on a private generator: the offset is the
    same there, and the fingerprint changes with every state that ``set_state`` gives it
    (another position, seed or word, a cached float or double normal sample) and with a
    draw. Otherwise ``view`` is None (no fingerprint)."""

    def __init__(self) -> None:
        self.view: memoryview | None = None
        try:
            self.view = self._validated()
        except Exception as exc:  # any surprise: no fingerprint, every snapshot afresh
            logger.debug("trainguard: torch's generator is not fingerprinted: %s", exc)
            self.view = None

    def _validated(self) -> memoryview | None:
        generator = torch.default_generator
        offset = _engine_offset(generator)
        if offset is None:
            return None
        private = torch.Generator().manual_seed(20260)
        if _engine_offset(private) != offset or not _tells_states_apart(private, offset):
            return None
        return view_at(_address(generator) + offset, TORCH_FINGERPRINT.size)


def _torch_values(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """The fingerprint's fields, each cached sample's value kept only when its flag is set."""
    *engine, float_value, float_set, double_value, double_set = values
    return (
        *engine,
        float_set,
        float_value if float_set else 0.0,
        double_set,
        double_value if double_set else 0.0,
    )


def _engine_offset(generator: torch.Generator) -> int | None:
    """Where the engine starts in the generator's ``CPUGeneratorImpl``, None if not found
    (the header's padding after ``seeded_`` is not compared: it holds whatever was there)."""
    seed, left, seeded, next_, *words = _LEGACY.unpack_from(bytes(generator.get_state().tolist()))
    header = _TORCH_HEADER.pack(seed, left, bool(seeded), next_)
    fields = ((0, header[:13]), (16, header[16:]), (_TORCH_HEADER.size, _pack_words(words)))
    address = _address(generator)
    for offset in _SEARCH:
        if all(ctypes.string_at(address + offset + at, len(part)) == part for at, part in fields):
            return offset
    return None


def _pack_words(words: list[int]) -> bytes:
    return struct.pack(f"={_WORDS}I", *words)


def _tells_states_apart(generator: torch.Generator, offset: int) -> bool:
    """On a private generator: each changed state changes the fingerprint read at
    ``offset``, and the state set back gives the first fingerprint again."""
    base = generator.get_state()

    def read() -> tuple[Any, ...]:
        raw = ctypes.string_at(_address(generator) + offset, _TORCH_FIELDS.size)
        return _torch_values(_TORCH_FIELDS.unpack(raw))

    first = read()
    for changed in _changed_states(base):
        generator.set_state(changed)
        if read() == first:
            return False
        generator.set_state(base)
        if read() != first:
            return False
    torch.rand(1, generator=generator)
    return read() != first


def _changed_states(base: torch.Tensor) -> list[torch.Tensor]:
    """``get_state()`` tensors that differ from ``base`` in one field each: the seed, the
    position, each sampled word, a cached double normal sample (legacy ``normal_x``,
    ``normal_rho``, ``normal_is_valid``) and a cached float sample (and its flag)."""
    normal = _LEGACY.size  # normal_x, normal_y, normal_rho (double), normal_is_valid (int)
    float_at = normal + 32  # the legacy struct padded to 8 bytes: float, then its bool flag
    edits: list[list[tuple[int, bytes]]] = [
        [(0, struct.pack("=Q", 12345))],  # seed
        [(8, struct.pack("=i", 7))],  # left
        [(16, struct.pack("=Q", 3))],  # next
        *[[(24 + 8 * word, struct.pack("=Q", 0x9E3779B9))] for word in _SAMPLED],
        [(normal, struct.pack("=d", 0.25)), (normal + 16, struct.pack("=di", 0.5, 1))],
        [(float_at, struct.pack("=f?", 0.5, True))],
    ]
    states = []
    for fields in edits:
        changed = base.clone()
        for at, value in fields:
            changed[at : at + len(value)] = torch.tensor(list(value), dtype=torch.uint8)
        states.append(changed)
    return states


def _address(generator: torch.Generator) -> int:
    """Where the generator's ``GeneratorImpl`` lives (``Generator._cdata``)."""
    return int(generator._cdata)  # type: ignore[attr-defined]


def view_at(address: int, size: int) -> memoryview:
    """A view of ``size`` bytes of memory at ``address``, made once: each read through it is
    a plain copy (``ctypes.string_at`` is a foreign call, several times slower at every
    step). The caller holds the object that owns the memory for as long as it uses the
    view."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


_TORCH: _TorchRaw | None = None


def torch_view() -> memoryview | None:
    """The validated view of torch's default CPU generator that ``TORCH_FINGERPRINT`` reads
    (None: not fingerprinted); validated on the first call."""
    global _TORCH
    if _TORCH is None:
        _TORCH = _TorchRaw()
    return _TORCH.view
