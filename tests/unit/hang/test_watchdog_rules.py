"""Pure rules of the watchdog: culprits, hang / peer-failure verdicts, the adaptive timeout,
heartbeat bookkeeping on local receipt times, and which exceptions are published."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import trainguard as tg
from trainguard.hang import timeout as timing
from trainguard.hang.heartbeat import Heartbeat, PeerTracker, RankView
from trainguard.hang.rules import (
    HANG,
    PEER_FAILURE,
    Verdict,
    assess,
    detection_suspended,
    effective_timeout,
    failure_verdict,
    is_comm_error,
    pick_culprits,
    should_publish,
)
from trainguard.hang.timeout import TimeoutLearner


def view(
    rank: int,
    step: int = 5,
    phase: str = "check",
    *,
    state: str = "running",
    registered: bool = True,
    user_phase: bool = False,
    timeout: float = 3.0,
    heartbeat_age: float = 0.2,
    progress_age: float = 4.0,
) -> RankView:
    return RankView(
        rank,
        registered=registered,
        state=state,
        step=step,
        phase=phase,
        user_phase=user_phase,
        timeout=timeout,
        heartbeat_age=heartbeat_age,
        progress_age=progress_age,
    )


# -- culprits ---------------------------------------------------------------------------------


def test_the_rank_fetching_data_is_behind_ranks_waiting_in_the_check() -> None:
    views = [view(0), view(1), view(2, phase="data"), view(3)]
    assert pick_culprits(views) == [2]


def test_a_lower_step_is_behind_whatever_the_phase() -> None:
    views = [view(0, step=7, phase="data"), view(1, step=6, phase="check"), view(2, step=7)]
    assert pick_culprits(views) == [1]


def test_user_code_after_the_check_is_behind_the_next_check() -> None:
    views = [view(0, step=6, phase="step"), view(1, step=6, phase="check")]
    assert pick_culprits(views) == [0]


def test_a_rank_without_a_guard_yet_is_behind_everyone() -> None:
    absent = view(1, step=-1, phase="absent", registered=False)
    assert pick_culprits([view(0, step=0, phase="data"), absent]) == [1]


def test_a_rank_still_between_two_loops_is_behind_the_next_loop() -> None:
    assert pick_culprits([view(0, phase="done"), view(1, phase="data")]) == [0]


def test_everyone_at_the_same_place_blames_the_ranks_that_left() -> None:
    views = [view(0), view(1, state="closed"), view(2)]
    assert pick_culprits(views) == [1]


def test_everyone_at_the_same_place_and_nobody_left_blames_everyone() -> None:
    assert pick_culprits([view(0), view(1), view(2)]) == [0, 1, 2]


# -- verdicts ---------------------------------------------------------------------------------


def test_no_progress_anywhere_for_the_timeout_is_a_hang() -> None:
    verdict = assess([view(0), view(1, phase="data")], me=0, timeout=3.0, dead_after=3.0)
    assert verdict is not None
    assert verdict.kind == HANG
    assert verdict.culprits == [1]
    assert "rank 1 at step 5 in 'data'" in verdict.reason
    assert verdict.by == verdict.reporter == 0


def test_a_hang_waits_for_no_dump_from_a_rank_that_closed() -> None:
    """A rank whose guard closed (out of data) runs no watchdog: it will not dump its stacks,
    so the live ranks must not wait for it (they waited the full 5 s)."""
    views = [view(0, phase="check"), view(1, state="closed", phase="closed")]
    verdict = assess(views, me=0, timeout=3.0, dead_after=3.0)
    assert verdict is not None and verdict.kind == HANG
    assert verdict.silent == [1]


def test_one_rank_still_progressing_is_no_hang() -> None:
    views = [view(0, progress_age=0.5), view(1, phase="data")]
    assert assess(views, me=0, timeout=3.0, dead_after=3.0) is None


def test_the_most_patient_rank_sets_the_timeout() -> None:
    views = [view(0, timeout=3.0), view(1, timeout=30.0, phase="data")]
    assert effective_timeout(views, 3.0) == 30.0
    assert assess(views, me=0, timeout=3.0, dead_after=3.0) is None


def test_a_user_phase_anywhere_suspends_hang_detection() -> None:
    views = [view(0, phase="eval", user_phase=True, progress_age=100.0), view(1, phase="step")]
    assert detection_suspended(views)
    assert assess(views, me=1, timeout=3.0, dead_after=3.0) is None


def test_every_rank_done_suspends_hang_detection_but_one_done_does_not() -> None:
    assert assess([view(0, phase="done"), view(1, phase="done")], 0, 3.0, 3.0) is None
    verdict = assess([view(0, phase="done"), view(1, phase="data")], 1, 3.0, 3.0)
    assert verdict is not None and verdict.culprits == [0]


def test_stopped_heartbeats_are_a_peer_failure_even_during_a_user_phase() -> None:
    views = [view(0, user_phase=True, phase="eval"), view(1, heartbeat_age=3.5)]
    verdict = assess(views, me=0, timeout=3.0, dead_after=3.0)
    assert verdict is not None
    assert verdict.kind == PEER_FAILURE
    assert verdict.culprits == [1] and verdict.silent == [1]
    assert "heartbeats stopped" in verdict.reason


def test_closed_ranks_and_ranks_without_a_guard_are_not_dead() -> None:
    views = [
        view(0, progress_age=0.0),
        view(1, state="closed", heartbeat_age=100.0),
        view(2, registered=False, step=-1, phase="absent", heartbeat_age=100.0, progress_age=0),
    ]
    assert assess(views, me=0, timeout=3.0, dead_after=3.0) is None


def test_a_rank_never_judges_itself_dead() -> None:
    assert assess([view(0, heartbeat_age=9.0, progress_age=0.0)], 0, 3.0, 3.0) is None


def test_a_failing_rank_names_itself_and_the_lowest_other_rank_reports() -> None:
    verdict = failure_verdict(0, [0, 1, 2], ValueError("bad batch"))
    assert verdict.kind == PEER_FAILURE
    assert verdict.culprits == [0] and verdict.silent == [0]
    assert verdict.reason == "rank 0 failed: ValueError: bad batch"
    assert verdict.reporter == 1
    assert Verdict.decode(verdict.encode()) == verdict
    assert Verdict.decode(b"") is None
    assert Verdict.decode(b"{not json") is None


@pytest.mark.parametrize(
    ("exc", "published"),
    [
        (ValueError("x"), True),
        (RuntimeError("CUDA out of memory"), True),
        (tg.NonFiniteError("nan", step=3, ranks=[0]), False),
        (tg.LossScaleCollapseError("scale", step=3, ranks=[0]), False),
        (tg.SpikeError("spike", step=3, ranks=[]), False),
        (tg.ReplicaDivergenceError("differ", step=3, ranks=[1], params=["w"]), False),
        (tg.PeerFailureError("peer"), False),
        (KeyboardInterrupt(), False),
        (SystemExit(1), False),
    ],
)
def test_which_exceptions_are_published(exc: BaseException, published: bool) -> None:
    assert should_publish(exc) is published


def test_collective_errors_are_symptoms() -> None:
    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    )
    assert is_comm_error(gloo)
    assert is_comm_error(dist.DistBackendError("NCCL error"))
    assert not is_comm_error(RuntimeError("shape mismatch"))
    assert not is_comm_error(ValueError("gloo"))


# -- heartbeats on local receipt times --------------------------------------------------------


def beat(seq: int, beats: int, step: int = 1, state: str = "running") -> Heartbeat:
    return Heartbeat(seq, step, "step", beats, False, 3.0, state)


def test_ages_count_from_the_local_receipt_of_a_changed_counter() -> None:
    tracker = PeerTracker([0, 1], now=100.0)
    tracker.update(1, beat(seq=1, beats=10), now=101.0)
    tracker.update(1, beat(seq=2, beats=10), now=102.0)  # alive, no progress
    tracker.update(1, beat(seq=2, beats=10), now=104.0)  # the same heartbeat again
    views = {v.rank: v for v in tracker.views(now=105.0)}
    assert views[1].registered
    assert views[1].heartbeat_age == pytest.approx(3.0)
    assert views[1].progress_age == pytest.approx(4.0)
    assert not views[0].registered
    assert views[0].progress_age == pytest.approx(5.0)


def test_heartbeats_survive_the_store_and_garbage_does_not() -> None:
    original = beat(seq=3, beats=7, step=2, state="closed")
    assert Heartbeat.decode(original.encode().encode()) == original
    assert Heartbeat.decode(b"") is None
    assert Heartbeat.decode(b'{"seq": 1}') is None


# -- the timeout ------------------------------------------------------------------------------


def test_a_fixed_timeout_is_used_as_given() -> None:
    learner = TimeoutLearner(fixed=3.0)
    learner.observe(100.0, steps_done=10)
    assert learner.value(0) == learner.value(50) == 3.0
    assert learner.rule(50) == "fixed"


def test_the_adaptive_timeout_grants_a_grace_then_learns_with_a_floor() -> None:
    learner = TimeoutLearner()
    learner.observe(400.0, steps_done=1)  # compilation of the first steps: not learned
    assert learner.rule(1) == "grace" and learner.value(1) == timing.GRACE_S
    assert learner.rule(2) == "learned" and learner.value(2) == timing.FLOOR_S
    learner.observe(1.0, steps_done=5)
    assert learner.value(5) == timing.FLOOR_S
    learner.observe(7.0, steps_done=6)
    assert learner.value(6) == pytest.approx(70.0)
    learner.observe(2.0, steps_done=7)  # it never shrinks
    assert learner.value(7) == pytest.approx(70.0)


def test_derived_intervals() -> None:
    assert timing.dead_after(3.0) == 3.0
    assert timing.dead_after(0.5) == timing.DEAD_AFTER_MIN_S
    assert timing.dead_after(600.0) == timing.DEAD_AFTER_MAX_S
    assert timing.tick_interval(3.0) == pytest.approx(0.3)
    assert timing.tick_interval(600.0) == 1.0
    assert timing.tick_interval(0.5) == pytest.approx(0.2)
    assert timing.frozen_after(3.0) > timing.dead_after(3.0)


def test_exit_codes_are_distinct_and_uncommon() -> None:
    codes = {tg.EXIT_HANG, tg.EXIT_PEER_FAILURE}
    assert len(codes) == 2
    assert not codes & {0, 1, 2, 126, 127, 130, 137, 139, 143}
    assert all(c < 128 and not 64 <= c <= 78 for c in codes)


def test_a_new_pass_fetching_its_first_batches_gets_the_grace_and_teaches_nothing() -> None:
    """Epoch 2's DataLoader starts its workers (36 s) after fast steps taught a 30 s
    timeout: while a ``watch()`` pass fetches its first batches the learned timeout is the
    grace, and that stretch is not learned; a fixed timeout stays as given."""
    from trainguard.hang.progress import Progress
    from trainguard.hang.timeout import StallMeter

    learner = TimeoutLearner()
    assert learner.value(10) == timing.FLOOR_S
    assert learner.value(10, pass_start=True) == timing.GRACE_S
    assert TimeoutLearner(fixed=3.0).value(10, pass_start=True) == 3.0
    progress = Progress()
    meter = StallMeter(learner, now=0.0)
    progress.enter("data")
    meter.observe(progress, steps_done=10, now=0.0)
    progress.pass_start = True
    meter.observe(progress, steps_done=10, now=36.0)  # the workers start
    progress.pass_start = False
    progress.enter("step")
    meter.observe(progress, steps_done=10, now=36.0)
    assert learner.longest_stall == 0.0
    progress.enter("check")
    meter.observe(progress, steps_done=10, now=36.5)  # a usual half-second stretch
    assert learner.longest_stall == pytest.approx(0.5)


def test_watch_marks_the_fetch_of_a_pass_s_first_batches(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    guard = tg.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.1), run_dir=tmp_path, hang_timeout=0
    )
    seen: list[bool] = []

    def batches() -> Iterator[torch.Tensor]:
        for _ in range(4):
            seen.append(guard.progress.pass_start)
            yield torch.ones(3, 2)

    with guard:
        for _ in range(2):  # two passes
            for x in guard.watch(batches()):
                model(x).sum().backward()
                guard.check(model(x).sum())
            assert not guard.progress.pass_start
    # the first fill takes 2 batches (one ahead), the rest come one a step
    assert seen == [True, True, False, False] * 2
