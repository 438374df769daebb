"""Work between steps on another module is progress (``hang/busy.py``): the one-shot probe,
and the stall meter's exclusion of its stretches (the watchdog arming it:
test_watchdog_protocol.py). The 2-rank checks (an EMA evaluated on rank 0 while rank 1
waits) are in tests/distributed/test_rank_works_alone.py and, under ``trainguard run``,
test_run_attach.py."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from trainguard.hang import timeout as timing
from trainguard.hang.busy import BusyProbe
from trainguard.hang.progress import Progress
from trainguard.hang.timeout import StallMeter, TimeoutLearner


def _global_hooks() -> int:
    return len(module_hooks._global_forward_pre_hooks)


@pytest.fixture
def model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))


def test_nothing_is_installed_until_armed(model: nn.Module) -> None:
    progress = Progress()
    probe = BusyProbe(progress, model)
    copy.deepcopy(model)(torch.ones(1, 2))
    assert (progress.beats, probe.armed, _global_hooks()) == (0, False, 0)


def test_another_modules_forward_is_one_busy_beat_and_disarms(model: nn.Module) -> None:
    progress = Progress()
    probe = BusyProbe(progress, model)
    ema = copy.deepcopy(model)  # made before, as EMAs are: no hook of the guard's on it
    probe.arm()
    probe.arm()  # once
    assert probe.armed and _global_hooks() == 1
    with torch.no_grad():
        ema(torch.ones(1, 2))  # the Sequential's call fires it; its children run unhooked
        ema(torch.ones(1, 2))
    assert (progress.beats, progress.busy_beats) == (1, 1)
    assert not probe.armed and _global_hooks() == 0


def test_the_guarded_models_own_forward_disarms_without_a_beat(model: nn.Module) -> None:
    progress = Progress()
    probe = BusyProbe(progress, model)
    for module in (model, model[0]):  # the model, or a child the loop calls
        probe.arm()
        module(torch.ones(1, 2))
        assert not probe.armed and progress.beats == 0


def test_a_forward_on_another_thread_is_not_the_loops(model: nn.Module) -> None:
    progress = Progress()
    probe = BusyProbe(progress, model)
    probe.arm()
    thread = threading.Thread(target=nn.Linear(2, 1), args=(torch.ones(1, 2),))
    thread.start()
    thread.join()
    assert probe.armed and progress.beats == 0
    probe.close()
    probe.arm()  # closed: never again
    assert not probe.armed and _global_hooks() == 0


def test_stretches_ended_or_begun_by_a_busy_beat_teach_the_learner_nothing() -> None:
    learner = TimeoutLearner()
    meter = StallMeter(learner, now=0.0)
    progress = Progress()
    progress.enter("step", 10)
    meter.observe(progress, steps_done=10, now=0.0)
    progress.busy()  # rank 0 evaluates an EMA: 8 s without the loop's progress
    meter.observe(progress, steps_done=10, now=8.0)
    progress.enter("data")  # the loop is back 7 s later
    meter.observe(progress, steps_done=10, now=15.0)
    assert learner.longest_stall == 0.0 and learner.value(10) == timing.FLOOR_S
    progress.enter("step")
    meter.observe(progress, steps_done=10, now=15.5)  # a usual stretch is learned again
    assert learner.longest_stall == pytest.approx(0.5)


def test_a_busy_beat_beside_the_loops_own_progress_changes_nothing() -> None:
    """A healthy 20 s stall (a slow collective) that ends with the loop's progress and a
    module called on the next batch (an augmentation) in the same look is learned."""
    learner = TimeoutLearner()
    meter = StallMeter(learner, now=0.0)
    progress = Progress()
    progress.enter("check", 10)
    meter.observe(progress, steps_done=10, now=0.0)
    progress.enter("data", 11)
    progress.busy()
    meter.observe(progress, steps_done=11, now=20.0)
    assert learner.longest_stall == pytest.approx(20.0)
