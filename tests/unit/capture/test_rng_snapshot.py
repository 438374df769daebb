"""The per-step RNG snapshot (issue 26): cheap raw copies that give exactly rng_state()."""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np
import pytest
import torch

from trainguard.capture import rng as rng_module
from trainguard.capture import rng_raw
from trainguard.capture.rng import RngSnapshot, rng_state, set_rng_state
from trainguard.capture.rng_raw import PythonRaw


def _draws() -> tuple[list[float], list[float], torch.Tensor, np.ndarray]:
    gauss = [random.gauss(0.0, 1.0) for _ in range(3)]  # pairs: gauss_next matters
    return [random.random() for _ in range(4)], gauss, torch.rand(5), np.random.randn(3)


def test_snapshot_equals_rng_state_and_replays_exactly() -> None:
    random.seed(7)
    random.gauss(0.0, 1.0)  # leaves gauss_next set
    np.random.seed(3)
    np.random.randn()  # leaves NumPy's cached gaussian set
    torch.manual_seed(11)
    snapshot, plain = RngSnapshot.take(), rng_state()
    first = _draws()
    state = snapshot.state()
    assert state["python"] == plain["python"]
    assert torch.equal(state["torch"], plain["torch"])
    assert str(state["numpy"]) == str(plain["numpy"])
    set_rng_state(state)
    again = _draws()
    assert first[:2] == again[:2]
    assert torch.equal(first[2], again[2]) and np.array_equal(first[3], again[3])
    assert snapshot.state() is state  # built once


def test_python_state_is_read_raw_on_cpython() -> None:
    raw = PythonRaw()
    assert raw.offset is not None  # CPython with the GIL: the fast path is taken
    random.seed(1)
    taken = raw.take()
    assert isinstance(taken[0], bytes)
    assert raw.state(taken) == random.getstate()


def test_a_replaced_module_generator_falls_back_to_getstate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    raw = PythonRaw()
    other = random.Random(5)
    monkeypatch.setattr(random, "getstate", other.getstate)
    assert raw.take() == other.getstate()


def test_without_the_layout_getstate_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rng_raw, "_PYTHON", PythonRaw())
    monkeypatch.setattr(rng_raw._PYTHON, "offset", None)
    random.seed(2)
    snapshot = RngSnapshot.take()
    expected = random.getstate()
    random.random()
    assert snapshot.state()["python"] == expected


def test_numpy_state_is_read_raw_and_exact() -> None:
    """NumPy's legacy global state read raw equals get_state(), gaussian cache included."""
    raw = rng_raw.NumpyRaw(np.random)
    assert raw.offset is not None  # CPython with the GIL, MT19937: the fast path is taken
    for draw in (np.random.randn, np.random.random_sample, lambda: np.random.randn(3)):
        np.random.seed(5)
        draw()
        taken = raw.take()
        assert isinstance(taken[0], bytes)
        expected: Any = np.random.get_state()
        found = rng_raw.numpy_value(taken)
        assert found[0] == expected[0] and np.array_equal(found[1], expected[1])
        assert found[1].dtype == expected[1].dtype and found[1].flags.writeable
        assert found[2:] == expected[2:]
        assert [type(v) for v in found[2:]] == [type(v) for v in expected[2:]]
        assert str(found) == str(expected)


def test_numpy_snapshot_restores_the_gaussian_cache() -> None:
    np.random.seed(9)
    np.random.randn()  # has_gauss: the next randn() returns the cached value
    snapshot = RngSnapshot.take()
    first = np.random.randn(5)
    np.random.set_state(snapshot.state()["numpy"])
    assert np.array_equal(np.random.randn(5), first)


def test_numpy_falls_back_to_get_state(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = rng_raw.NumpyRaw(np.random)
    other = np.random.RandomState(4)
    monkeypatch.setattr(np.random, "get_state", other.get_state)  # the module's replaced
    assert str(raw.take()) == str(other.get_state())
    monkeypatch.undo()
    raw.offset = None  # no layout: get_state() itself
    np.random.seed(2)
    assert str(raw.take()) == str(np.random.get_state())


def test_numpy_another_bit_generator_falls_back() -> None:
    raw = rng_raw.NumpyRaw(np.random)
    np_random: Any = np.random  # the bit generator functions are not in numpy's stubs
    original = np_random.get_bit_generator()
    try:
        np_random.set_bit_generator(np.random.PCG64(1))
        with pytest.warns(RuntimeWarning):  # get_state()'s own warning: not MT19937
            taken = raw.take()
        assert isinstance(taken, dict)  # get_state()'s own value
        assert taken["bit_generator"] == "PCG64"
    finally:
        np_random.set_bit_generator(original)
    assert isinstance(raw.take()[0], bytes)


def test_numpy_raw_read_waits_for_a_draw_in_another_thread() -> None:
    """As get_state(): the raw read holds the generator's lock (a draw holds it, GIL released)."""
    import threading
    import time

    raw = rng_raw.NumpyRaw(np.random)
    assert raw.offset is not None
    done: list[object] = []
    lock = np.random.mtrand._rand._bit_generator.lock
    with lock:
        thread = threading.Thread(target=lambda: done.append(raw.take()))
        thread.start()
        time.sleep(0.2)
        assert not done  # blocked while the lock is held
    thread.join(timeout=10)
    assert done and isinstance(done[0], tuple)


# -- lazy snapshots: the last one again while no generator moved (rng_fingerprint.py) ------


def _same_states(found: dict[str, Any], expected: dict[str, Any]) -> bool:
    return (
        found["python"] == expected["python"]
        and torch.equal(found["torch"], expected["torch"])
        and str(found["numpy"]) == str(expected["numpy"])
    )


def test_a_step_that_draws_nothing_gets_the_last_snapshot_again() -> None:
    np.random.seed(1)
    first = RngSnapshot.take()
    again = RngSnapshot.take()
    assert again is first
    assert _same_states(again.state(), rng_state())


def _wrap_python() -> None:
    for _ in range(624):  # one 32-bit word each: the same index, every word regenerated
        random.getrandbits(32)


def _wrap_torch() -> None:
    torch.randint(0, 2**16, (624,))


_SEEDS = itertools.count(100)  # a new seed each time: the same seed again is no move

_MOVES = {
    "torch draw": lambda: torch.rand(1),
    "torch normal cache set": lambda: torch.randn(1),
    "torch seed": lambda: torch.manual_seed(next(_SEEDS)),
    "torch 624 words": _wrap_torch,
    "python draw": random.random,
    "python gauss": lambda: random.gauss(0.0, 1.0),
    "python seed": lambda: random.seed(next(_SEEDS)),
    "python 624 words": _wrap_python,
    "numpy draw": np.random.random_sample,
    "numpy gauss": np.random.randn,
    "numpy seed": lambda: np.random.seed(next(_SEEDS)),
}


@pytest.mark.parametrize("move", sorted(_MOVES))
def test_any_move_of_a_generator_gives_a_new_exact_snapshot(move: str) -> None:
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    for _ in range(2):  # twice: a cached normal sample is set, then consumed
        before = RngSnapshot.take()
        _MOVES[move]()
        after = RngSnapshot.take()
        assert after is not before
        assert _same_states(after.state(), rng_state())


def test_a_full_cycle_of_draws_keeps_the_position_and_is_still_seen() -> None:
    """The case the sampled words are there for: 624 words drawn, the position unchanged."""
    torch.manual_seed(4)
    random.seed(4)
    python_index, torch_left = random.getstate()[1][-1], _torch_left()
    before = RngSnapshot.take()
    _wrap_python()
    _wrap_torch()
    assert random.getstate()[1][-1] == python_index
    assert _torch_left() == torch_left
    assert RngSnapshot.take() is not before


def _torch_left() -> int:
    return int.from_bytes(bytes(torch.get_rng_state()[8:12].tolist()), "little")


def test_torch_generator_layout_is_found_and_validated() -> None:
    from trainguard.capture import rng_fingerprint

    raw = rng_fingerprint._TorchRaw()
    assert raw.view is not None  # this torch build: the fingerprint is read raw
    offset = rng_fingerprint._engine_offset(torch.default_generator)
    assert offset is not None
    private = torch.Generator().manual_seed(1)
    assert rng_fingerprint._tells_states_apart(private, offset)
    assert not rng_fingerprint._tells_states_apart(private, offset + 4)  # a wrong layout


@pytest.mark.parametrize("cannot", ["torch", "python", "cuda"])
def test_without_a_fingerprint_every_snapshot_is_new(
    cannot: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainguard.capture import rng_fingerprint

    monkeypatch.setattr(rng_module, "_MARKS", None)  # the reads are bound anew
    if cannot == "torch":
        raw = rng_fingerprint._TorchRaw()
        raw.view = None
        monkeypatch.setattr(rng_fingerprint, "_TORCH", raw)
    elif cannot == "python":
        monkeypatch.setattr(rng_raw, "_PYTHON", PythonRaw())
        monkeypatch.setattr(rng_raw._PYTHON, "view", None)
    else:
        # CUDA initialized, but its generators' offsets cannot be read (a CPU generator
        # raises there, as a torch without get_offset would); the copies need no device
        monkeypatch.setattr(torch.cuda, "default_generators", (torch.Generator(),))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    first = RngSnapshot.take()
    assert RngSnapshot.take() is not first
    assert _same_states(RngSnapshot.take().state(), rng_state())


class _FakeCudaGenerator:
    """What the fingerprint reads of a CUDA device's Philox generator: its seed and offset
    (host values). A draw moves the offset; ``manual_seed`` sets the seed, offset 0."""

    def __init__(self, seed: int) -> None:
        self.seed, self.offset = seed, 0

    def initial_seed(self) -> int:
        return self.seed

    def get_offset(self) -> int:
        return self.offset

    def state(self) -> torch.Tensor:
        return torch.tensor([self.seed, self.offset], dtype=torch.int64).view(torch.uint8)


def test_cuda_generators_are_fingerprinted_by_seed_and_offset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With CUDA initialized, a step that draws nothing on any device still gets the last
    snapshot again; a device draw or seed gives a new one holding that device's new state.
    (The real generators: tests/unit/test_cuda.py.)"""
    devices = (_FakeCudaGenerator(5), _FakeCudaGenerator(5))
    monkeypatch.setattr(torch.cuda, "default_generators", ())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: bool(torch.cuda.default_generators))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [g.state() for g in devices])
    before_init = RngSnapshot.take()
    assert "cuda" not in before_init.state()
    monkeypatch.setattr(torch.cuda, "default_generators", devices)  # CUDA's initialization
    first = RngSnapshot.take()
    assert first is not before_init  # the generators CUDA made are in this one
    assert RngSnapshot.take() is first
    for move in (lambda: setattr(devices[1], "offset", 4), lambda: setattr(devices[0], "seed", 9)):
        last = RngSnapshot.take()
        move()
        moved = RngSnapshot.take()
        assert moved is not last
        found = moved.state()["cuda"]
        assert [bytes(t.tolist()) for t in found] == [bytes(g.state().tolist()) for g in devices]
        assert RngSnapshot.take() is moved
