"""``trainguard run`` keeps the targets of ``loss = criterion(model(x), y)`` (issue 53, item
5): the captured micro-batch is ``(x, y)``, so the replay runs the script's own loss on the
script's own targets, not on made-up ones."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_hooks

import trainguard as tg
from trainguard.attach.loss_inputs import LossInputs
from trainguard.cli import EXIT_FINDING, main
from trainguard.step.recorded_batches import RecordedBatches

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "run_scripts" / "criterion_loop.py"


@pytest.mark.timeout(120)
def test_the_targets_are_in_the_bundle_and_the_replay_uses_them(tmp_path: Path) -> None:
    run_dir, saved = tmp_path / "run", tmp_path / "y.pt"
    command = [sys.executable, str(SCRIPT), "--out", str(saved)]
    assert main(["run", "--run-dir", str(run_dir), "--", *command]) == 0
    bundle = run_dir / "captures" / "step-00000003"
    (micro,) = tg.load_bundle(bundle).batches(0)
    x, y = micro
    assert x.shape == (8, 6) and torch.equal(y, torch.load(saved))  # the script's own targets
    report = tg.replay(bundle, f"{SCRIPT}:make_replay").to_dict()
    assert (report["verdict"], report["reproduced"]) == ("bad_input", True)
    assert [c["position"] for c in report["culprit_samples"]] == [3]
    factory = f"{SCRIPT}:make_replay"
    assert main(["replay", str(bundle), "--factory", factory]) == EXIT_FINDING


def _armed(recorded: RecordedBatches) -> tuple[nn.Module, LossInputs]:
    model = nn.Linear(4, 3)
    recorded.record(torch.randn(2, 4), 0)
    loss_inputs = LossInputs()
    return model, loss_inputs


def test_a_loss_module_given_the_output_or_a_view_of_it_adds_its_targets() -> None:
    recorded = RecordedBatches()
    model, loss_inputs = _armed(recorded)
    x = recorded.current[0]
    out = model(x)
    loss_inputs.arm(out, recorded)
    y = torch.tensor([0, 2])
    nn.ReLU()(y.float())  # a module applied to the targets first: not the loss
    nn.CrossEntropyLoss()(out.view(2, 3), y)  # a view of the output
    assert recorded.current[0][0] is x and recorded.current[0][1] is y
    assert not module_hooks._global_forward_pre_hooks  # disarmed at the loss call


def test_a_functional_loss_leaves_the_micro_batch_as_it_was() -> None:
    recorded = RecordedBatches()
    model, loss_inputs = _armed(recorded)
    x = recorded.current[0]
    out = model(x)
    loss_inputs.arm(out, recorded)
    nn.functional.cross_entropy(out, torch.tensor([0, 2]))  # no module call
    loss_inputs.disarm()  # the model's next call does this
    assert recorded.current == [x] and not module_hooks._global_forward_pre_hooks


def test_a_model_that_returns_its_own_loss_arms_nothing() -> None:
    """nanoGPT's ``logits, loss = model(X, Y)``: the targets are the model's inputs already,
    and no hook is left for the backward's module calls (activation checkpointing)."""
    recorded = RecordedBatches()
    model, loss_inputs = _armed(recorded)
    x = recorded.current[0]
    logits = model(x)
    loss_inputs.arm((logits, logits.pow(2).mean()), recorded)
    assert not module_hooks._global_forward_pre_hooks
    nn.CrossEntropyLoss()(logits, torch.tensor([0, 2]))
    assert recorded.current == [x]
