"""The comparison of the ranks' collectives at a hang (``trainguard.hang.mismatch``): the
minority op, a rank behind in collective count, a rank that never entered, equal records,
from the flight recorder's windows and from stacks alone; and how it decides a hang."""

from __future__ import annotations

from trainguard.hang.collective_record import (
    FLIGHT_RECORDER,
    STACK,
    Call,
    CollectiveRecord,
)
from trainguard.hang.heartbeat import Heartbeat, RankView
from trainguard.hang.mismatch import BEHIND, OP, find_mismatch, rank_list
from trainguard.hang.rules import HANG, assess

DDP = "DDP's gradient all_reduce"
GUARD = "trainguard's check all_reduce"


def done(seq: int, op: str = "all_reduce", sizes: list[list[int]] | None = None) -> Call:
    return Call(seq, op, sizes if sizes is not None else [[36]], True)


def recorded(
    pending: Call | None, label: str = "", line: int = 22, history: int = 3, top: int = 11
) -> CollectiveRecord:
    """A flight-recorder record: ``history`` completed calls up to ``top``, then ``pending``."""
    last = [done(seq) for seq in range(top - history + 1, top + 1)]
    if pending is not None:
        last.append(pending)
    return CollectiveRecord(
        FLIGHT_RECORDER,
        pending.op if pending else None,
        label or (pending.op if pending else ""),
        seq=pending.seq if pending else None,
        sizes=pending.sizes if pending else None,
        file="/job/train.py",
        line=line,
        function="main",
        last=last,
    )


def stacked(op: str | None, label: str = "", line: int = 22) -> CollectiveRecord:
    return CollectiveRecord(STACK, op, label or (op or ""), file="/job/train.py", line=line)


def barrier(seq: int = 12) -> Call:
    return Call(seq, "barrier", [], False)


def bucket(seq: int = 12, size: int = 212) -> Call:
    return Call(seq, "all_reduce", [[size]], False)


# -- flight recorder ----------------------------------------------------------------------------


def test_the_minority_op_is_the_culprit_with_both_call_sites() -> None:
    records = {0: recorded(barrier(), line=19)}
    records.update({r: recorded(bucket(), DDP) for r in (1, 2, 3)})
    found = find_mismatch(records)

    assert found is not None
    assert (found.kind, found.culprits, found.seq) == (OP, [0], 12)
    assert found.line() == (
        "collective mismatch at sequence id 12: rank 0 waits in barrier (train.py:19) while "
        "ranks 1-3 wait in DDP's gradient all_reduce (train.py:22)"
    )
    assert found.to_dict()["sides"][0] == {
        "ranks": [0],
        "what": "barrier",
        "sites": ["train.py:19"],
        "entered": True,
    }


def test_sizes_that_differ_are_a_mismatch_and_are_shown() -> None:
    records = {r: recorded(bucket(size=212)) for r in (0, 1, 2)}
    records[3] = recorded(bucket(size=100))
    found = find_mismatch(records)

    assert found is not None and found.culprits == [3]
    assert "rank 3 waits in all_reduce [[100]]" in found.line()
    assert "ranks 0-2 wait in all_reduce [[212]]" in found.line()


def test_a_rank_behind_in_collective_count_is_the_culprit() -> None:
    records = {r: recorded(bucket(), GUARD, line=80) for r in (0, 1, 3)}
    records[2] = recorded(None, line=45)  # completed 11, never entered 12
    found = find_mismatch(records)

    assert found is not None
    assert (found.kind, found.culprits, found.seq) == (BEHIND, [2], 12)
    assert found.line() == (
        "collective mismatch at sequence id 12: rank 2 never entered it (at train.py:45) while "
        "ranks 0, 1, 3 wait in trainguard's check all_reduce (train.py:80)"
    )


def test_the_first_difference_counts_even_when_windows_do_not_overlap() -> None:
    """Rank 1 is hundreds of collectives behind: its window ends before the others' begin."""
    records = {r: recorded(bucket(500), top=499) for r in (0, 2)}
    records[1] = recorded(None, top=120)
    found = find_mismatch(records)

    assert found is not None and found.kind == BEHIND
    assert (found.culprits, found.seq) == ([1], 121)


def test_a_rank_that_entered_a_later_collective_is_not_behind() -> None:
    """A stale window (the last dump before rank 1's newest collective) with the enqueued
    id read afterwards: rank 1 entered 12 too, its op unknown, so no one is behind."""
    records = {r: recorded(bucket()) for r in (0, 2)}
    stale = recorded(None)
    records[1] = CollectiveRecord(**{**stale.__dict__, "enqueued": 12})
    assert find_mismatch(records) is None


def test_the_earliest_differing_sequence_id_wins() -> None:
    """Rank 0's barrier at 12 went through (say) and it waits in 13; the others wait in 12."""
    records = {r: recorded(bucket(), DDP) for r in (1, 2, 3)}
    history = [done(10), done(11), Call(12, "barrier", [], True), bucket(13)]
    records[0] = CollectiveRecord(
        FLIGHT_RECORDER,
        "all_reduce",
        DDP,
        seq=13,
        sizes=[[212]],
        file="/job/a.py",
        line=9,
        last=history,
    )
    found = find_mismatch(records)

    assert found is not None and (found.seq, found.culprits) == (12, [0])
    assert "rank 0 waits in barrier (a.py:9)" in found.line()  # the op at 12, not its label


def test_equal_records_are_no_mismatch() -> None:
    assert find_mismatch({r: recorded(bucket(), DDP) for r in range(4)}) is None
    assert find_mismatch({r: recorded(None) for r in range(4)}) is None  # all in data
    assert find_mismatch({0: recorded(barrier())}) is None  # one rank: nothing to compare


def test_a_tie_blames_every_rank() -> None:
    records = {0: recorded(barrier(), line=19), 1: recorded(bucket(), DDP)}
    found = find_mismatch(records)

    assert found is not None and found.culprits == [0, 1]
    assert found.line() == (
        "collective mismatch at sequence id 12: rank 0 waits in barrier (train.py:19) while "
        "rank 1 waits in DDP's gradient all_reduce (train.py:22)"
    )


def test_three_groups_blame_everyone_outside_the_largest() -> None:
    records = {0: recorded(barrier(), line=19), 1: recorded(Call(12, "broadcast", [[4]], False))}
    records.update({r: recorded(bucket(), DDP) for r in (2, 3, 4)})
    found = find_mismatch(records)

    assert found is not None and found.culprits == [0, 1]
    assert found.line().endswith("while ranks 2-4 wait in DDP's gradient all_reduce (train.py:22)")


# -- stacks -------------------------------------------------------------------------------------


def test_stacks_name_the_minority_op_without_sequence_ids() -> None:
    records = {0: stacked("barrier", line=19)}
    records.update({r: stacked("all_reduce", DDP) for r in (1, 2, 3)})
    found = find_mismatch(records)

    assert found is not None and (found.kind, found.culprits, found.seq) == (OP, [0], None)
    assert found.line() == (
        "collective mismatch: rank 0 waits in barrier (train.py:19) while ranks 1-3 wait in "
        "DDP's gradient all_reduce (train.py:22)"
    )


def test_stacks_name_a_rank_in_no_collective_while_the_others_wait() -> None:
    records = {r: stacked("all_reduce", GUARD, line=80) for r in (0, 1, 3)}
    records[2] = stacked(None, line=45)
    found = find_mismatch(records)

    assert found is not None and (found.kind, found.culprits) == (BEHIND, [2])
    assert found.line().startswith(
        "collective mismatch: rank 2 is in no collective (at train.py:45)"
    )


def test_equal_stacks_and_mixed_sources_compare_by_what_they_wait_in() -> None:
    assert find_mismatch({r: stacked("all_reduce", DDP) for r in range(3)}) is None
    assert find_mismatch({r: stacked(None, "backward") for r in range(3)}) is None
    mixed = {0: recorded(barrier(), line=19), 1: stacked("all_reduce", DDP)}
    mixed[2] = stacked("all_reduce", DDP)
    found = find_mismatch(mixed)
    assert found is not None and (found.culprits, found.seq) == ([0], None)


def test_rank_lists_read_naturally() -> None:
    assert rank_list([3]) == "rank 3"
    assert rank_list([3, 1, 2]) == "ranks 1-3"
    assert rank_list([0, 1]) == "ranks 0, 1"
    assert rank_list([0, 2, 5]) == "ranks 0, 2, 5"


# -- records travel in heartbeats and decide the hang -------------------------------------------


def test_a_record_survives_the_heartbeat_and_is_absent_otherwise() -> None:
    record = recorded(barrier(), line=19)
    beat = Heartbeat(3, 15, "step", 40, False, 2.0, collective=record.to_dict())
    decoded = Heartbeat.decode(beat.encode())
    assert decoded is not None and decoded.collective is not None
    assert CollectiveRecord.from_dict(decoded.collective) == record
    plain = Heartbeat(3, 15, "step", 40, False, 2.0)
    assert "collective" not in plain.encode()
    assert Heartbeat.decode(plain.encode()) == plain
    assert CollectiveRecord.from_dict({"source": "stack", "line": "x"}) is None


def view(rank: int, record: CollectiveRecord | None, phase: str = "step") -> RankView:
    return RankView(
        rank,
        registered=True,
        state="running",
        step=15,
        phase=phase,
        user_phase=False,
        timeout=2.0,
        heartbeat_age=0.1,
        progress_age=2.5,
        collective=record.to_dict() if record is not None else None,
    )


def test_a_hang_blames_the_minority_collective_not_every_rank() -> None:
    views = [view(0, recorded(barrier(), line=19))]
    views += [view(r, recorded(bucket(), DDP)) for r in (1, 2, 3)]
    verdict = assess(views, me=0, timeout=2.0, dead_after=2.0)

    assert verdict is not None and verdict.kind == HANG and verdict.culprits == [0]
    assert verdict.reason.startswith("no rank made progress for 2s; collective mismatch at")
    # without records, every rank is at the same place: nobody can be singled out
    bare = assess([view(r, None) for r in range(4)], me=0, timeout=2.0, dead_after=2.0)
    assert bare is not None and bare.culprits == [0, 1, 2, 3]


def test_a_rank_behind_keeps_its_step_and_phase_in_the_reason() -> None:
    views = [view(r, recorded(bucket(), GUARD, line=80), phase="check") for r in (0, 1, 3)]
    views.insert(2, view(2, recorded(None, line=45), phase="data"))
    verdict = assess(views, me=0, timeout=2.0, dead_after=2.0)

    assert verdict is not None and verdict.culprits == [2]
    assert "behind: rank 2 at step 15 in 'data'; collective mismatch at sequence id 12" in (
        verdict.reason
    )


def test_a_hang_waits_briefly_for_ranks_whose_record_has_not_come_yet() -> None:
    """Rank 1's watchdog was starved: without the wait it would be left out of the
    comparison (or, alone in no collective, blamed)."""

    def views(age: float) -> list[RankView]:
        out = [view(0, recorded(barrier(), line=19))]
        out += [view(r, recorded(bucket(), DDP)) for r in (2, 3)]
        late = view(1, None)
        out.insert(1, RankView(**{**late.__dict__, "progress_age": age}))
        return [RankView(**{**v.__dict__, "progress_age": age}) for v in out]

    assert assess(views(2.5), me=0, timeout=2.0, dead_after=2.0) is None
    verdict = assess(views(3.1), me=0, timeout=2.0, dead_after=2.0)  # waited half the timeout
    assert verdict is not None and verdict.culprits == [0]
    assert "while ranks 2, 3 wait in" in verdict.reason


def _in_phase(v: RankView, phase: str = "checkpoint") -> RankView:
    return RankView(**{**v.__dict__, "phase": phase, "user_phase": True})


def test_a_phase_excuses_no_lone_collective() -> None:
    """Rank 0 saves a checkpoint in ``guard.phase`` and calls a barrier the others never call;
    they wait in the next step's gradient all-reduce: a deadlock, rank 0's."""
    views = [_in_phase(view(0, recorded(barrier(), line=19)))]
    views += [view(1, recorded(bucket(), DDP))]  # a tie of two: the phase decides
    verdict = assess(views, me=1, timeout=2.0, dead_after=2.0)
    assert verdict is not None and verdict.kind == HANG and verdict.culprits == [0]
    assert "in a user phase, collective mismatch at sequence id 12: rank 0 waits in barrier" in (
        verdict.reason
    )


def test_a_phase_working_outside_a_collective_is_no_hang() -> None:
    """A long evaluation in a phase (in no collective) while the others wait: no hang; nor
    while the phase's collective is the one the others wait in."""
    views = [_in_phase(view(0, recorded(None, line=40), phase="eval"))]
    views += [view(r, recorded(bucket(), DDP)) for r in (1, 2)]
    assert assess(views, me=1, timeout=2.0, dead_after=2.0) is None
    same = [_in_phase(view(0, recorded(bucket(), DDP))), *views[1:]]
    assert assess(same, me=1, timeout=2.0, dead_after=2.0) is None


def test_a_rank_that_left_its_loop_is_the_culprit_whatever_the_records_say() -> None:
    """Rank 1 broke out of its loop early and waits in a barrier (outside the loop it
    publishes no record); ranks 0 and 2 disagree about the DDP buffer broadcast its barrier
    took the place of. Rank 1 is the one they wait for."""
    views = [view(0, recorded(None, line=30))]
    views.append(view(1, None, phase="done"))
    views.append(view(2, recorded(bucket(), DDP)))
    verdict = assess(views, me=0, timeout=2.0, dead_after=2.0)
    assert verdict is not None and verdict.culprits == [1]
    assert verdict.reason.startswith("no rank made progress for 2s; behind: rank 1 at step 15")


def test_a_rank_busy_alone_outside_a_phase_is_told_about_guard_phase() -> None:
    """Rank 0 evaluates (or saves) alone in no collective and outside a phase while the
    others wait in the next all-reduce: a hang, and the reason says how to mark that work.
    A rank stuck in its data loading is not told so; nor is a phase's own deadlock."""
    views = [view(0, recorded(None, line=40))]
    views += [view(r, recorded(bucket(), DDP)) for r in (1, 2)]
    verdict = assess(views, me=1, timeout=2.0, dead_after=2.0)
    assert verdict is not None and verdict.culprits == [0]
    assert verdict.reason.endswith(
        "; if rank 0 was busy on purpose while the others waited (an evaluation or a "
        'checkpoint on one rank), wrap that work in `with guard.phase("eval"):` (docs/hangs.md)'
    )
    loading = [view(0, recorded(None, line=40), phase="data"), *views[1:]]
    verdict = assess(loading, me=1, timeout=2.0, dead_after=2.0)
    assert verdict is not None and verdict.culprits == [0] and "guard.phase" not in verdict.reason
    deadlock = [_in_phase(view(0, recorded(barrier(), line=19))), view(1, recorded(bucket(), DDP))]
    verdict = assess(deadlock, me=1, timeout=2.0, dead_after=2.0)
    assert verdict is not None and "guard.phase" not in verdict.reason


def test_a_collective_mismatch_outside_a_phase_is_not_told_about_guard_phase() -> None:
    """Rank 0 calls a barrier alone (a checkpoint's, outside a phase) while ranks 1 and 2
    wait in DDP's buffer broadcast: marking that work as a phase would still hang, so the
    reason names the mismatch only (it told the user to wrap it in ``guard.phase``). Nor is
    a 2-rank tie told "while the others waited" of both ranks."""
    views = [view(0, recorded(barrier(), line=19))]
    views += [view(r, recorded(bucket(), DDP)) for r in (1, 2)]
    verdict = assess(views, me=1, timeout=2.0, dead_after=2.0)
    assert verdict is not None and verdict.culprits == [0]
    assert "collective mismatch at sequence id 12: rank 0 waits in barrier" in verdict.reason
    assert "guard.phase" not in verdict.reason
    tie = [view(0, recorded(barrier(), line=19)), view(1, recorded(bucket(), DDP))]
    verdict = assess(tie, me=1, timeout=2.0, dead_after=2.0)
    assert verdict is not None and "guard.phase" not in verdict.reason


def test_a_deadlock_between_two_loops_is_a_hang() -> None:
    """Every rank finished its ``watch()`` loop (``done``): rank 0 waits in a barrier of its
    epoch-end checkpoint, ranks 1 and 2 in an all-reduce of their own evaluation. Being
    outside the loop excuses slowness (a long evaluation), not a deadlock."""
    views = [view(0, recorded(barrier(), line=19), phase="done")]
    views += [view(r, recorded(bucket(), "", line=60), phase="done") for r in (1, 2)]
    verdict = assess(views, me=1, timeout=2.0, dead_after=2.0)
    assert verdict is not None and verdict.kind == HANG and verdict.culprits == [0]
    assert verdict.reason.startswith(
        "no rank made progress for 2s; outside the training loop, collective mismatch at "
        "sequence id 12: rank 0 waits in barrier"
    )


def test_work_between_two_loops_outside_a_collective_is_no_hang() -> None:
    """Rank 0 evaluates after the epoch (in no collective) while the others wait in the
    barrier after it: no hang, however long; nor when every rank waits in one collective."""
    views = [view(0, recorded(None, line=40), phase="done")]
    views += [view(r, recorded(barrier(), line=19), phase="done") for r in (1, 2)]
    assert assess(views, me=1, timeout=2.0, dead_after=2.0) is None
    views = [view(r, recorded(barrier(), line=19), phase="done") for r in range(3)]
    assert assess(views, me=1, timeout=2.0, dead_after=2.0) is None
    assert assess([view(r, None, phase="done") for r in range(3)], 1, 2.0, 2.0) is None


def test_stacks_alone_are_not_compared_between_two_loops() -> None:
    """With the flight recorder off the records are stacks, read at different moments: rank
    0 seen in a barrier and the others in an all-reduce may be an evaluation going on (no
    sequence id tells), so no deadlock is declared between loops, nor while every rank is in
    a phase; with ranks stuck in their loop, the paused rank's collective still tells."""
    views = [view(0, stacked("barrier", line=19), phase="done")]
    views += [view(r, stacked("all_reduce", line=60), phase="done") for r in (1, 2)]
    assert assess(views, me=1, timeout=2.0, dead_after=2.0) is None
    views[0] = _in_phase(view(0, stacked("all_reduce", line=70)), "eval")
    views[1:] = [view(r, stacked("barrier", line=19), phase="done") for r in (1, 2)]
    assert assess(views, me=1, timeout=2.0, dead_after=2.0) is None
    views[1:] = [_in_phase(view(r, stacked("barrier", line=19)), "eval") for r in (1, 2)]
    assert assess(views, me=1, timeout=2.0, dead_after=2.0) is None  # all in a phase
    views[1:] = [view(r, stacked("all_reduce", DDP, line=41)) for r in (1, 2)]
    verdict = assess(views, me=1, timeout=2.0, dead_after=2.0)  # the others stuck in the loop
    assert verdict is not None and verdict.culprits == [0] and "in a user phase" in verdict.reason


def test_a_rank_between_loops_is_behind_and_its_record_is_not_compared() -> None:
    """Rank 0 left its loop and waits in a barrier while ranks 1 and 2 wait in the next
    step's gradient all-reduce: rank 0 is behind; the ranks in their loop agree, so no
    mismatch is said "among the ranks in their loop"."""
    views = [view(0, recorded(barrier(), line=19), phase="done")]
    views += [view(r, recorded(bucket(), DDP)) for r in (1, 2)]
    verdict = assess(views, me=1, timeout=2.0, dead_after=2.0)
    assert verdict is not None and verdict.culprits == [0]
    assert "behind: rank 0 at step 15 in 'done'" in verdict.reason
    assert "among the ranks in their loop" not in verdict.reason
