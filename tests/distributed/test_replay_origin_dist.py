"""Replay of real 2-rank DDP bundles: the origin rank, and replicas that disagree.

- One sample on rank 1 makes ``sqrt``'s gradient 0/0 in backward (the loss is finite on
  both ranks); DDP's all-reduce spreads the NaN to rank 0, so the manifest lists both ranks
  in ``grad_ranks`` and none in ``loss_ranks``. Replay without ``--rank`` replays each rank,
  names rank 1 (and its sample) as the origin and rank 0 as having received it; ``--rank 0``
  says that rank 0 received it instead of "not reproduced, suspect the GPU".
- Rank 1 nudges one weight after DDP's start-up broadcast: the bundle's replicas differ and
  the replay's verdict is ``replica_mismatch``, naming the parameter and both ranks.
- Rank 1's loop makes a NaN in the model's input from a finite batch (a normalization by a
  zero std): both ranks skip the step and keep equal weights; only rank 1's meta names the
  forward input, and the replay's verdict is ``input_made_in_loop`` on rank 1, "received"
  on rank 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tg_capture_models as models
import tg_replay_cases as cases
import torch
from tg_dist import run_ranks, values

import trainguard as tg
from trainguard.cli import EXIT_FINDING, main
from trainguard.replay.verdicts import ADVICE, RECEIVED_ADVICE

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple[Path, ...], list[Any]]:
    """The four 2-rank DDP runs (one spawn): their dirs and the ranks' results."""
    names = ("origin", "replica", "loss", "loop")
    dirs = tuple(tmp_path_factory.mktemp(name) for name in names)
    ranks = values(run_ranks(cases.ddp_worker, 2, *map(str, dirs), timeout=100))
    return dirs, ranks


@pytest.fixture(scope="module")
def run_dirs(spawned: tuple[tuple[Path, ...], list[Any]]) -> tuple[Path, Path, Path]:
    """The origin, replica and loss-only runs' dirs."""
    dirs, ranks = spawned
    assert [r["origin"]["nonfinite_steps"] for r in ranks] == [[2], [2]]
    assert [r["replica"]["nonfinite_steps"] for r in ranks] == [[1], [1]]
    assert [r["loss"]["nonfinite_steps"] for r in ranks] == [[1], [1]]
    return dirs[:3]  # type: ignore[return-value]


def test_a_nan_made_in_rank_1s_loop_is_skipped_everywhere_and_named_on_rank_1(
    spawned: tuple[tuple[Path, ...], list[Any]],
) -> None:
    dirs, ranks = spawned
    assert [r["loop"]["decisions"] for r in ranks] == [[True, False, True]] * 2
    for mine, theirs in zip(ranks[0]["loop"]["weights"], ranks[1]["loop"]["weights"], strict=True):
        assert torch.equal(mine, theirs)
    bundle_dir = dirs[3] / "captures" / "step-00000001"
    bundle = tg.load_bundle(bundle_dir)
    assert "forward_inputs" not in bundle.meta(0)  # rank 0's own input was finite
    assert bundle.meta(1)["forward_inputs"] == {
        "nonfinite": [{"forward": 0, "path": "args[0]", "positions": list(range(6))}],
        "in_fetched_batch": False,
    }
    r = tg.replay(bundle_dir, cases.made_in_loop_factory, repeats=1).to_dict()
    assert (r["rank"], r["reproduced"], r["verdict"]) == (1, False, "input_made_in_loop")
    assert r["advice"] == ADVICE["input_made_in_loop"] and "suspect" not in r["summary"]
    r0 = tg.replay(bundle_dir, cases.made_in_loop_factory, rank=0, repeats=1).to_dict()
    assert (r0["verdict"], r0["advice"]) == ("not_reproduced", RECEIVED_ADVICE)


@pytest.fixture(scope="module")
def origin_bundle(run_dirs: tuple[Path, Path, Path]) -> Path:
    return run_dirs[0] / "captures" / "step-00000002"


def test_a_backward_nan_from_rank_1_is_attributed_to_rank_1_and_its_sample(
    origin_bundle: Path,
) -> None:
    bundle = tg.load_bundle(origin_bundle)
    assert bundle.manifest["loss_ranks"] == [] and bundle.manifest["grad_ranks"] == [0, 1]
    r = tg.replay(origin_bundle, models.backward_factory).to_dict()
    assert (r["rank"], r["reproduced"], r["phase"], r["verdict"]) == (
        1,
        True,
        "backward",
        "numerical",
    )
    assert r["module"] == "encoder.layers.0.scale" and r["backward"]["forward_op"] == "aten.sqrt"
    assert r["culprit_samples"] == [{"micro_batch": 0, "position": 5, "index": 1021}]
    assert (r["origin_method"], r["origin_ranks"], r["received_ranks"]) == ("replay", [1], [0])
    roles = {x["rank"]: (x["role"], x["reproduced"]) for x in r["rank_replays"]}
    assert roles == {0: ("received", False), 1: ("origin", True)}
    assert "arose on rank 1" in r["summary"] and "rank 0 only received them" in r["summary"]
    assert "suspect" not in r["summary"]


def test_replaying_the_rank_that_received_it_says_so(
    origin_bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r = tg.replay(origin_bundle, models.backward_factory, rank=0, repeats=1).to_dict()
    assert (r["rank"], r["reproduced"], r["received_from"]) == (0, False, [1])
    assert r["summary"].startswith("Rank 0's own step is finite when replayed")
    assert "through the gradient all-reduce; they arose on rank 1" in r["summary"]
    assert "suspect" not in r["summary"] and r["advice"] == RECEIVED_ADVICE
    args = ["replay", str(origin_bundle), "--factory", "tg_capture_models:backward_factory"]
    assert main(args) == EXIT_FINDING
    out = capsys.readouterr().out
    assert "replay    " in out and "rank 1 of 2" in out
    assert "ranks          made on [1]; received through the all-reduce on [0]" in out
    assert "  rank 0: own replay finite" in out and "-> received" in out


def test_one_ranks_corrupted_weight_is_a_replica_mismatch(
    run_dirs: tuple[Path, Path, Path],
) -> None:
    bundle = run_dirs[1] / "captures" / "step-00000001"
    r = tg.replay(bundle, models.clean_factory, repeats=1).to_dict()
    assert (r["verdict"], r["advice"]) == ("replica_mismatch", ADVICE["replica_mismatch"])
    assert r["reproduced"] is False  # the loss fault came from outside loss_fn
    (m,) = r["replicas"]["mismatches"]
    assert (m["name"], m["disagree"], m["elements"]) == ("head.weight", [0, 1], 1)
    assert m["max_abs_diff"] == pytest.approx(1e-3, rel=1e-2)
    assert r["summary"].startswith("The replicas disagree before the step: 1 replicated")
    assert "head.weight: ranks 0 and 1 hold different values" in r["summary"]
    assert "clamp" not in r["advice"]
    assert "replicas       DIFFER: head.weight (ranks 0, 1)" in str(
        tg.replay(bundle, models.clean_factory, repeats=1)
    )
    args = ["replay", str(bundle), "--factory", "tg_capture_models:clean_factory"]
    assert main(args) == EXIT_FINDING  # a finding, though the step replays finite


def test_a_rank_that_stayed_finite_while_another_went_bad_is_no_suspect(
    run_dirs: tuple[Path, Path, Path],
) -> None:
    """Rank 1's loss is 0/0, no gradient flows through it: rank 0 received nothing."""
    bundle = run_dirs[2] / "captures" / "step-00000001"
    manifest = tg.load_bundle(bundle).manifest
    assert (manifest["loss_ranks"], manifest["grad_ranks"]) == ([1], [])
    r = tg.replay(bundle, models.loss_factory, rank=0, repeats=1).to_dict()
    assert (r["verdict"], r["bad_elsewhere"], r["received_from"]) == ("not_reproduced", [1], [])
    assert r["summary"].startswith(
        "Rank 0's step was finite when it ran and is finite when replayed"
    )
    assert "went non-finite on rank 1, not here" in r["summary"]
    assert "suspect" not in r["summary"] and "not a suspect" in r["advice"]
    default = tg.replay(bundle, models.loss_factory, repeats=1).to_dict()
    assert (default["rank"], default["verdict"], default["op"]) == (
        1,
        "batch_statistics",
        "aten.div",
    )
