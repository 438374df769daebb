"""The integrations overhead benchmark still runs, and its by-step ratio means what it says.

``benchmarks/integrations_overhead.py --quick`` runs in a subprocess (both frameworks, tiny
sizes, two rounds); the step clock's parity ratio is checked on known tick times.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "integrations_overhead.py"

pytest.importorskip("lightning")
pytest.importorskip("transformers")


@pytest.fixture()
def bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The benchmark's runners quiet the frameworks' and trainguard's loggers (to ERROR) for
    its own process; put the levels back so later tests in this process still log."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import integrations_overhead

    names = ("lightning", "lightning.pytorch", "lightning.fabric", "transformers", "trainguard")
    levels = {name: logging.getLogger(name).level for name in names}
    yield integrations_overhead
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def test_parity_ratio_is_even_over_odd_step_time(bench: Any) -> None:
    clock = bench.StepClock(warmup=2)
    t = 0.0
    for step in range(12):  # tick k ends step k: even steps take 3 s, odd ones 1 s
        t += 3.0 if step % 2 == 0 else 1.0
        clock.times.append(t)
    assert clock.parity_ratio() == pytest.approx(3.0)
    # steps 3..11 after the warm-up: five odd ones (1 s) and four even ones (3 s)
    assert clock.step_time() == pytest.approx(1.0)


def test_step_clock_keeps_process_cpu_time(bench: Any) -> None:
    clock = bench.StepClock(warmup=0)
    for _ in range(3):
        sum(i * i for i in range(20000))  # some CPU work between ticks
        clock.tick()
    assert len(clock.cpu_times) == len(clock.times) == 3
    assert clock.step_time(cpu=True) > 0


def test_acts_on(bench: Any) -> None:
    acts_on = bench.acts_on
    assert [acts_on(s, True) for s in range(4)] == [True, False, True, False]
    assert all(acts_on(s, False) for s in range(4))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("by_step", [False, True])
def test_quick_run_writes_every_mode(tmp_path: Path, by_step: bool) -> None:
    out = tmp_path / "integrations.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--out", str(out)]
    cmd += ["--by-step"] if by_step else ["--threads", "1"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert ("even / odd steps" in proc.stdout) == by_step
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["settings"]["by_step"] is by_step
    rows = {(r["framework"], r["mode"]): r for r in report["results"]}
    assert set(rows) == {
        (f, m) for f in ("lightning", "transformers") for m in ("bare", "trainguard", "nancapture")
    }
    for key, row in rows.items():
        assert len(row["ratio_per_round"]) == 2, key
        assert all(r > 0 for r in row["ratio_per_round"]), key
        assert row["step_ms"] > 0 and row["cpu_step_ms"] > 0, key
        assert len(row["cpu_ratio_per_round"]) == 2, key
        if not by_step and key[1] == "bare":
            assert row["ratio"] == row["cpu_ratio"] == 1.0
    assert report["settings"]["threads"] == (0 if by_step else 1)
    if not by_step:  # --threads 1 really ran torch on one thread
        assert report["settings"]["torch_threads"] == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("framework", ["transformers", "lightning"])
def test_by_step_guard_checks_every_other_step(
    bench: Any, framework: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --by-step the guard checks 6 of 12 steps; without it, all 12."""
    from trainguard.integrations.lightning import TrainGuard
    from trainguard.integrations.transformers import TrainGuardCallback

    checked: list[int] = []
    for cls, name in ((TrainGuardCallback, "close"), (TrainGuard, "_close")):
        original = getattr(cls, name)

        def close(self: Any, original: Any = original) -> None:
            if self.guard is not None:
                checked.append(self.guard.state.step)
            original(self)

        monkeypatch.setattr(cls, name, close)
    tiny = bench.WORKLOADS["tiny"]
    for by_step in (False, True):
        bench.RUNNERS[framework]("trainguard", 12, 3, tiny, tmp_path / str(by_step), by_step)
    assert checked == [12, 6]
