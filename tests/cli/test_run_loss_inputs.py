"""``trainguard run`` keeps the targets of ``loss = criterion(model(x), y)`` and of
``F.cross_entropy(model(x), y)`` (issue 53, item 5): the captured micro-batch is ``(x, y)``,
so the replay runs the script's own loss on the script's own targets, not on made-up ones;
and following the output to the loss changes nothing the script computes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode

import trainguard as tg
from trainguard.attach.loss_inputs import GIVE_UP, LossInputs
from trainguard.cli import EXIT_FINDING, main
from trainguard.step.recorded_batches import RecordedBatches

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "run_scripts" / "criterion_loop.py"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loss", ["module", "functional"])
def test_the_targets_are_in_the_bundle_and_the_replay_uses_them(tmp_path: Path, loss: str) -> None:
    run_dir, saved = tmp_path / "run", tmp_path / "y.pt"
    command = [sys.executable, str(SCRIPT), "--out", str(saved)]
    command += ["--functional"] if loss == "functional" else []
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
    loss_inputs.arm(out, recorded, 0, model)
    y = torch.tensor([0, 2])
    nn.ReLU()(y.float())  # a module applied to the targets first: not the loss
    nn.CrossEntropyLoss()(out.view(2, 3), y)  # a view of the output
    assert recorded.current[0][0] is x and recorded.current[0][1] is y
    assert not module_hooks._global_forward_pre_hooks  # disarmed at the loss call


@pytest.mark.timeout(120)
def test_a_functional_loss_followed_changes_no_weight(tmp_path: Path) -> None:
    """The same script, bare and under ``trainguard run``: bit-identical final weights (the
    script itself fails if a torch function mode is left after an optimizer step)."""
    bare, guarded = tmp_path / "bare.pt", tmp_path / "guarded.pt"
    command = [sys.executable, str(SCRIPT), "--functional", "--clean", "--weights"]
    subprocess.run([*command, str(bare)], check=True, timeout=60)
    assert main(["run", "--run-dir", str(tmp_path / "run"), "--", *command, str(guarded)]) == 0
    want, got = torch.load(bare), torch.load(guarded)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def _followed(loss_of: Callable[[Tensor, Tensor], Tensor]) -> tuple[Tensor, list[Tensor]]:
    """Arms after a model call, runs ``loss_of(out, y)`` and its backward, then the optimizer
    step's ``disarm``: the micro-batch's input and what was added beside it."""
    recorded = RecordedBatches()
    model, loss_inputs = _armed(recorded)
    x = recorded.current[0]
    out = model(x)
    loss_inputs.arm(out, recorded, 0, model)
    loss_of(out, torch.tensor([0, 2])).backward()
    loss_inputs.disarm()
    assert torch._C._len_torch_function_stack() == 0 and not module_hooks._global_forward_pre_hooks
    micro = recorded.current[0]
    return (micro[0], list(micro[1:])) if isinstance(micro, tuple) else (micro, [])


def test_a_functional_loss_adds_its_targets_through_views_and_steps() -> None:
    y_of: dict[str, Tensor] = {}

    def views(out: Tensor, y: Tensor) -> Tensor:
        y_of["views"] = y.view(-1)
        return F.cross_entropy(out.view(-1, 3), y_of["views"])

    def steps(out: Tensor, y: Tensor) -> Tensor:  # log-softmax, then NLL with a mask weight
        y_of["steps"] = y
        per_sample = F.nll_loss(F.log_softmax(out, dim=1), y, reduction="none")
        y_of["mask"] = torch.tensor([1.0, 0.0])
        return (per_sample * y_of["mask"]).mean()

    def metric_first(out: Tensor, y: Tensor) -> Tensor:  # an accuracy first: not the loss
        y_of["metric"] = y
        (out.argmax(1) == y).float().mean()
        return F.cross_entropy(out, y)

    _, extra = _followed(views)
    assert len(extra) == 1 and extra[0] is y_of["views"]
    _, extra = _followed(steps)
    assert len(extra) == 2 and extra[0] is y_of["steps"] and extra[1] is y_of["mask"]
    _, extra = _followed(metric_first)
    assert len(extra) == 1 and extra[0] is y_of["metric"]


def test_a_loss_of_the_output_alone_adds_nothing_and_parameters_are_not_targets() -> None:
    scale = nn.Parameter(torch.ones(3))
    assert _followed(lambda out, y: out.sum())[1] == []
    assert _followed(lambda out, y: (out * scale).pow(2).mean())[1] == []


def test_a_mode_the_script_pushed_on_top_stays_on_top() -> None:
    """The follower leaves the torch function stack only where it is on top: a script's own
    mode entered after the model's call is never popped by the guard."""

    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    recorded = RecordedBatches()
    model, loss_inputs = _armed(recorded)
    out = model(recorded.current[0])
    loss_inputs.arm(out, recorded, 0, model)
    with Counting() as mode:
        loss = F.cross_entropy(out, torch.tensor([0, 2]))
        loss_inputs.disarm()  # the optimizer step inside the script's mode
        assert torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1) is mode
    assert Counting.calls >= 1 and isinstance(recorded.current[0], tuple)
    loss.backward()
    loss_inputs.disarm()  # the next model call: on top now, it leaves
    assert torch._C._len_torch_function_stack() == 0


def test_a_model_that_returns_its_own_loss_arms_nothing() -> None:
    """nanoGPT's ``logits, loss = model(X, Y)``: the targets are the model's inputs already,
    and no hook is left for the backward's module calls (activation checkpointing)."""
    recorded = RecordedBatches()
    model, loss_inputs = _armed(recorded)
    x = recorded.current[0]
    logits = model(x)
    loss_inputs.arm((logits, logits.pow(2).mean()), recorded, 0, model)
    assert not module_hooks._global_forward_pre_hooks
    nn.CrossEntropyLoss()(logits, torch.tensor([0, 2]))
    assert recorded.current == [x]


def test_the_follower_that_found_the_loss_is_the_only_one_armed_next() -> None:
    """A loop computes its loss the same way every step: the other follower (a global module
    hook, or a torch function mode on every call) is not armed again; a miss arms both."""
    recorded = RecordedBatches()
    model, loss_inputs = _armed(recorded)
    y = torch.tensor([0, 2])

    def arm() -> Tensor:
        recorded.record(torch.randn(2, 4), 0)
        out = model(recorded.current[-1])
        loss_inputs.arm(out, recorded, 0, model)
        return out

    F.cross_entropy(arm(), y)
    loss_inputs.disarm()
    assert loss_inputs.follow == {"function"}
    out = arm()
    assert not module_hooks._global_forward_pre_hooks  # no module hook: functions only
    assert torch._C._len_torch_function_stack() == 1
    nn.CrossEntropyLoss()(out, y)  # a module's loss calls a function: seen too
    loss_inputs.disarm()
    assert loss_inputs.follow == {"function"} and recorded.current[-1][1] is y
    arm()  # a step whose output no loss took (nothing to see)
    loss_inputs.disarm()
    assert loss_inputs.follow == {"function", "module"}  # both again after the miss
    nn.CrossEntropyLoss()(arm(), y)
    loss_inputs.disarm()
    assert loss_inputs.follow == {"module"} and torch._C._len_torch_function_stack() == 0
    assert isinstance(recorded.current[-1], tuple) and recorded.current[-1][1] is y


def test_a_child_forked_while_the_mode_waits_for_the_step_does_not_keep_it() -> None:
    """A DataLoader's workers forked between the loss and the optimizer step (an epoch's
    first batch fetched then) would pass every torch call of their collation through it."""
    recorded = RecordedBatches()
    model, loss_inputs = _armed(recorded)
    loss_inputs.arm(model(recorded.current[0]), recorded, 0, model)
    assert torch._C._len_torch_function_stack() == 1
    pid = os.fork()
    if pid == 0:  # the child: nothing of ours on its stack
        os._exit(10 + torch._C._len_torch_function_stack())
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 10
    assert torch._C._len_torch_function_stack() == 1  # the parent's is as it was
    loss_inputs.disarm()
    assert torch._C._len_torch_function_stack() == 0


@pytest.mark.parametrize("loss_seen", [True, False])
def test_the_follower_keeps_no_tensor_past_the_step(loss_seen: bool) -> None:
    """The function follower is one object for the run; the model's output it followed (a
    transformer's logits can be gigabytes) is not kept once the step is over."""
    import gc
    import weakref

    recorded = RecordedBatches()
    model, loss_inputs = _armed(recorded)
    out = model(recorded.current[0])
    followed = weakref.ref(out)
    loss_inputs.arm(out, recorded, 0, model)
    if loss_seen:
        F.cross_entropy(out, torch.tensor([0, 2]))
    loss_inputs.disarm()
    del out
    gc.collect()
    assert followed() is None


def _step_losses(loss_of: Callable[[Tensor, Tensor], Tensor], calls: int = 1) -> list[Tensor]:
    """``calls`` micro-batches of a step, each: a model call, ``loss_of(out, y)``, backward;
    then the check's ``take_losses``. Returns the losses computed and asserts they are the
    ones taken (the same values, detached)."""
    recorded = RecordedBatches()
    model, loss_inputs = _armed(recorded)
    made = []
    for _ in range(calls):
        recorded.record(torch.randn(2, 4), 0)
        out = model(recorded.current[-1])
        loss_inputs.arm(out, recorded, 3, model)
        made.append(loss_of(out, torch.tensor([0, 2])))
        made[-1].backward()
    taken = loss_inputs.take_losses(3, model)
    assert taken is not None and len(taken) == calls
    for loss, seen in zip(made, taken, strict=True):
        assert not seen.requires_grad and torch.equal(seen, loss.detach())
    assert loss_inputs.take_losses(3, model) is None  # taken once
    return taken


def test_the_loss_of_each_micro_batch_is_taken_at_the_check() -> None:
    """The loss module's result (read where its call ends), the first scalar a loss function
    computes from the output (a view of it too), and each micro-batch's under accumulation."""
    _step_losses(lambda out, y: nn.CrossEntropyLoss()(out.view(2, 3), y))
    _step_losses(lambda out, y: F.cross_entropy(out, y))
    _step_losses(lambda out, y: F.cross_entropy(out, y), calls=3)
    _step_losses(lambda out, y: nn.CrossEntropyLoss()(out, y), calls=2)


def test_a_models_own_loss_is_its_steps_loss() -> None:
    recorded = RecordedBatches()
    model, loss_inputs = _armed(recorded)
    logits = model(recorded.current[0])
    own = logits.pow(2).mean()
    loss_inputs.arm((logits, own), recorded, 0, model)
    (taken,) = loss_inputs.take_losses(0, model) or []
    assert torch.equal(taken, own.detach()) and not taken.requires_grad


def test_a_step_with_a_call_whose_loss_was_not_seen_has_no_loss() -> None:
    """Unknown, not partly known: one micro-batch's loss not found makes the step's None;
    calls of another step (one the loop left out) or another module are not this step's."""
    recorded = RecordedBatches()
    model, loss_inputs = _armed(recorded)
    y = torch.tensor([0, 2])
    F.cross_entropy(_called(model, loss_inputs, recorded, 1), y)
    _called(model, loss_inputs, recorded, 1)  # its output went to no loss
    assert loss_inputs.take_losses(1, model) is None
    F.cross_entropy(_called(model, loss_inputs, recorded, 1), y)  # a step left out
    other = nn.Linear(4, 3)
    F.cross_entropy(_called(other, loss_inputs, recorded, 2), y)  # another module's call
    loss = F.cross_entropy(_called(model, loss_inputs, recorded, 2), y)
    (taken,) = loss_inputs.take_losses(2, model) or []
    assert torch.equal(taken, loss.detach())


def _called(
    model: nn.Module, loss_inputs: LossInputs, recorded: RecordedBatches, step: int
) -> Tensor:
    recorded.record(torch.randn(2, 4), 0)
    out = model(recorded.current[-1])
    loss_inputs.arm(out, recorded, step, model)
    return out


def test_calls_whose_output_needs_no_gradient_neither_miss_nor_disarm() -> None:
    """Before the guard knows its model, every top-level training call arms the followers:
    PyTorch's MNIST example calls torchvision's ``Normalize`` (a module) per sample in its
    loader, 64 calls a batch before the model's first. Those outputs need no gradient, so no
    loss can come of them: they are not misses (the followers gave up after ``GIVE_UP``), and
    one between the model's call and its loss (a loop fetching ahead) does not disarm."""
    recorded = RecordedBatches()
    model, loss_inputs = _armed(recorded)
    transform, y = nn.LayerNorm(4, elementwise_affine=False), torch.tensor([0, 2])
    for _ in range(3 * GIVE_UP):
        loss_inputs.arm(transform(torch.randn(2, 4)), recorded, 0, transform)
    out = model(recorded.current[0])
    loss_inputs.arm(out, recorded, 0, model)
    loss_inputs.arm(transform(torch.randn(2, 4)), recorded, 0, transform)  # the next batch
    loss = F.nll_loss(F.log_softmax(out, dim=1), y)
    (taken,) = loss_inputs.take_losses(0, model) or []
    assert torch.equal(taken, loss.detach()) and recorded.current[0][1] is y
    loss_inputs.disarm()


def test_a_loss_modules_end_seen_first_by_another_hook_still_gives_the_loss() -> None:
    """Before the guard attaches, ``PreStart``'s own process-wide hook sees every top-level
    call end, the loss module's too, before the follower's: it hands that end over."""
    recorded = RecordedBatches()
    model, loss_inputs = _armed(recorded)

    def first(module: nn.Module, args: tuple[object, ...], output: object) -> None:
        if module is not model:
            loss_inputs.arm(output, recorded, 0, module)  # what PreStart._post does

    handle = module_hooks.register_module_forward_hook(first)
    try:
        out = model(recorded.current[0])
        loss_inputs.arm(out, recorded, 0, model)
        loss = nn.CrossEntropyLoss()(out, torch.tensor([0, 2]))
    finally:
        handle.remove()
    loss_inputs.disarm()
    (taken,) = loss_inputs.take_losses(0, model) or []
    assert torch.equal(taken, loss.detach())
    assert not module_hooks._global_forward_hooks  # the follower's hook is gone


SPIKE_SCRIPT = SCRIPT.parent / "spike_loop.py"


@pytest.mark.timeout(120)
def test_the_scripts_loss_is_checked_recorded_and_judged(tmp_path: Path) -> None:
    """Under ``trainguard run`` the loss the script computes from the model's output is the
    step's loss: each micro-batch's recorded, their mean in every metrics line, a loss
    spike judged at its step; and the weights bit-identical to the bare run's."""
    command = [sys.executable, str(SPIKE_SCRIPT), "--accum", "2", "--steps", "150"]
    bare, guarded = tmp_path / "bare.pt", tmp_path / "guarded.pt"
    subprocess.run([*command, "--out", str(tmp_path / "bare.json"), "--weights", str(bare)],
                   check=True, timeout=60)  # fmt: skip
    run_dir, out = tmp_path / "run", tmp_path / "losses.json"
    assert main(["run", "--run-dir", str(run_dir), "--", *command, "--out", str(out),
                 "--weights", str(guarded)]) == 0  # fmt: skip
    want, got = torch.load(bare), torch.load(guarded)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    losses = json.loads(out.read_text())
    lines = [json.loads(line) for line in (run_dir / "metrics" / "rank-0.jsonl").open()]
    assert [line["step"] for line in lines] == list(range(150))
    for line in lines:
        (mean,) = line["losses"]
        assert mean == pytest.approx(sum(losses[line["step"]]) / 2, rel=1e-12, abs=0)
    events = [json.loads(e) for e in (run_dir / "events" / "rank-0.jsonl").open()]
    spikes = [(e["step"], e["metric"]) for e in events if e["kind"] == "spike"]
    assert (140, "loss") in spikes and {step for step, _ in spikes} == {140}


TWO_CALLS = """
import torch
from torch import nn
import torch.nn.functional as F

torch.manual_seed(0)
model = nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(6):
    a, b = model(torch.randn(8, 4)), model(torch.randn(8, 4))  # two calls, one loss
    F.mse_loss(a, b).backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.timeout(120)
def test_a_step_whose_loss_takes_two_calls_is_checked_on_its_gradients(tmp_path: Path) -> None:
    """Unknown, not partly known: the first call's output was followed to no loss before the
    second call, so no step has its loss; the start line says it cannot see the loss and the
    metrics log holds none."""
    script = tmp_path / "two_calls.py"
    script.write_text(TWO_CALLS, encoding="utf-8")
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "run", "--run-dir", str(run_dir), "--",
         sys.executable, str(script)],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "it cannot see the loss value" in done.stderr
    lines = [json.loads(line) for line in (run_dir / "metrics" / "rank-0.jsonl").open()]
    assert [line["losses"] for line in lines] == [[]] * 6
