"""``trainguard run`` attaches however the program reaches torch (issue 53).

``import transformers`` / ``import datasets`` look torch up with
``importlib.util.find_spec("torch")`` before importing it; the bootstrap's import hook took
itself out at that first look-up and patched only the spec it returned, so the real import
never installed the hooks and the script ran unguarded, saying nothing until its end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

PROBE = "import torch.optim.optimizer as oo\nprint('HOOKS', len(oo._global_optimizer_pre_hooks))\n"
WAYS = {
    "import": "import torch\n",
    "find_spec_first": "import importlib.util\nimportlib.util.find_spec('torch')\nimport torch\n",
    "find_spec_twice": (
        "import importlib.util\n"
        "importlib.util.find_spec('torch')\n"
        "importlib.util.find_spec('torch')\n"
        "import importlib\nimportlib.import_module('torch')\n"
    ),
    "import_module": "import importlib\nimportlib.import_module('torch.nn')\n",
    "spec_loaded_by_hand": (
        "import importlib.util, sys\n"
        "spec = importlib.util.find_spec('torch')\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules['torch'] = module\n"
        "spec.loader.exec_module(module)\n"
    ),
}


def _trainguard_run(tmp_path: Path, script: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "script.py"
    path.write_text(script)
    command = [sys.executable, "-m", "trainguard", "run", "--run-dir", str(tmp_path / "run")]
    return subprocess.run(
        [*command, "--", sys.executable, str(path)],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=tmp_path,
    )


@pytest.mark.timeout(160)
@pytest.mark.parametrize("way", sorted(WAYS))
def test_the_hooks_are_installed_however_torch_is_reached(tmp_path: Path, way: str) -> None:
    done = _trainguard_run(tmp_path, WAYS[way] + PROBE)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "HOOKS 1" in done.stdout, (way, done.stdout, done.stderr[-2000:])


TRANSFORMERS_FIRST = """
import transformers  # looks torch up (find_spec) before it imports it
import torch

from trainguard.cli import main
from torch import nn

torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x = torch.randn(8, 4)
    if step == 1:
        x[0, 0] = float("nan")
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print("FINITE", bool(torch.isfinite(model.weight).all()))
"""


@pytest.mark.timeout(160)
def test_a_script_reaching_torch_through_transformers_is_guarded_from_its_first_step(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    done = _trainguard_run(tmp_path, TRANSFORMERS_FIRST)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "trainguard run: rank 0: guarding" in done.stderr  # said at the first step
    assert "FINITE True" in done.stdout  # the NaN step was skipped
    lines = (tmp_path / "run" / "events" / "rank-0.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    assert [e["step"] for e in events if e["kind"] == "start"] == [0]
    assert [e["step"] for e in events if e["kind"] == "skip"] == [1]


MANUAL_SGD = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
for step in range(6):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    model.zero_grad()
    loss.backward()
    for p in model.parameters():  # word-language-model's update, without an optimizer
        p.data.add_(p.grad, alpha=-0.1)
    print("STEP", step, flush=True)
"""


@pytest.mark.timeout(160)
def test_a_script_updating_its_parameters_by_hand_is_told_it_is_unguarded(
    tmp_path: Path,
) -> None:
    """No torch.optim optimizer: said at the second training forward (not at the end), one
    line naming the cause and the fix; the command's last line repeats the reason."""
    done = _trainguard_run(tmp_path, MANUAL_SGD)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    (told,) = [line for line in lines if "not guarding" in line]
    assert told.startswith("trainguard run: rank 0: not guarding: the script updates the ")
    assert "by hand" in told and "torch.optim.SGD(model.parameters(), lr=LR)" in told
    assert "python -I" not in done.stderr
    assert lines[-1].startswith("trainguard run: the run was not guarded: the script updates")
    assert done.stdout.count("STEP") == 6  # the script ran as it does bare


LBFGS = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
x = torch.randn(64, 4)
y = x.sum(-1, keepdim=True).sin()
optimizer = torch.optim.LBFGS(model.parameters(), lr=0.8)  # time-sequence-prediction's
for _ in range(3):
    def closure():
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss
    optimizer.step(closure)
import hashlib
digest = hashlib.sha256()
for p in model.parameters():
    digest.update(p.detach().numpy().tobytes())
print("WEIGHTS", digest.hexdigest())  # bit for bit
"""


@pytest.mark.timeout(160)
def test_an_lbfgs_closure_loop_is_told_in_one_line_with_the_fix_and_runs_as_bare(
    tmp_path: Path,
) -> None:
    """LBFGS evaluates its closure several times a step: no step boundary to check at. The
    guard stands aside at its first step, in one line naming the reason and how to guard
    such a loop by hand; the script trains as without ``trainguard run``."""
    done = _trainguard_run(tmp_path, LBFGS)
    assert done.returncode == 0, done.stderr[-2000:]
    (told,) = [line for line in done.stderr.splitlines() if "not guarding" in line]
    assert told.startswith("trainguard run: rank 0: not guarding: LBFGS evaluates its closure")
    assert "loss = closure(); if guard.check(loss): optimizer.step(closure)" in told
    bare = subprocess.run(
        [sys.executable, str(tmp_path / "script.py")], capture_output=True, text=True, timeout=100
    )
    weights = [line for line in done.stdout.splitlines() if line.startswith("WEIGHTS")]
    assert weights == [line for line in bare.stdout.splitlines() if line.startswith("WEIGHTS")]
    assert len(weights) == 1


DCP_RESUME = """
import hashlib, json, os, sys
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
if sys.argv[1] == "make":
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "opt": get_optimizer_state_dict(model, opt)}, "s.pt")
    raise SystemExit(0)
saved = torch.load("s.pt")
model.load_state_dict(saved["model"])
set_optimizer_state_dict(model, opt, saved["opt"])  # steps opt once, at lr 0: it has no state
for step in range(6):
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    if step == int(sys.argv[2]):
        x[3, 0] = float("nan")
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
digest = hashlib.sha256()
for tensor in [*model.state_dict().values(), *opt.state_dict()["state"][0].values()]:
    digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
print("WEIGHTS", digest.hexdigest())
"""


@pytest.mark.timeout(160)
def test_a_resume_through_torch_distributed_checkpoint_is_guarded_from_its_first_step(
    tmp_path: Path,
) -> None:
    """``set_optimizer_state_dict`` on an optimizer without state steps it once, at lr 0 on
    zero gradients, before the script's first forward (PyTorch's FSDP2 example resumes so).
    That step updates nothing and is no training step: the guard waits for the first one
    (it once stood aside there, "cannot find the model"), guards the run and skips its NaN
    step; without a fault the weights and moments are the bare script's, bit for bit."""

    def python(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(tmp_path / "script.py"), *args],
            capture_output=True,
            text=True,
            timeout=100,
            cwd=tmp_path,
        )

    (tmp_path / "script.py").write_text(DCP_RESUME)
    assert python("make").returncode == 0
    bare = python("train", "-1")
    assert bare.returncode == 0, bare.stderr[-2000:]
    command = [sys.executable, "-m", "trainguard", "run", "--run-dir"]
    for run, nan_step in (("clean", "-1"), ("nan", "2")):
        done = subprocess.run(
            [*command, str(tmp_path / run), "--", sys.executable, "script.py", "train", nan_step],
            capture_output=True,
            text=True,
            timeout=150,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "trainguard run: rank 0: guarding Adam over Sequential" in done.stderr
        assert "not guarding" not in done.stderr, done.stderr[-2000:]
        if run == "clean":
            assert [line for line in done.stdout.splitlines() if line.startswith("WEIGHTS")] == [
                line for line in bare.stdout.splitlines() if line.startswith("WEIGHTS")
            ]
        else:
            events = [
                json.loads(line)
                for line in (tmp_path / run / "events" / "rank-0.jsonl").read_text().splitlines()
            ]
            # the loaded state holds one update: the guard counts on from it (resumed.py)
            assert [(e["kind"], e["step"]) for e in events if e["kind"] == "skip"] == [("skip", 3)]


CARRIED = """
import hashlib, sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.AdamW(model.parameters(), lr=0.05)
nan_step, left_out = int(sys.argv[1]), int(sys.argv[2])
for step in range(8):
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    if step == left_out:  # what a skip leaves: no update, no gradients carried on
        for p in model.parameters():
            p.grad = None
        continue
    if step == nan_step:
        x[3, 0] = float("nan")
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()  # and never zero_grad: the gradients pile up over the steps
digest = hashlib.sha256()
for tensor in [*model.state_dict().values(), *opt.state_dict()["state"][0].values()]:
    digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
print("WEIGHTS", digest.hexdigest())
"""


@pytest.mark.timeout(160)
def test_a_loop_that_never_zeroes_its_gradients_goes_on_after_a_skip(tmp_path: Path) -> None:
    """PyTorch's tensor-parallel example never calls zero_grad: its gradients pile up over
    the steps. A skipped step's gradients, given back after the optimizer's step, stayed on
    the parameters, so every later step was non-finite and the guard escalated 5 steps on.
    Now the next training forward clears the given-back gradients the loop left as they were
    (with one warning): the steps after the skip are applied, and the weights equal the bare
    loop's that leaves the step out and carries no gradient past it."""
    guarded = CARRIED.replace("sys.argv[1]", "'2'").replace("sys.argv[2]", "'-1'")
    done = _trainguard_run(tmp_path, guarded)  # a NaN at step 2
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step 2 began with" not in done.stderr  # said at the step after the skip
    assert "step 3 began with the skipped step's gradients still on the parameters" in (done.stderr)
    events = _rank_0_events(tmp_path / "run")
    assert [e["step"] for e in events if e["kind"] == "skip"] == [2]
    assert not [e for e in events if e["kind"] == "escalate"]
    _assert_weights_of_bare_leaving_out_step_2(tmp_path, CARRIED, done)


def _rank_0_events(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "events" / "rank-0.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _assert_weights_of_bare_leaving_out_step_2(
    tmp_path: Path, script: str, done: subprocess.CompletedProcess[str]
) -> None:
    """The guarded run's final weights are the bare ``script``'s that leaves step 2 out."""
    expected = tmp_path / "expected.py"
    expected.write_text(script)
    left_out = subprocess.run(
        [sys.executable, str(expected), "-1", "2"], capture_output=True, text=True, timeout=100
    )
    weights = [line for line in done.stdout.splitlines() if line.startswith("WEIGHTS")]
    assert len(weights) == 1
    assert weights == [line for line in left_out.stdout.splitlines() if line.startswith("WEIGHTS")]


ZEROED_AFTER_FORWARD = CARRIED.replace(
    """    nn.functional.mse_loss(model(x), y).backward()
    opt.step()  # and never zero_grad: the gradients pile up over the steps""",
    """    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()  # after the forward, before the backward: PyTorch's ImageNet example
    loss.backward()
    opt.step()""",
)


@pytest.mark.timeout(160)
def test_a_loop_that_zeroes_after_its_forward_is_not_told_it_carries_gradients(
    tmp_path: Path,
) -> None:
    """PyTorch's ImageNet example runs the forward, then ``zero_grad``, backward and step:
    at the forward after a skip, the given-back gradients are still on the parameters (the
    guard clears them there, as for a loop that carries them), but the loop clears them
    itself before its backward, so no warning says it carries gradients. The weights equal
    the bare loop's that leaves the step out."""
    assert ZEROED_AFTER_FORWARD != CARRIED
    guarded = ZEROED_AFTER_FORWARD.replace("sys.argv[1]", "'2'").replace("sys.argv[2]", "'-1'")
    done = _trainguard_run(tmp_path, guarded)  # a NaN at step 2
    assert done.returncode == 0, done.stderr[-2000:]
    assert "skipped step's gradients still on the parameters" not in done.stderr
    events = _rank_0_events(tmp_path / "run")
    assert [e["step"] for e in events if e["kind"] == "skip"] == [2]
    _assert_weights_of_bare_leaving_out_step_2(tmp_path, ZEROED_AFTER_FORWARD, done)


PRINT_WEIGHTS = """
digest = hashlib.sha256()
for tensor in model.state_dict().values():
    digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
print("WEIGHTS", digest.hexdigest())
"""
"""A script's last lines: the digest of its model's weights."""

COMPILED = (
    """
import hashlib
import torch
from torch import nn

torch.manual_seed(0)
model = torch.compile(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), backend="eager")
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
for step in range(4):
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
"""
    + PRINT_WEIGHTS
)


@pytest.mark.timeout(160)
def test_a_compiled_model_under_warnings_as_errors_trains_as_bare(tmp_path: Path) -> None:
    """torch warns at each call of a compiled module while a process-wide module hook is in;
    until the first optimizer step those hooks are ours (attach/compile_warning.py). A script
    run with warnings as errors (``-W error``, as test suites and CI do) ended with that
    UserWarning under ``trainguard run``; bare it runs. Now it runs as bare, warning-free."""
    (tmp_path / "script.py").write_text(COMPILED)
    python = [sys.executable, "-W", "error::UserWarning", str(tmp_path / "script.py")]
    bare = subprocess.run(python, capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert bare.returncode == 0, bare.stderr[-2000:]
    command = [sys.executable, "-m", "trainguard", "run", "--run-dir", str(tmp_path / "run")]
    done = subprocess.run(
        [*command, "--", *python], capture_output=True, text=True, timeout=150, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "guarding AdamW over OptimizedModule(Sequential)" in done.stderr
    assert "global hooks" not in done.stderr
    weights = [line for line in done.stdout.splitlines() if line.startswith("WEIGHTS")]
    assert weights == [line for line in bare.stdout.splitlines() if line.startswith("WEIGHTS")]
    assert len(weights) == 1


COMPILED_STEP = (
    """
import hashlib, os, sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))


@torch.compile(backend="eager")
def opt_step():
    opt.step()


nan_at, left_out = int(os.environ.get("NAN_AT", "-1")), int(os.environ.get("LEAVE_OUT", "-1"))
gen = torch.Generator().manual_seed(1)
for step in range(12):
    x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
    loss = nn.functional.mse_loss(model(x), y)
    if step == nan_at:
        loss = loss * float("nan")
    loss.backward()
    if step != left_out:
        opt_step()
    opt.zero_grad()
"""
    + PRINT_WEIGHTS
)


@pytest.mark.timeout(160)
def test_a_compiled_optimizer_step_runs_the_guard_eagerly(tmp_path: Path) -> None:
    """``torch.compile`` around ``optimizer.step()`` (PyTorch's compiled-optimizer recipe):
    dynamo traced the process-wide optimizer hooks, so the guard's whole step path was
    compiled anew at every step until dynamo's recompile limit (its warnings on stderr, 32 s
    instead of 3 s for 30 steps of a tiny MLP). Now the hooks run eagerly (a graph break):
    no frame of the guard's is compiled, the NaN step is left out as the bare script that
    leaves it out itself, under warnings as errors."""
    (tmp_path / "script.py").write_text(COMPILED_STEP)
    python = [sys.executable, "-W", "error::UserWarning", str(tmp_path / "script.py")]
    env = {**os.environ, "LEAVE_OUT": "8", "TORCH_LOGS": "recompiles"}
    bare = subprocess.run(python, capture_output=True, text=True, timeout=100, env=env)
    assert bare.returncode == 0, bare.stderr[-2000:]
    command = [sys.executable, "-m", "trainguard", "run", "--run-dir", str(tmp_path / "run")]
    env = {**os.environ, "NAN_AT": "8", "TORCH_LOGS": "recompiles"}
    done = subprocess.run(
        [*command, "--", *python], capture_output=True, text=True, timeout=150, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step 8 non-finite" in done.stderr
    compiled = [line for line in done.stderr.splitlines() if "Recompiling function" in line]
    assert not [line for line in compiled if "trainguard/step" in line], compiled
    weights = [line for line in done.stdout.splitlines() if line.startswith("WEIGHTS")]
    assert weights == [line for line in bare.stdout.splitlines() if line.startswith("WEIGHTS")]
    assert len(weights) == 1
