"""The per-step RNG snapshot (issue 26): cheap raw copies that give exactly rng_state()."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from trainguard.capture import rng as rng_module
from trainguard.capture.rng import RngSnapshot, _PythonRaw, rng_state, set_rng_state


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
    raw = _PythonRaw()
    assert raw.offset is not None  # CPython with the GIL: the fast path is taken
    random.seed(1)
    taken = raw.take()
    assert isinstance(taken[0], bytes)
    assert raw.state(taken) == random.getstate()


def test_a_replaced_module_generator_falls_back_to_getstate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    raw = _PythonRaw()
    other = random.Random(5)
    monkeypatch.setattr(random, "getstate", other.getstate)
    assert raw.take() == other.getstate()


def test_without_the_layout_getstate_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rng_module, "_PYTHON", _PythonRaw())
    monkeypatch.setattr(rng_module._PYTHON, "offset", None)
    random.seed(2)
    snapshot = RngSnapshot.take()
    expected = random.getstate()
    random.random()
    assert snapshot.state()["python"] == expected
