"""Reading one rank's collective: the main thread's stack (``frames``), torch's flight
recorder dump (``flight_recorder``), the probe that combines them, the recorder's default,
and the report's collectives table."""

from __future__ import annotations

import functools
import os
import pickle
from pathlib import Path
from typing import Any

from trainguard.hang import flight_recorder as fr
from trainguard.hang.collective_record import FLIGHT_RECORDER, STACK, Call, describe
from trainguard.hang.collectives import CollectiveProbe
from trainguard.hang.frames import (
    DDP_ALL_REDUCE,
    GUARD_ALL_REDUCE,
    TORCH_DIR,
    TRAINGUARD_DIR,
    Frame,
    classify,
    frames_of,
    user_site,
)
from trainguard.hang.heartbeat import RankView
from trainguard.hang.report import build_report, format_report
from trainguard.hang.rules import HANG, Verdict

USER = Frame("/job/train.py", 19, "main")
STDLIB = Frame(os.path.dirname(os.__file__) + "/threading.py", 320, "wait")


def torch_frame(path: str, function: str) -> Frame:
    return Frame(TORCH_DIR + path, 10, function)


def tg_frame(path: str, function: str) -> Frame:
    return Frame(TRAINGUARD_DIR + path, 10, function)


def never() -> bool:
    raise AssertionError("the DDP search must not run here")


# -- the stack ----------------------------------------------------------------------------------


def test_a_barrier_is_named_with_the_users_line() -> None:
    frames = [
        USER,
        torch_frame("distributed/c10d_logger.py", "wrapper"),
        torch_frame("distributed/distributed_c10d.py", "barrier"),
    ]
    call = classify(frames, never)
    assert (call.op, call.label, call.site) == ("barrier", "barrier", USER)


def test_the_outermost_collective_the_user_called_is_named() -> None:
    frames = [
        USER,
        torch_frame("distributed/distributed_c10d.py", "all_gather_object"),
        torch_frame("distributed/c10d_logger.py", "wrapper"),
        torch_frame("distributed/distributed_c10d.py", "all_gather"),
    ]
    assert classify(frames, never).op == "all_gather_object"


def test_backward_is_ddps_all_reduce_only_with_a_ddp_model() -> None:
    frames = [
        Frame("/job/train.py", 22, "main"),
        torch_frame("_tensor.py", "backward"),
        torch_frame("autograd/__init__.py", "backward"),
        torch_frame("autograd/graph.py", "_engine_run_backward"),
    ]
    with_ddp = classify(frames, lambda: True)
    assert (with_ddp.op, with_ddp.label, with_ddp.site) == ("all_reduce", DDP_ALL_REDUCE, frames[0])
    plain = classify(frames, lambda: False)
    assert (plain.op, plain.label) == (None, "backward")


def test_the_guards_own_all_reduce_is_named() -> None:
    frames = [
        Frame("/job/train.py", 24, "main"),
        tg_frame("step/guard.py", "step"),
        tg_frame("step/consensus.py", "agree"),
        tg_frame("step/collective_work.py", "wait"),
    ]
    call = classify(frames, never)
    assert (call.op, call.label, call.site) == ("all_reduce", GUARD_ALL_REDUCE, frames[0])


def test_user_code_below_trainguard_is_no_collective() -> None:
    """A loader blocked inside ``guard.watch()``: the innermost code is the user's."""
    loader = Frame("/job/data.py", 45, "load")
    frames = [USER, tg_frame("step/stream.py", "__iter__"), loader, STDLIB]
    call = classify(frames, never)
    assert (call.op, call.label, call.site) == (None, "", loader)


def test_the_site_skips_torch_trainguard_and_the_standard_library() -> None:
    assert user_site([USER, STDLIB, torch_frame("x.py", "f")]) == USER
    assert user_site([torch_frame("x.py", "f")]) is None
    assert user_site([STDLIB, torch_frame("x.py", "f")]) == STDLIB  # nothing better


def test_frames_of_reads_a_real_stack_outermost_first() -> None:
    import sys

    frames = frames_of(sys._getframe())
    assert frames[-1].function == "test_frames_of_reads_a_real_stack_outermost_first"
    assert frames[-1].file == __file__


# -- the flight recorder ------------------------------------------------------------------------


def entry(
    seq: int, name: str, sizes: list[list[int]], retired: bool, pg: str = "0"
) -> dict[str, Any]:
    return {
        "collective_seq_id": seq,
        "profiling_name": name,
        "input_sizes": sizes,
        "retired": retired,
        "state": "scheduled",
        "is_p2p": False,
        "process_group": (pg, "default_pg"),
    }


class FakeDump:
    """torch's dump: ``pg_status`` always, ``entries`` when asked; counts the full dumps."""

    def __init__(self, entries: list[dict[str, Any]], enqueued: int, completed: int) -> None:
        self.entries = entries
        self.status = {
            "0": {"last_enqueued_collective": enqueued, "last_completed_collective": completed}
        }
        self.full = 0

    def __call__(self, includeCollectives: bool = True, **_: Any) -> bytes:
        data: dict[str, Any] = {"version": "2.10", "pg_status": self.status}
        if includeCollectives:
            self.full += 1
            data["entries"] = self.entries
        return pickle.dumps(data)


def gloo_history() -> list[dict[str, Any]]:
    done = [entry(seq, "gloo:all_reduce", [[36]], True) for seq in range(1, 12)]
    other_group = entry(5, "gloo:broadcast", [[4]], False, pg="1")
    return [*done, other_group, entry(12, "gloo:barrier", [], False)]


def test_nccl_and_gloo_recorders_are_read_together() -> None:
    """NCCL records into its own recorder (``_dump_nccl_trace``): the merged dump holds both
    recorders' entries, an entry both hold once, and each group's most advanced status."""
    nccl = [entry(seq, "nccl:all_reduce", [[4]], True) for seq in (1, 2, 3)]
    gloo = [entry(1, "gloo:broadcast", [[2]], True, pg="1"), nccl[2]]
    dump = functools.partial(fr.merged_dump, (FakeDump(gloo, 0, 0), FakeDump(nccl, 3, 3)))
    assert fr.pg_status("0", dump) == (3, 3)
    calls = fr.read_calls("0", dump)
    assert calls is not None
    assert [(c.seq, c.op, c.done) for c in calls] == [(s, "all_reduce", True) for s in (1, 2, 3)]
    other = fr.read_calls("1", dump)
    assert other is not None and [c.op for c in other] == ["broadcast"]


def test_calls_are_the_groups_last_ones_and_its_pending_one() -> None:
    calls = fr.read_calls("0", FakeDump(gloo_history(), 12, 11))
    assert calls is not None
    assert [c.seq for c in calls] == [9, 10, 11, 12]
    assert calls[-1] == Call(12, "barrier", [], False)
    assert calls[0] == Call(9, "all_reduce", [[36]], True)


def test_the_window_reaches_back_to_the_first_pending_call() -> None:
    calls = [Call(seq, "all_reduce", [[1]], seq < 3) for seq in range(1, 40)]
    window = fr.window(calls)
    assert window[0].seq == 40 - fr.MAX_CALLS and len(window) == fr.MAX_CALLS
    short = [Call(seq, "all_reduce", [[1]], seq != 5) for seq in range(1, 12)]
    assert [c.seq for c in fr.window(short)] == list(range(5, 12))


def test_a_recorder_without_the_group_or_without_entries_gives_nothing() -> None:
    assert fr.read_calls("7", FakeDump(gloo_history(), 12, 11)) is None
    assert fr.pg_status("7", FakeDump([], 0, 0)) is None
    assert fr.pg_status("0", FakeDump([], 12, 11)) == (12, 11)

    def broken(**_: Any) -> bytes:
        raise RuntimeError("no recorder")

    assert fr.read_calls("0", broken) is None and fr.pg_status("0", broken) is None


def test_the_probe_reads_the_recorder_and_names_the_call_from_the_stack() -> None:
    stack = [USER, torch_frame("distributed/distributed_c10d.py", "barrier")]
    dump = FakeDump(gloo_history(), 12, 11)
    probe = CollectiveProbe("0", dump=dump, frames=lambda: stack, ddp_present=never)
    record = probe.read()

    assert record.source == FLIGHT_RECORDER
    assert (record.op, record.label, record.seq, record.sizes) == ("barrier", "barrier", 12, [])
    assert (record.site, record.enqueued, record.top) == ("train.py:19", 12, 12)
    assert describe(record) == "barrier, sequence id 12, at train.py:19 (flight_recorder)"
    probe.read()
    assert dump.full == 1  # the status did not change: no second full dump
    dump.status["0"]["last_enqueued_collective"] = 13
    probe.min_dump_interval = 3600.0
    assert probe.read().top == 13 and dump.full == 1  # too soon; the enqueued id moves on
    probe.min_dump_interval = 0.0
    probe.read()
    assert dump.full == 2


def test_without_a_recorder_the_probe_answers_from_the_stack(monkeypatch: Any) -> None:
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    stack = [USER, torch_frame("distributed/distributed_c10d.py", "broadcast")]
    empty = FakeDump([], 0, 0)
    empty.status = {}
    record = CollectiveProbe("0", dump=empty, frames=lambda: stack, ddp_present=never).read()
    assert (record.source, record.op, record.seq, record.last) == (STACK, "broadcast", None, [])
    assert "TORCH_FR_BUFFER_SIZE=0" in record.note


def test_the_ddp_search_is_cached() -> None:
    calls: list[int] = []

    def search() -> bool:
        calls.append(1)
        return True

    backward = [USER, torch_frame("autograd/graph.py", "_engine_run_backward")]
    empty = FakeDump([], 0, 0)
    empty.status = {}
    probe = CollectiveProbe("0", dump=empty, frames=lambda: backward, ddp_present=search)
    assert probe.read().label == DDP_ALL_REDUCE
    assert probe.read().label == DDP_ALL_REDUCE
    assert len(calls) == 1


# -- the recorder's default -----------------------------------------------------------------------


def test_the_recorder_is_turned_on_only_where_nothing_set_it() -> None:
    env: dict[str, str] = {}
    assert fr.enable_by_default(env)
    assert env == {"TORCH_FR_BUFFER_SIZE": "2000"}
    for preset in (
        {"TORCH_FR_BUFFER_SIZE": "0"},
        {"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"},
        {"TRAINGUARD_FLIGHT_RECORDER": "0"},
    ):
        kept = dict(preset)
        assert not fr.enable_by_default(kept) and kept == preset
    assert fr.setting({"TORCH_FR_BUFFER_SIZE": "0"}) == "off"
    assert fr.setting({"TORCH_NCCL_TRACE_BUFFER_SIZE": "20"}) == "on"
    assert fr.setting({}) == "default"


# -- the report -----------------------------------------------------------------------------------


def test_the_report_keeps_each_ranks_collectives_and_says_the_mismatch(tmp_path: Path) -> None:
    dump = FakeDump(gloo_history(), 12, 11)
    barrier = CollectiveProbe(
        "0",
        dump=dump,
        frames=lambda: [USER, torch_frame("distributed/distributed_c10d.py", "barrier")],
        ddp_present=never,
    ).read()
    others = [entry(seq, "gloo:all_reduce", [[36]], True) for seq in range(1, 12)]
    others.append(entry(12, "gloo:all_reduce", [[212]], False))
    backward = [
        Frame("/job/train.py", 22, "main"),
        torch_frame("autograd/graph.py", "_engine_run_backward"),
    ]
    ddp = CollectiveProbe(
        "0", dump=FakeDump(others, 12, 11), frames=lambda: backward, ddp_present=lambda: True
    ).read()
    views = [
        RankView(
            r,
            True,
            "running",
            15,
            "step",
            False,
            2.0,
            0.1,
            2.4,
            "h",
            10 + r,
            collective=(barrier if r == 0 else ddp).to_dict(),
        )
        for r in range(3)
    ]
    verdict = Verdict(HANG, [0], "no rank made progress for 2s", by=0, reporter=0)
    report = build_report("id", verdict, views, timeout=2.0, dead_after=2.0, exit_code=91)

    assert report["collective_mismatch"]["culprits"] == [0]
    assert [r["collective"]["op"] for r in report["ranks"]] == [
        "barrier",
        "all_reduce",
        "all_reduce",
    ]
    assert report["ranks"][1]["collective"]["last"][-1] == [12, "all_reduce", [[212]], False]
    text = format_report(report)
    line = (
        "collective mismatch at sequence id 12: rank 0 waits in barrier (train.py:19) while "
        "ranks 1, 2 wait in DDP's gradient all_reduce (train.py:22)"
    )
    assert f"\n{line}\n" in text  # its own line: the verdict's reason did not say it
    assert "  0*  barrier " in text and "12 barrier*" in text


def test_the_ddp_check_goes_by_the_type_and_never_asks_the_object() -> None:
    import weakref

    from trainguard.hang.frames import _type_check, ddp_in_process

    class Base:
        pass

    class Wrapped(Base):
        pass

    class Gone:
        pass

    check = _type_check(Base)
    proxy = weakref.proxy(Gone())  # dead at once: asking it anything raises ReferenceError
    assert check(Wrapped()) and check(Base()) and not check(proxy) and not check(3)
    assert not ddp_in_process()  # no DDP model in this test process
