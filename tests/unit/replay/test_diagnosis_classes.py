"""Issue 55's classes: a non-finite value that was already there (weights a previous update
wrote through a NaN learning rate; rows of a grown table that only a long sequence reads),
that came from outside the traced graph (class weights made before training), a deliberate
-inf that the loss reads at a forbidden target, a forward overflow the loss never reads that
the backward turns into NaN, and in-place ops described as they were called. Each case is a
guarded run built from scratch (tests/support/tg_class_cases.py), replayed from its bundle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tg_class_cases as cc
import torch
import torch.nn.functional as F

import trainguard as tg
from trainguard.capture.bundle import HISTORY, MANIFEST, write_json
from trainguard.cli import EXIT_FINDING, main
from trainguard.replay.verdicts import ADVICE, VERDICTS

pytestmark = pytest.mark.timeout(120)


def _replay(bundle: Path, factory: Any) -> dict[str, Any]:
    report = tg.replay(bundle, factory).to_dict()
    assert report["verdict"] in VERDICTS and report["advice"] == ADVICE[report["verdict"]]
    return report


def _positions(report: dict[str, Any]) -> list[tuple[int, int]]:
    return [(c["micro_batch"], c["position"]) for c in report["culprit_samples"]]


# -- class 1a: the previous update wrote them, through a NaN learning rate ---------------------


@pytest.fixture(scope="module")
def warmup_bundles(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    bundles: list[Path] = cc.group_warmup_run(tmp_path_factory.mktemp("warmup"))
    assert [b.name for b in bundles] == ["step-00000003", "step-00000004"]
    return bundles


def test_a_nan_learning_rate_the_guard_stopped_names_the_group_and_the_option(
    warmup_bundles: list[Path],
) -> None:
    bundle = warmup_bundles[0]
    assert tg.load_bundle(bundle).trigger == "hyperparameter"
    r = _replay(bundle, cc.two_group_factory)
    assert (r["verdict"], r["phase"], r["op"], r["module"]) == (
        "nonfinite_hyperparameter",
        "optimizer",
        None,
        None,
    )
    assert (r["reproduced"], r["culprit_samples"]) == (False, [])
    assert r["hyperparameters"] == [{"group": 1, "name": "lr", "value": "nan"}]
    assert r["summary"].startswith(
        "Param group 1's lr is nan at step 3 (the optimizer state in the bundle; history.json: "
        "lr nan): the optimizer step would have written non-finite values into param group 1 "
        "(2 parameters: head.weight, head.bias), and the guard stopped the step before it. "
        "The step's own forward and backward are finite (3 replays on cpu, loss "
    )
    assert "suspect" not in r["summary"]  # no transient fault, no device
    args = ["replay", str(bundle), "--factory", "tg_class_cases:two_group_factory"]
    assert main(args) == EXIT_FINDING


def test_weights_a_nan_learning_rate_wrote_name_the_step_the_group_and_the_option(
    warmup_bundles: list[Path],
) -> None:
    r = _replay(warmup_bundles[1], cc.two_group_factory)
    assert (r["verdict"], r["phase"], r["op"], r["module"]) == (
        "nonfinite_hyperparameter",
        "forward",
        None,
        "head",
    )
    assert r["culprit_samples"] == [] and r["bisected"] is False  # every sample reads them
    writer = r["weights"]["writer"]
    assert (writer["step"], writer["decision"], writer["group"], writer["exact"]) == (
        3,
        "warn",
        1,
        True,
    )
    assert writer["hyperparameters"] == [{"group": 1, "name": "lr", "value": "nan"}]
    assert (writer["moments"], writer["moment_names"]) == ("finite", ["exp_avg", "exp_avg_sq"])
    assert r["summary"].startswith(
        "A non-finite hyper-parameter wrote the weights: param group 1's lr was nan at step 3 "
        "(history.json). The update of step 3 wrote them through param group 1 (2 parameters: "
        "head.weight, head.bias), exactly the non-finite ones. Step 3's loss and gradients were "
        "finite (loss "
    )
    assert r["summary"].endswith(
        "and its update was applied by the loop (decision warn): its forward read these weights "
        "finite, and the optimizer's state of them (exp_avg, exp_avg_sq) is finite: the "
        "hyper-parameter wrote them, not a gradient."
    )
    assert "written by     the update of step 3, param group 1 (lr nan)" in str(
        tg.replay(warmup_bundles[1], cc.two_group_factory)
    )


def _without_lrs(bundle: Path, copy: Path) -> Path:
    """A copy of ``bundle`` whose history has no ``lrs`` (one written before they were)."""
    import shutil

    shutil.copytree(bundle, copy)
    records = json.loads((copy / HISTORY).read_text())
    for record in records["records"]:
        record.pop("lrs", None)
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["files"][HISTORY] = write_json(copy / HISTORY, records).to_manifest()
    (copy / MANIFEST).write_text(json.dumps(manifest))
    return copy


def test_without_every_groups_lr_the_update_and_its_group_are_still_named(
    warmup_bundles: list[Path], tmp_path: Path
) -> None:
    """An older history (group 0's lr only), and the group's lr finite again in the state:
    no hyper-parameter to blame, but the update, the group and the finite moments are."""
    r = _replay(_without_lrs(warmup_bundles[1], tmp_path / "old"), cc.two_group_factory)
    assert (r["verdict"], r["module"]) == ("nonfinite_weights", "head")
    assert r["summary"].startswith(
        "Non-finite weights before the step: head.weight, head.bias. The update of step 3 "
        "wrote them through param group 1 (2 parameters: head.weight, head.bias), exactly the "
        "non-finite ones."
    )
    assert "the update's own arithmetic made them" in r["summary"]


# -- class 1b: rows that only some samples read --------------------------------------------------


def test_rows_a_grown_table_never_initialised_name_the_rows_and_the_sample_reading_them(
    tmp_path: Path,
) -> None:
    (bundle,) = cc.grown_table_run(tmp_path, long=(5,))
    r = _replay(bundle, cc.position_factory)
    assert (r["verdict"], r["phase"], r["op"], r["module"]) == (
        "nonfinite_rows",
        "forward",
        "aten.embedding",
        "pos",
    )
    assert _positions(r) == [(0, 5)] and r["culprit_samples"][0]["index"] == 229
    weights = r["weights"]
    assert weights["rows"] == {
        "name": "pos.weight",
        "rows": list(range(8, 16)),
        "count": 8,
        "total": 16,
        "shape": [16, 8],
        "text": "rows 8..15 of pos.weight (8 of 16 rows)",
    }
    assert (weights["read_rows"], weights["readers"]) == ([8, 9, 10, 11], [5])
    assert weights["updates"]["status"] == "never"
    assert r["summary"].startswith(
        "Non-finite rows before the step: rows 8..15 of pos.weight (8 of 16 rows). "
        "aten.embedding in pos (tg_class_cases.py:"
    )
    assert (
        "read rows 8..11 of them for sample 5 only (not every sample is to blame); they were "
        "never updated: the optimizer's exp_avg and exp_avg_sq of those rows are 0 after 3 "
        "steps (no gradient ever reached them), so they have been non-finite since the table "
        "was made or loaded, not written by an update; sample 5 of the batch (dataset index "
        "229) alone makes the step non-finite." in r["summary"]
    )


def test_rows_most_samples_read_are_named_not_the_batch_as_a_whole(tmp_path: Path) -> None:
    """Issue 55's item 5: the finding names the samples; bisection blames none alone."""
    (bundle,) = cc.grown_table_run(tmp_path, long=(1, 2, 4, 5, 6))
    r = _replay(bundle, cc.position_factory)
    assert (r["verdict"], r["culprit_samples"]) == ("nonfinite_rows", [])
    assert r["weights"]["readers"] == [1, 2, 4, 5, 6] and r["named_samples"] == [1, 2, 4, 5, 6]
    assert "the batch as a whole" not in r["summary"]
    assert "for samples 1, 2, 4..6 only" in r["summary"]
    assert r["summary"].endswith(
        "the non-finite values sit in samples 1, 2, 4..6, and each sample tried makes the step "
        "non-finite on its own."
    )


def test_live_diagnose_reads_the_optimizer_given() -> None:
    model = cc.grown_position_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for batch in cc.sequences(2, -1, ()):
        cc.seq_loss(model, batch).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
    (batch,) = cc.sequences(1, 0, (3,), seed=9)
    r = tg.diagnose(model, cc.seq_loss, batch, bisect=True, optimizer=opt).to_dict()
    assert (r["verdict"], _positions(r)) == ("nonfinite_rows", [(0, 3)])
    assert r["weights"]["updates"] == {
        "status": "never",
        "state": ["exp_avg", "exp_avg_sq"],
        "steps": 2,
    }
    without = tg.diagnose(model, cc.seq_loss, batch).to_dict()
    assert without["verdict"] == "nonfinite_rows" and without["weights"]["updates"]["status"] == (
        "unknown"
    )


# -- class 2: a constant made before the step ------------------------------------------------------


def test_class_weights_made_before_training_are_named_as_the_constant_they_are(
    tmp_path: Path,
) -> None:
    (bundle,) = cc.class_weight_run(tmp_path, rare=6)
    r = _replay(bundle, cc.weighted_factory)
    assert (r["verdict"], r["phase"], r["op"], r["module"]) == (
        "nonfinite_constant",
        "loss",
        "aten.nll_loss_forward",
        "CrossEntropyLoss",
    )
    assert _positions(r) == [(0, 6)] and r["constant"] == "CrossEntropyLoss.weight"
    assert r["path"][0]["label"] == "CrossEntropyLoss.weight"
    assert r["summary"].startswith(
        "aten.nll_loss_forward in CrossEntropyLoss (a module outside the model) (tg_class_cases.py:"
    )
    assert (
        "read a non-finite constant made before the step: its argument weight, the buffer "
        "weight of CrossEntropyLoss (a module outside the model), float32 [4], holds 1 "
        "non-finite value (first: inf at [3]), made before the step, and made NaN of it; sample "
        "6 of the batch (dataset index 22) alone makes the step non-finite." in r["summary"]
    )
    assert "clamp" not in r["advice"].split(".")[0]  # not "clamp the op's inputs"


def test_a_tensor_the_loop_made_is_named_by_the_argument_it_is_passed_as() -> None:
    weights = cc.class_weights(cc.ESTIMATION_LABELS)  # kept by the loss function: a closure

    def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(batch["x"]), batch["y"], weight=weights)

    x = torch.randn(cc.BATCH, 5, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 0, 3, 1, 2, 0])
    r = tg.diagnose(cc.Classifier(), loss_fn, {"x": x, "y": y}, bisect=True).to_dict()
    assert (r["verdict"], r["phase"], r["op"], _positions(r)) == (
        "nonfinite_constant",
        "loss",
        "aten.nll_loss_forward",
        [(0, 4)],
    )
    assert r["constant"] == "argument weight of aten.nll_loss_forward"
    assert (
        "read a non-finite constant made before the step: its argument weight, the argument "
        "weight of aten.nll_loss_forward, a tensor, float32 [4], holds 1 non-finite value "
        "(first: inf at [3]), made before the step" in r["summary"]
    )


# -- class 3: a deliberate -inf read at a target the mask forbids -------------------------------


def test_the_loss_at_a_masked_target_is_the_root_not_the_mask(tmp_path: Path) -> None:
    (bundle,) = cc.schema_run(tmp_path, bad=(1, 2, 3))
    r = _replay(bundle, cc.schema_factory)
    assert (r["verdict"], r["phase"], r["op"], r["module"]) == (
        "masked_position",
        "loss",
        "aten.nll_loss_forward",
        None,
    )
    assert _positions(r) == [(1, 2)] and r["culprit_samples"][0]["index"] == 10
    read = r["masked_read"]
    assert read["position"][0] == 2 * cc.POSITIONS + 3 and read["shape"] == [40, cc.TOKENS]
    assert 0 < read["row_masked"] < read["row_size"] == cc.TOKENS  # a partly masked row
    assert r["summary"].startswith(
        "aten.nll_loss_forward in loss_fn, outside any module (tg_class_cases.py:"
    )
    assert "read a position that a mask set to -inf and turned it into inf" in r["summary"]
    assert f"it read -inf at [13, {read['position'][1]}] (the target of row 13)" in r["summary"]
    assert "written by aten.masked_fill (" in r["summary"]
    assert r["summary"].endswith(
        "the mask is deliberate, this read of it is not; sample 2 of micro-batch 1 of the batch "
        "(dataset index 10) alone makes the step non-finite."
    )


def test_a_hand_written_loss_that_gathers_the_masked_target_is_the_root() -> None:
    (batch,) = cc.schema_batches(1, (0, 2, 3))

    def hand_nll(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logp = torch.log_softmax(model(batch["x"], batch["allowed"]), -1)
        return -logp.gather(-1, batch["target"][..., None]).mean()

    r = tg.diagnose(cc.SchemaDecoder(), hand_nll, batch, bisect=True).to_dict()
    assert (r["verdict"], r["phase"], r["op"], _positions(r)) == (
        "masked_position",
        "loss",
        "aten.gather",
        [(0, 2)],
    )
    read = r["masked_read"]
    assert (read["position"][:2], read["how"]) == ([2, 3], "gathered for")
    assert "read a position that a mask set to -inf (aten.gather gave -inf" in r["summary"]


# -- class 4: an overflow the loss never reads, NaN in the backward -----------------------------


def test_a_forward_inf_the_loss_never_reads_names_the_op_the_backward_op_and_the_sample(
    tmp_path: Path,
) -> None:
    (bundle,) = cc.softmax_run(tmp_path, bad=(2, 5))
    r = _replay(bundle, cc.softmax_factory)
    assert (r["verdict"], r["phase"], r["op"], r["module"]) == (
        "numerical",
        "forward",
        "aten.exp",
        "softmax",
    )
    assert _positions(r) == [(0, 5)] and r["culprit_samples"][0]["index"] == 21
    assert r["replayed"]["nonfinite_params"] and all(
        v == v for v in r["replayed"]["losses"]
    )  # a finite loss, non-finite gradients
    assert r["gradient_op"]["grad_fn"] == "DivBackward0" and r["gradient_op"]["value"] == "nan"
    assert r["summary"].startswith("aten.exp in softmax (tg_class_cases.py:")
    assert (
        "in the forward pass, where the loss does not read it (the loss is finite); in the "
        "backward pass aten.div (DivBackward0, the gradient of aten.div in softmax) turned it "
        "into NaN gradients; sample 5 of the batch (dataset index 21) alone makes the step "
        "non-finite." in r["summary"]
    )


# -- class 5: in-place ops as they were called ------------------------------------------------


def test_an_in_place_ops_operands_are_shown_as_they_were_before_it_ran() -> None:
    x = torch.randn(cc.BATCH, 5, generator=torch.Generator().manual_seed(3))
    x[4] = 0.0
    y = torch.arange(cc.BATCH) % 3
    model = cc.InPlaceNorm()
    r = tg.diagnose(model, lambda m, b: F.cross_entropy(m(b[0]), b[1]), (x, y), bisect=True)
    assert (r.phase, r.op, r.module, r.verdict) == (
        "forward",
        "aten.div_",
        "InPlaceNorm",
        "numerical",
    )
    assert [c["position"] for c in r.culprit_samples] == [4]
    assert r.details["op_detail"].startswith("aten.div_(0.0, 0.0) = nan at [4, 0]")
    assert r.summary.startswith("aten.div_ in InPlaceNorm (tg_class_cases.py:")
    assert "turned finite inputs into NaN (aten.div_(0.0, 0.0) = nan at [4, 0]" in r.summary
