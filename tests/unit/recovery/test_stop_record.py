"""The stop record and the restart check, in one process: what the fingerprint holds, the
record's round trip, the verdicts, the agent lookup, and a guard that stops and a resumed
guard that is refused (docs/recovery.md, "A hopeless restart is refused")."""

from __future__ import annotations

import json
import logging
import os
import signal
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_recovery import train
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import trainguard as tg
from trainguard.distributed import elastic
from trainguard.events import EventLog, read_events
from trainguard.recovery import stop
from trainguard.recovery.failure import store
from trainguard.recovery.restart import LocalView, RestartCheck, Verdict, decide, refusal_line

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: "single process"

NAN = float("nan")


@pytest.fixture(autouse=True)
def _signals_and_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A refusal ignores SIGTERM and SIGINT (its exit must not be cut short): put them back.
    No test may find torchrun's agent: the parent of pytest must never get a signal."""
    for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TRAINGUARD_FORCE_RESTART"):
        monkeypatch.delenv(name, raising=False)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.fixture(autouse=True)
def _trainguard_logs(caplog: pytest.LogCaptureFixture) -> None:
    """Frameworks imported by other tests (``logging.config`` with
    ``disable_existing_loggers``) can disable trainguard's loggers; these tests read them."""
    for name, logger in logging.root.manager.loggerDict.items():
        if name.startswith("trainguard") and isinstance(logger, logging.Logger):
            logger.disabled = False
            logger.propagate = True
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.INFO, logger="trainguard")  # a level set by another test


def _config(run_dir: Path, **overrides: Any) -> tg.GuardConfig:
    fields: dict[str, Any] = {
        "run_dir": run_dir,
        "hang_timeout": 0,
        "max_consecutive": 2,
        "on_escalation": "rollback",
        "recovery.snapshot_every": 2,
        "recovery.good_after": 1,
        "checkpoint_every": 2,
        "resume": True,
    }
    return tg.GuardConfig.from_options({**fields, **overrides})


def _loader(n: int = 16) -> DataLoader[Any]:
    data = TensorDataset(torch.zeros(n, 3), torch.zeros(n, 1))
    return DataLoader(data, batch_size=4)


def _good_checkpoint(run_dir: Path, step: int) -> Path:
    path = run_dir / "checkpoints" / f"step-{step:08d}"
    path.mkdir(parents=True)
    (path / "manifest.json").write_text("{}")
    (path / "GOOD").write_text("{}")
    return path


def _error(step: int = 7, bundle: Path | None = None) -> tg.NonFiniteError:
    message = f"step {step}: 2 non-finite steps in a row"
    return tg.NonFiniteError(message, step=step, ranks=[0], bundle=bundle)


# -- the fingerprint -------------------------------------------------------------------------


def test_fingerprint_follows_the_training_not_the_bookkeeping(tmp_path: Path) -> None:
    data = stop.data_identity(_loader())
    base = stop.fingerprint_inputs(_config(tmp_path), "checkpoints/step-00000004", data)
    same = stop.fingerprint_inputs(
        _config(
            tmp_path / "elsewhere",
            hang_timeout=30,
            keep_checkpoints=9,
            capture=False,
            **{"history.metrics_lines_per_second": 5.0},
        ),
        "checkpoints/step-00000004",
        data,
    )
    assert stop.fingerprint(base) == stop.fingerprint(same)
    assert stop.changed_inputs(base, same) == []
    cases = {
        "config.recovery.max_rollbacks": (
            _config(tmp_path, **{"recovery.max_rollbacks": 5}),
            base["checkpoint"],
            data,
        ),
        "config.extra": (_config(tmp_path, extra={"data": "v2"}), base["checkpoint"], data),
        "checkpoint": (_config(tmp_path), "checkpoints/step-00000002", data),
        "data": (_config(tmp_path), base["checkpoint"], stop.data_identity(_loader(20))),
    }
    for name, (config, checkpoint, other) in cases.items():
        changed = stop.fingerprint_inputs(config, checkpoint, other)
        assert stop.fingerprint(changed) != stop.fingerprint(base), name
        assert stop.changed_inputs(base, changed) == [name]


def test_data_identity_is_what_is_cheap() -> None:
    loader = stop.data_identity(_loader(16))
    assert loader == {
        "type": "torch.utils.data.dataloader.DataLoader",
        "len": 4,
        "dataset": "torch.utils.data.dataset.TensorDataset",
        "dataset_len": 16,
        "batch_size": 4,
    }
    assert stop.data_identity([1, 2, 3]) == {"type": "builtins.list", "len": 3}
    assert stop.data_identity(None) is None

    class Stream(IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(range(3))

    unsized = stop.data_identity(DataLoader(Stream(), batch_size=None))
    assert unsized is not None and unsized["len"] is None and unsized["dataset_len"] is None


def test_entry_is_the_main_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    script = tmp_path / "train.py"
    script.write_text("print('one')\n")
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    monkeypatch.setitem(sys.modules, "__main__", main)
    first = stop.entry_identity()
    script.write_text("print('two')\n")
    assert first is not None and first["file"] == "train.py"
    assert stop.entry_identity() != first


def test_cause_of_a_stop() -> None:
    assert stop.cause_of(_error()) == "nonfinite"
    scale = tg.LossScaleCollapseError("scale", step=3, ranks=[0])
    assert stop.cause_of(scale) == "loss_scale"
    assert stop.cause_of(_error(), "spike") == "spike"


# -- the record ------------------------------------------------------------------------------


def test_record_round_trips_and_names_the_newest_good_checkpoint(tmp_path: Path) -> None:
    _good_checkpoint(tmp_path, 2)
    _good_checkpoint(tmp_path, 4)
    (tmp_path / "checkpoints" / "step-00000006").mkdir()  # never became good
    error = tg.NonFiniteError("step 7: bad", step=7, ranks=[1], bundle=tmp_path / "captures")
    path = stop.record_stop(_config(tmp_path), 0, error, _loader(), attempt=2)
    assert path == tmp_path / "stop.json" and not list(tmp_path.glob("*.tmp"))
    record = stop.read_record(tmp_path)
    assert record is not None
    assert (record.step, record.cause, record.attempt) == (7, "nonfinite", 2)
    assert record.checkpoint == "checkpoints/step-00000004"
    assert record.bundle == str(tmp_path / "captures")
    assert record.inputs["data"]["dataset_len"] == 16
    now = stop.fingerprint_inputs(
        _config(tmp_path), record.checkpoint, stop.data_identity(_loader())
    )
    assert record.fingerprint == stop.fingerprint(now) and record.inputs == now
    assert stop.record_stop(_config(tmp_path / "other"), 1, error, None, 0) is None  # rank 0 only


def test_unreadable_record_is_no_record(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "stop.json").write_text("{not json")
    assert stop.read_record(tmp_path) is None
    assert "unreadable stop record" in caplog.text


def test_retired_record_is_kept_aside(tmp_path: Path) -> None:
    stop.record_stop(_config(tmp_path), 0, _error(), None, 0)
    kept = stop.retire_record(tmp_path, {"verdict": "forced"})
    assert kept == tmp_path / "recovery" / "stop-cleared.json"
    assert not (tmp_path / "stop.json").exists()
    assert json.loads(kept.read_text())["cleared"]["verdict"] == "forced"
    assert stop.retire_record(tmp_path, {}) is None  # nothing left to clear


# -- the verdict -----------------------------------------------------------------------------


def test_verdicts() -> None:
    def verdict(seen: bool, differs: bool, restarted: bool, force: bool) -> Verdict:
        return decide(LocalView(seen, differs, restarted, force).flags())

    assert verdict(False, False, True, False) is Verdict.NO_RECORD
    assert verdict(True, False, False, False) is Verdict.NEW_LAUNCH
    assert verdict(True, False, True, True) is Verdict.FORCED
    assert verdict(True, True, True, False) is Verdict.CHANGED
    assert verdict(True, False, True, False) is Verdict.REFUSED
    # agreed over ranks with MAX: one rank restarted, another saw a change
    assert decide([1, 1, 0, 0]) is Verdict.NEW_LAUNCH
    assert decide([1, 0, 1, 0]) is Verdict.REFUSED


def _check(
    run_dir: Path, env: dict[str, str], exits: list[int], checkpoint: str | None = None
) -> Verdict:
    check = RestartCheck(
        _config(run_dir),
        checkpoint,
        _loader(),
        EventLog(run_dir, 0),
        None,
        torch.device("cpu"),
        0,
        env=env,
        exit_fn=exits.append,
    )
    return check.run()


def test_restart_check_refuses_only_an_unchanged_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    exits: list[int] = []
    restart = {"TORCHELASTIC_RESTART_COUNT": "1"}
    assert _check(tmp_path, restart, exits) is Verdict.NO_RECORD
    _good_checkpoint(tmp_path, 4)
    stop.record_stop(_config(tmp_path), 0, _error(), _loader(), 0)
    assert _check(tmp_path, restart, exits, "checkpoints/step-00000004") is Verdict.REFUSED
    assert exits == [tg.EXIT_DO_NOT_RESTART]
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1 and "restart 1 refused (exit 93)" in lines[0]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # the agent's SIGTERM waits
    refused = [e for e in read_events(tmp_path, 0) if e["kind"] == "restart_refused"]
    assert refused[0]["agent"] == "not under torchrun" and refused[0]["exit_code"] == 93
    assert (tmp_path / "stop.json").exists()  # a refused restart leaves the record
    # another checkpoint: a change; the record is moved aside
    assert _check(tmp_path, restart, exits, "checkpoints/step-00000002") is Verdict.CHANGED
    assert not (tmp_path / "stop.json").exists() and exits == [93]


def test_a_rank_that_cannot_read_the_record_is_refused_with_the_others(tmp_path: Path) -> None:
    """The verdict is agreed: a rank whose run folder lags (no record) exits alike."""
    exits: list[int] = []
    check = RestartCheck(
        _config(tmp_path),
        None,
        _loader(),
        EventLog(tmp_path, 1),
        None,
        torch.device("cpu"),
        1,
        env={"TORCHELASTIC_RESTART_COUNT": "1"},
        exit_fn=exits.append,
    )
    check._refuse(None, 1)
    assert exits == [tg.EXIT_DO_NOT_RESTART]
    refused = [e for e in read_events(tmp_path, 1) if e["kind"] == "restart_refused"]
    assert refused[0]["cause"] is None and "other ranks' reading" in refused[0]["message"]


def test_forced_and_new_launches_run_and_clear(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    exits: list[int] = []
    stop.record_stop(_config(tmp_path), 0, _error(), _loader(), 0)
    forced = {"TORCHELASTIC_RESTART_COUNT": "2", "TRAINGUARD_FORCE_RESTART": "1"}
    assert _check(tmp_path, forced, exits) is Verdict.FORCED
    assert "TRAINGUARD_FORCE_RESTART=1: restart 2 goes on" in caplog.text
    stop.record_stop(_config(tmp_path), 0, _error(), _loader(), 0)
    assert _check(tmp_path, {}, exits) is Verdict.NEW_LAUNCH
    assert "it may stop again" in caplog.text
    assert exits == [] and not (tmp_path / "stop.json").exists()
    cleared = [e["verdict"] for e in read_events(tmp_path, 0) if e["kind"] == "stop_record_cleared"]
    assert cleared == ["forced", "new_launch"]


def test_refusal_line_says_why_and_how_to_clear(tmp_path: Path) -> None:
    stop.record_stop(_config(tmp_path), 0, _error(bundle=None), None, 0)
    record = stop.read_record(tmp_path)
    assert record is not None
    line = refusal_line(record, 1, tmp_path)
    assert "at step 7 (nonfinite: 2 non-finite steps in a row; bundle none)" in line
    assert "a fresh start" in line and "TRAINGUARD_FORCE_RESTART=1" in line
    assert str(tmp_path / "stop.json") in line


# -- torchrun's agent ------------------------------------------------------------------------


def _fake_proc(tmp_path: Path, cmdline: list[str]) -> Path:
    folder = tmp_path / "proc" / str(os.getppid())
    folder.mkdir(parents=True)
    (folder / "cmdline").write_bytes(b"\0".join(w.encode() for w in cmdline) + b"\0")
    return tmp_path / "proc"


def test_agent_is_the_parent_only_when_it_is_torchrun(tmp_path: Path) -> None:
    env = {"TORCHELASTIC_RUN_ID": "none"}
    torchrun = _fake_proc(tmp_path / "a", ["/venv/bin/python", "/venv/bin/torchrun", "x.py"])
    module = _fake_proc(tmp_path / "b", ["python", "-m", "torch.distributed.run", "x.py"])
    shell = _fake_proc(tmp_path / "c", ["/bin/bash", "run.sh"])
    assert elastic.agent_pid(env, torchrun) == os.getppid()
    assert elastic.agent_pid(env, module) == os.getppid()
    assert elastic.agent_pid(env, shell) is None
    assert elastic.agent_pid({}, torchrun) is None  # not under torchelastic
    assert elastic.agent_pid(env, tmp_path / "nowhere") is None


def test_stop_agent_signals_once_per_agent_while_restarts_are_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(elastic.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    proc = _fake_proc(tmp_path, ["python", "/venv/bin/torchrun"])
    env = {
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "TORCHELASTIC_RESTART_COUNT": "1",
        "LOCAL_RANK": "1",
    }
    assert elastic.stop_agent(env, proc) == "local rank 0 stops the agent"
    last = {**env, "LOCAL_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "3"}
    assert elastic.stop_agent(last, proc).startswith("no restarts left")
    assert elastic.stop_agent({}, proc) == "not under torchrun"
    assert sent == []
    done = elastic.stop_agent({**env, "LOCAL_RANK": "0"}, proc)
    assert sent == [(os.getppid(), signal.SIGTERM)] and "2 restarts left unused" in done


def test_restart_count() -> None:
    assert elastic.restart_count({}) == 0
    assert elastic.restart_count({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert elastic.restart_count({"TORCHELASTIC_RESTART_COUNT": "x"}) == 0


# -- through the guard -----------------------------------------------------------------------


def test_guard_records_its_final_stop_and_refuses_the_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    poison = {i: NAN for i in range(5, 40)}  # bad from batch 5 on: every rollback lands on it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = train(0, "plain", tmp_path, 40, poison, config=_config(tmp_path))
    assert first["error"] == "NonFiniteError"
    record = stop.read_record(tmp_path)
    assert record is not None and record.cause == "nonfinite"
    # the newest good checkpoint survives the rollbacks to its step (not written again there)
    assert record.checkpoint == "checkpoints/step-00000004"
    assert (tmp_path / record.checkpoint / "GOOD").exists()
    assert record.bundle is not None and Path(record.bundle).is_dir()
    assert record.inputs["data"] == {"type": "builtins.list", "len": 40}

    def leave(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", leave)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(SystemExit) as ended, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(0, "plain", tmp_path, 40, poison, config=_config(tmp_path))
    assert ended.value.code == tg.EXIT_DO_NOT_RESTART
    refused = [e for e in read_events(tmp_path, 0) if e["kind"] == "restart_refused"]
    assert [(e["step"], e["checkpoint"]) for e in refused] == [(record.step, record.checkpoint)]
    # the job is over: the folder for its states at a failure is gone with it
    assert not store.job_folder(tmp_path, None).exists()


def test_no_record_for_raise_on_the_first_bad_step(tmp_path: Path) -> None:
    config = tg.GuardConfig(run_dir=tmp_path, hang_timeout=0, on_nonfinite="raise")
    run = train(0, "plain", tmp_path, 6, {2: NAN}, config=config)
    assert run["error"] == "NonFiniteError" and not (tmp_path / "stop.json").exists()


def test_escalation_without_recovery_is_recorded(tmp_path: Path) -> None:
    config = tg.GuardConfig(run_dir=tmp_path, hang_timeout=0, max_consecutive=2)
    run = train(0, "plain", tmp_path, 6, {2: NAN, 3: NAN}, config=config)
    record = stop.read_record(tmp_path)
    assert run["error"] == "NonFiniteError" and record is not None
    # no recovery part, nothing remembers the watched data (no restart checks this record)
    assert (record.step, record.checkpoint, record.inputs["data"]) == (3, None, None)
