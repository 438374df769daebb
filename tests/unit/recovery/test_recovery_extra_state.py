"""``Guard(extra_state=...)``: the loop's own stateful objects (an EMA of the weights, a
counter of its own) are saved and restored with the model: in a rollback's snapshot, in a
known-good checkpoint on disk and at a resume from it."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_recovery import full_params, rollback_config, train
from torch import nn

import trainguard as tg

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: "single process"


class Counter:
    """A stateful object of the loop's own (not a module): the applied updates it saw."""

    def __init__(self) -> None:
        self.applied = 0

    def state_dict(self) -> dict[str, Any]:
        return {"applied": self.applied}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.applied = state["applied"]


def _ema(model: nn.Module) -> torch.optim.swa_utils.AveragedModel:
    fn = torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    return torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=fn)


def _run(run_dir: Path, steps: int, **options: Any) -> tuple[dict[int, torch.Tensor], Counter]:
    """The EMA's weights as each step started, and the counter at the end."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema, counter = _ema(model), Counter()
    config = tg.GuardConfig.from_options({"run_dir": run_dir, "hang_timeout": 0, **options})
    guard = tg.Guard(model, opt, extra_state={"ema": ema, "counter": counter}, config=config)
    gen = torch.Generator().manual_seed(1)
    starts: dict[int, torch.Tensor] = {}
    with guard, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x in guard.watch([torch.randn(3, 4, generator=gen) for _ in range(steps)]):
            starts[guard.global_step] = full_params(ema).clone()
            loss = model(x).pow(2).mean()
            loss.backward()
            if guard.check(loss):
                opt.step()
                ema.update_parameters(model)
                counter.applied += 1
            opt.zero_grad(set_to_none=True)
    return starts, counter


def test_a_rollback_restores_the_loops_ema_with_the_weights(tmp_path: Path) -> None:
    """Step 5's huge update reaches the EMA before the streak it causes; the rollback to
    step 4 takes it back out, to what the EMA was when step 4 last started."""
    run = train(0, "plain", tmp_path, 20, {5: 1e37}, ema=True, config=rollback_config(tmp_path))
    assert run["error"] is None and run["finite"]
    assert run["ema_rollbacks"] == [True]
    [ema] = run["ema"]
    assert torch.isfinite(ema).all()


def test_a_resume_loads_the_extra_state_of_the_checkpoint(tmp_path: Path) -> None:
    options = {"on_escalation": "rollback", "checkpoint_every": 2, "recovery.good_after": 2}
    starts, counter = _run(tmp_path, 6, **options)  # checkpoints of steps 2 and 4 good
    assert counter.applied == 6
    torch.manual_seed(5)
    model = nn.Linear(4, 2)
    fresh_ema, fresh_counter = _ema(model), Counter()
    extra = {"ema": fresh_ema, "counter": fresh_counter}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    config = tg.GuardConfig.from_options(
        {"run_dir": tmp_path, "hang_timeout": 0, "resume": True, **options}
    )
    with tg.Guard(model, opt, extra_state=extra, config=config) as resumed:
        step = resumed.global_step
    assert step == 4  # the newest good checkpoint (step 6's is not judged yet)
    assert fresh_counter.applied == 4  # the updates of steps 0..3
    # the EMA came back as it was when step 4 started (not the fresh one's, not step 5's)
    assert fresh_ema.n_averaged.item() == 4
    assert torch.equal(full_params(fresh_ema), starts[4])
    assert not torch.equal(starts[4], starts[5])


def test_a_checkpoint_without_a_name_leaves_that_object_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    options = {"on_escalation": "rollback", "checkpoint_every": 2, "recovery.good_after": 2}
    _run(tmp_path, 6, **options)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    late = Counter()
    late.applied = -1
    config = tg.GuardConfig.from_options(
        {"run_dir": tmp_path, "hang_timeout": 0, "resume": True, **options}
    )
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        tg.Guard(model, opt, extra_state={"late": late}, config=config).close()
    assert late.applied == -1
    assert "holds no 'late'" in caplog.text


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ([1, 2], "pass a dict of names"),
        ({3: Counter()}, "is not a string"),
        ({"ema": object()}, r"'ema' \(object\) has no state_dict"),
    ],
)
def test_extra_state_that_cannot_be_saved_is_refused_naming_it(
    tmp_path: Path, extra: Any, says: str
) -> None:
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(tg.ConfigError, match=says) as info:
        tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0, extra_state=extra)
    assert info.value.option == "extra_state"


def test_extra_state_without_recovery_is_said_to_be_unused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0, extra_state={"c": Counter()}).close()
    assert "extra_state (c) is saved and restored by recovery only" in caplog.text
