"""``trainguard run``'s parts that need no training job: options and environment, model
discovery, the bootstrap's chaining and agent rule, and the optimizer fact a skip relies on
(a step with every gradient None changes neither the weights nor the optimizer's state)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from trainguard.attach.discovery import describe, describe_module, existing_guard, find_model
from trainguard.attach.first_steps import second_optimizer_reason
from trainguard.attach.launch import guard_exit_code
from trainguard.attach.options import BOOTSTRAP_DIR, ENV_VAR, RunOptions, child_env, launcher_of
from trainguard.attach.replace import made_anew
from trainguard.capture.batchtree import call_batch as batch_of
from trainguard.cli import main
from trainguard.errors import ConfigError

OPTIMIZERS = [
    ("SGD", {"lr": 0.1, "momentum": 0.9}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "foreach": True}),
    ("Adam", {}),
    ("Adam", {"foreach": True}),
    ("Adam", {"fused": True}),
    ("AdamW", {}),
    ("AdamW", {"foreach": True}),
    ("AdamW", {"fused": True}),
    ("AdamW", {"amsgrad": True}),
]


@pytest.mark.parametrize(("name", "kwargs"), OPTIMIZERS)
def test_a_step_without_gradients_changes_nothing(name: str, kwargs: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = getattr(torch.optim, name)(model.parameters(), **kwargs)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()  # the state exists (momentum, moments, step counts)
    before = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    for param in model.parameters():
        param.grad = None  # what a skip leaves
    optimizer.step()
    weights, state = model.state_dict(), optimizer.state_dict()
    assert all(torch.equal(before[0][k], v) for k, v in weights.items())
    for index, saved in before[1]["state"].items():
        for key, value in saved.items():
            now = state["state"][index][key]
            assert torch.equal(value, now) if torch.is_tensor(value) else value == now


def test_launcher_of() -> None:
    assert launcher_of(["torchrun", "--nproc-per-node=2", "train.py"]) == "torchrun"
    assert launcher_of(["/venv/bin/torchrun", "train.py"]) == "torchrun"
    assert launcher_of(["python", "-m", "torch.distributed.run", "train.py"]) == "torchrun"
    assert launcher_of(["python", "train.py", "-m", "torch.distributed.run"]) == "plain"
    assert launcher_of(["python", "-m", "mypackage.train"]) == "plain"


def test_child_env_puts_the_bootstrap_first_and_keeps_the_path() -> None:
    options = RunOptions(run_dir="/r", hang_timeout=5.0, launcher="torchrun")
    env = child_env(options, base={"PYTHONPATH": "/mine:/other", "HOME": "/h"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(BOOTSTRAP_DIR), "/mine", "/other"]
    assert env["HOME"] == "/h"
    assert RunOptions.from_mapping(json.loads(env[ENV_VAR])) == options
    assert (BOOTSTRAP_DIR / "sitecustomize.py").is_file()


def test_child_env_gives_each_torchrun_restart_a_store_of_its_own() -> None:
    """torchrun (torch >= 2.5) shares one store across restarts: a restarted gloo group can
    read the dead attempt's addresses and hang in the script's own init_process_group
    (PyTorch's DDP tutorial with a rank killed, under ``trainguard run``). The command gets
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; a value of the user's own stays."""
    assert child_env(RunOptions(), base={})["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    mine = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}
    assert child_env(RunOptions(), base=mine)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "0"


def test_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        RunOptions(on_nonfinite="ignore")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        RunOptions(hang_timeout=-1)


@pytest.mark.parametrize(
    "option",
    ["recovery.resume=true", "resume=true", "checkpoint_every=50", "on_escalation=rollback"],
)
def test_recovery_it_cannot_give_is_one_line_exit_2_before_the_command_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str
) -> None:
    """Snapshots, checkpoints and states at a failure are taken at ``watch()``'s step
    boundary, which a script's own loop never reaches: the options that turn them on are
    refused up front, naming the option as given, instead of a run that silently has none."""
    marker = tmp_path / "ran"
    run = ["run", "--run-dir", str(tmp_path / "run"), "-o", option, "--", "touch", str(marker)]
    assert main(run) == 2
    err = capsys.readouterr().err.strip().splitlines()
    name = option.partition("=")[0]
    assert len(err) == 1 and err[0].startswith(f"trainguard: --option {name}: ")
    assert "guard.watch()" in err[0] and "docs/recovery.md" in err[0]
    assert not marker.exists()
    # what turns nothing on is no refusal (the defaults, a snapshot cadence alone)
    harmless = (
        "resume=false",
        "checkpoint_every=0",
        "on_escalation=raise",
        "recovery.snapshot_every=5",
    )
    for harmless_option in harmless:
        ok = ["run", "--run-dir", str(tmp_path / "ok"), "-o", harmless_option, "--", "true"]
        assert main(ok) == 0


def test_run_without_a_command_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainguard: ") and "COMMAND" in err[0]


def test_an_unusable_run_dir_is_one_line_exit_2_before_the_command_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    marker = tmp_path / "ran"
    assert main(["run", "--run-dir", str(a_file), "--", "touch", str(marker)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainguard: --run-dir: ") and "a-file" in err[0]
    assert not marker.exists()  # refused before the command started
    run_dir = tmp_path / "new" / "run"
    assert main(["run", "--run-dir", str(run_dir), "--", "touch", str(marker)]) == 0
    assert marker.exists() and run_dir.is_dir()


def test_a_command_that_never_attached_is_said_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No guard events from this run (``python -I``, a script that ends before its first
    step): one line says nothing was guarded; events written during the run: no line."""
    run_dir = tmp_path / "run"
    assert main(["run", "--run-dir", str(run_dir), "--", sys.executable, "-I", "-c", "pass"]) == 0
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("trainguard run: the run was not guarded (no guard events in ")
    assert str(run_dir) in line and "python -I, -E or -S" in line
    write = "import pathlib,sys; p=pathlib.Path(sys.argv[1]); p.parent.mkdir(); p.write_text('{}')"
    events = str(run_dir / "events" / "rank-0.jsonl")
    assert main(["run", "--run-dir", str(run_dir), "--", sys.executable, "-c", write, events]) == 0
    assert capsys.readouterr().err == ""


def _hang_report(run_dir: Path, name: str, mtime: float, **fields: Any) -> None:
    path = run_dir / "hangs" / name / "report.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(fields))
    os.utime(path, (mtime, mtime))


def test_the_guards_exit_code_is_returned_unless_a_ranks_own_exception_caused_it(
    tmp_path: Path,
) -> None:
    """torchrun reports any worker's failure as 1. A peer failure that a rank's own exception
    caused (it published it: its culprit decided the verdict) is the script's error: 1
    stands, as torchrun names that rank the root cause. A rank that died or froze (another
    rank decided), or a hang: the guard ended the run, and its code replaces 1."""
    raised = {"kind": "peer_failure", "culprits": [1], "decided_by": 1, "exit_code": 92}
    failing = ["run", "--run-dir", str(tmp_path), "--", sys.executable, "-c", "exit(1)"]
    _hang_report(tmp_path, "raised", 2.0e9, **raised)  # mtimes ahead: written during the run
    assert guard_exit_code(tmp_path, since=0.0) is None
    assert main(failing) == 1
    died = {"kind": "peer_failure", "culprits": [1], "decided_by": 0, "exit_code": 92}
    _hang_report(tmp_path, "died", 2.1e9, **died)
    assert main(failing) == 92
    hang = {"kind": "hang", "culprits": [1], "decided_by": 1, "exit_code": 91}
    _hang_report(tmp_path, "hang", 2.2e9, **hang)
    assert main(failing) == 91  # the newest report
    assert guard_exit_code(tmp_path, since=3e9) is None  # written before this run: not its own
    garbled = tmp_path / "hangs" / "garbled" / "report.json"
    garbled.parent.mkdir()
    garbled.write_text("[1, 2]")  # valid JSON, not a report: skipped
    os.utime(garbled, (2.3e9, 2.3e9))
    assert main(failing) == 91


def test_find_model_takes_the_outermost_module_holding_the_optimizers_parameters() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    other = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    assert find_model([other, net], optimizer).model is net
    head_only = torch.optim.SGD(net[1].parameters(), lr=0.1)  # fine-tuning a part
    assert find_model([net], head_only).model is net
    both = torch.optim.SGD([*net.parameters(), *other.parameters()], lr=0.1)
    found = find_model([net, other], both)
    assert found.model is None and "several models" in found.reason
    assert find_model([], optimizer).model is None
    # the forward-forward example calls layer.forward(x) itself: only its ReLU is called
    direct = find_model([nn.ReLU()], optimizer).reason
    assert direct.endswith(
        "model.forward(x), PyTorch's forward-forward example) runs no module hook: call model(x)"
    )
    assert "call model(x)" in find_model([], optimizer).reason
    assert describe(optimizer, net) == "SGD over Sequential (9 parameters)"
    assert describe_module(torch.compile(net)) == "OptimizedModule(Sequential)"


def test_existing_guard_is_found_in_the_models_hooks(tmp_path: Path) -> None:
    import trainguard as tg

    net = nn.Sequential(nn.Linear(2, 2))
    assert existing_guard(net) is None
    guard = tg.Guard(net, torch.optim.SGD(net.parameters(), lr=0.1), run_dir=tmp_path)
    try:
        assert existing_guard(net) is not None
    finally:
        guard.close()


def test_batch_of() -> None:
    x = torch.zeros(1)
    assert batch_of((x,), {}) is x
    assert batch_of((x, 1), {}) == (x, 1)
    assert batch_of((), {"input_ids": x}) == {"args": (), "kwargs": {"input_ids": x}}


def _python(code: str, env: dict[str, str]) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_bootstrap_chains_an_existing_sitecustomize(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import builtins\nbuiltins.SITE_WAS_HERE = 1\n")
    env = child_env(RunOptions(), base={"PYTHONPATH": str(tmp_path), "PATH": os.environ["PATH"]})
    del env[ENV_VAR]  # without the options the bootstrap only chains
    assert _python("import builtins; print(builtins.SITE_WAS_HERE)", env) == "1"


HOOKS = (
    "import torch, torch.optim.optimizer as o, sys; "
    "print(len(o._global_optimizer_pre_hooks), 'trainguard.attach.hooks' in sys.modules)"
)


def test_bootstrap_installs_in_workers_not_in_torchruns_agent() -> None:
    base = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "PYTHONPATH")}
    env = child_env(RunOptions(launcher="torchrun"), base=base)
    assert _python(HOOKS, env) == "0 False"  # the agent: no LOCAL_RANK
    assert _python(HOOKS, {**env, "LOCAL_RANK": "0"}) == "1 True"  # a worker


def test_removing_the_prestart_hooks_leaves_no_global_hook_behind() -> None:
    """torch's handle for a ``with_kwargs`` global forward hook leaves its entry in
    ``_global_forward_hooks_with_kwargs`` (2.13): every module call in the process would
    keep the slow path with hooks after the guard attached (and torch.compile warned of
    global hooks at every step)."""
    from torch.nn.modules import module as module_hooks

    from trainguard.attach.prestart import PreStart

    assert not module_hooks._has_any_global_hook()
    prestart = PreStart()
    prestart.install()
    model = torch.nn.Linear(2, 1)
    model(torch.randn(3, 2)).sum().backward()
    assert prestart.candidates == [model]
    prestart.remove()
    assert not module_hooks._has_any_global_hook()


def test_an_optimizer_made_anew_is_followed_and_others_are_named() -> None:
    """A new optimizer over every guarded parameter and only the model's (made each epoch, or
    after unfreezing) is made anew (followed: ``replace.made_anew``); one over more than the
    model, or over part of it, is refused and named so."""
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    extra = nn.Linear(2, 2)
    guarded = torch.optim.SGD(net[1].parameters(), lr=0.1)  # the head, the backbone frozen
    unfrozen = torch.optim.SGD(net.parameters(), lr=0.1)
    assert made_anew(unfrozen, guarded, net)
    wider = torch.optim.SGD([*net.parameters(), *extra.parameters()], lr=0.1)
    assert not made_anew(wider, guarded, net)
    assert not made_anew(torch.optim.Adam(net[0].parameters()), guarded, net)
    anew = second_optimizer_reason(wider, guarded)
    assert anew.startswith("a new optimizer (SGD) over every guarded parameter and parameters")
    head = second_optimizer_reason(torch.optim.Adam(net[0].parameters()), unfrozen)
    assert head.startswith("a second optimizer (Adam) steps besides the guarded SGD")
    assert "put a trainguard.Guard per model and optimizer in the script" in head  # the fix
    # one model, two optimizers over its disjoint parts (Muon beside AdamW): its own fix
    body = torch.optim.SGD(net[0].parameters(), lr=0.1)
    muon = second_optimizer_reason(body, guarded, net)
    assert muon.startswith("a second optimizer (SGD) updates other parameters of the model")
    assert "guard = trainguard.Guard(model, sgd, extra_state={'sgd': sgd})" in muon
    assert "'One model, several optimizers'" in muon
    other = second_optimizer_reason(body, guarded, extra)  # not the model the guard has
    assert other.startswith("a second optimizer (SGD) steps besides the guarded SGD")


def test_run_options_make_the_attached_guards_config() -> None:
    """Every option of ``trainguard run`` but its launcher is the guard's own."""
    options = RunOptions(
        run_dir="r", on_nonfinite="warn", hang_timeout=5.0, capture=False, check_inputs=False,
        ignore_inputs=("[1]",), allow_masks=False, launcher="torchrun",
        options={"replica_check_every": 0, "spikes.warmup": 7, "history.steps": 9},
    )  # fmt: skip
    config = options.guard_config("abc", {"handover": "optimizer_replaced"})
    assert (config.run_dir, config.on_nonfinite, config.hang_timeout) == (Path("r"), "warn", 5.0)
    assert (config.capture, config.inputs.check, config.inputs.allow_masks) == (False,) * 3
    assert config.inputs.ignore == ("[1]",) and config.run == "abc"
    assert config.extra == {"handover": "optimizer_replaced"}
    assert config.health.replica_check_every == 0 and config.spikes.warmup == 7
    assert config.history.steps == 9
    assert options.guard_config().run is None and options.guard_config().extra == {}
    with pytest.raises(ConfigError, match=r"did you mean spikes\.warmup"):
        RunOptions(options={"spikes.warmpu": 7})  # refused before the command starts
