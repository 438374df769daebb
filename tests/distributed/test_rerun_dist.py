"""Rerun before deciding (``Guard(rerun=loss_fn)``) on 2 DDP ranks with dropout and
BatchNorm: a one-off fault costs nothing (bit-identical to a run without it), a persistent
one is skipped on every rank, and a host that keeps faulting is named and every rank exits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tg_dist import run_ranks, values
from tg_rerun import train

import trainguard as tg
from trainguard.exitcodes import EXIT_SUSPECT_HOST
from trainguard.report.summary import summarize
from trainguard.report.text import report_text


def _events(run_dir: Path, rank: int, kind: str) -> list[dict[str, Any]]:
    lines = (run_dir / "events" / f"rank-{rank}.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def _job(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    base = Path(tmp)
    return {
        "clean": train(rank, base / "clean", None),
        "transient": train(rank, base / "transient", "transient"),
        "persistent": train(rank, base / "persistent", "persistent"),
    }


def test_a_transient_fault_costs_nothing_a_persistent_one_is_skipped(tmp_path: Path) -> None:
    results = values(run_ranks(_job, 2, str(tmp_path), timeout=90))
    for rank, result in enumerate(results):
        clean, transient, persistent = result["clean"], result["transient"], result["persistent"]
        assert transient["skipped"] == [] and clean["skipped"] == []
        for key, want in clean["state"].items():  # weights, BatchNorm statistics, counters
            assert torch.equal(transient["state"][key], want), f"rank {rank} {key}"
        assert torch.equal(transient["rng"], clean["rng"])  # the dropout stream is the same
        assert persistent["skipped"] == [3]
        reruns = _events(tmp_path / "transient", rank, "rerun")
        assert [(e["step"], e["verdict"], e["ranks"]) for e in reruns] == [(3, "transient", [1])]
        reruns = _events(tmp_path / "persistent", rank, "rerun")
        assert [(e["step"], e["verdict"], e["ranks"]) for e in reruns] == [(3, "persistent", [1])]
        assert not _events(tmp_path / "transient", rank, "skip")
    bundle = next((tmp_path / "persistent" / "captures").glob("step-*"))
    assert json.loads((bundle / "rank-1" / "meta.json").read_text())["rerun"] == "persistent"


def _suspect(rank: int, world_size: int, tmp: str) -> int:
    try:
        train(
            rank,
            Path(tmp),
            "transient",
            fault_steps=(1, 3, 5),
            rerun=tg.RerunConfig(suspect_host_after=3),
        )
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def test_a_host_that_keeps_faulting_is_named_and_every_rank_exits(tmp_path: Path) -> None:
    codes = values(run_ranks(_suspect, 2, str(tmp_path), timeout=90))
    assert codes == [EXIT_SUSPECT_HOST, EXIT_SUSPECT_HOST]
    for rank in range(2):
        events = _events(tmp_path, rank, "suspect_host")
        assert len(events) == 1 and events[0]["step"] == 5
        assert events[0]["ranks"] == [1] and events[0]["exit_code"] == EXIT_SUSPECT_HOST
        assert events[0]["transient_faults"] == {events[0]["hosts"][0]: 3}
        last = tg.read_events(tmp_path, rank)[-1]  # the guard closed before the exit
        assert (last["kind"], last["step"]) == ("close", 5) and "closed" not in last
    host = _events(tmp_path, 0, "suspect_host")[0]["hosts"][0]
    summary = summarize(tmp_path)  # what `trainguard report` prints
    assert summary.hosts == {host: {"transient": 3, "persistent": 0, "suspect": 1}}
    text = report_text(summary)
    assert f"{host}: 3 transient, 0 persistent  SUSPECT" in text
    assert "step 5: transient on ranks [1]" in text


def _spread(rank: int, world_size: int, tmp: str) -> int:
    try:
        train(
            rank,
            Path(tmp),
            "transient_grad",
            fault_steps=(1, 3, 5),
            rerun=tg.RerunConfig(suspect_host_after=3),
        )
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def test_a_gradient_fault_spread_by_ddp_blames_no_host(tmp_path: Path) -> None:
    """Rank 1's NaN gradient reaches every rank through DDP's all-reduce: the agreement sees
    non-finite gradients on all of them. No host made it as far as the guard can tell, so
    none is counted (every host was, and with suspect_host_after=3 every rank exited 94
    telling the user to drain every node)."""
    codes = values(run_ranks(_spread, 2, str(tmp_path), timeout=90))
    assert codes == [0, 0]
    for rank in range(2):
        reruns = _events(tmp_path, rank, "rerun")
        assert [(e["step"], e["verdict"]) for e in reruns] == [(s, "transient") for s in (1, 3, 5)]
        assert all(e["ranks"] == [0, 1] and e["origin_ranks"] == [] for e in reruns)
        assert all(e["hosts"] == [] for e in reruns)
        assert not _events(tmp_path, rank, "suspect_host")
