"""CUDA paths: the sync-free step, the single sync of check(), capture and replay on a GPU;
the buffer restore and input check of a skipped step, the sync-free step with every feature
on, a rollback to an in-memory snapshot, an fp16 overflow under autocast captured on one
device and replayed on the other, torch's flight recorder over NCCL (issue 28), and the
lazy RNG snapshot with CUDA's generators (issue 26).

Skipped where torch sees no GPU (CI and the development machines); run on a GPU machine with
``python -m pytest tests/unit/test_cuda.py``. ``torch.cuda.set_sync_debug_mode`` makes every
host-device synchronization that PyTorch knows of raise ("error") or warn ("warn").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tg_buffer_models as bufmodels
import tg_capture_models as models
import tg_replay_cases as cases
import torch
from tg_ops import OpRecorder
from torch import Tensor, nn

import trainguard as tg

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).cuda()


def _batches(n: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(16, 32, generator=gen).cuda() for _ in range(n)]


def _flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.fixture
def sync_debug() -> Iterator[None]:
    yield
    torch.cuda.set_sync_debug_mode("default")


def _syncs_in(fn: object) -> int:
    """How many synchronizations PyTorch reports while ``fn()`` runs."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()  # type: ignore[operator]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_fused_step_issues_no_sync_and_skips_a_bad_step_on_device(
    tmp_path: Path, sync_debug: None
) -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0)
    moved = []
    for i, batch in enumerate(guard.watch(_batches(8))):
        loss = model(batch).pow(2).mean()
        if i == 4:
            loss = loss * float("nan")
        loss.backward()
        guard._resolve_pending()  # the previous step's read happens here, outside the check
        before = _flat(model).clone()
        torch.cuda.set_sync_debug_mode("error")  # any sync inside step() raises
        guard.step(loss)
        torch.cuda.set_sync_debug_mode("default")
        moved.append(not torch.equal(before, _flat(model)))
    guard.close()
    assert moved == [True] * 4 + [False] + [True] * 3
    assert list(guard.state.nonfinite_steps) == [4]
    assert {float(s["step"]) for s in opt.state.values()} == {7.0}
    assert torch.isfinite(_flat(model)).all()


def test_fused_step_reading_the_previous_step_reports_no_sync(tmp_path: Path) -> None:
    """The whole call, the late read of the step before included: that read waits on a CUDA
    event recorded a step earlier, which PyTorch does not count as a synchronization."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0)
    counts = []
    for batch in guard.watch(_batches(6)):
        loss = model(batch).pow(2).mean()
        loss.backward()
        counts.append(_syncs_in(lambda loss=loss: guard.step(loss)))
    guard.close()
    assert counts == [0] * 6


def test_check_synchronizes_once_per_step(tmp_path: Path) -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0)
    counts = []
    for batch in guard.watch(_batches(4)):
        loss = model(batch).pow(2).mean()
        loss.backward()
        counts.append(_syncs_in(lambda loss=loss: guard.check(loss)))
        opt.step()
        opt.zero_grad()
    guard.close()
    assert counts == [1] * 4  # the read of the agreed flags, nothing per parameter


def test_check_folds_its_row_on_cuda(tmp_path: Path) -> None:
    """A world of one: the inputs' norms ride the gradients' one fused launch, one stack, one
    read; a NaN input skips, a huge finite one (its float32 norm overflows) does not."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0)
    gen = torch.Generator().manual_seed(3)
    data = [
        (torch.randn(16, 32, generator=gen), torch.randn(16, 4, generator=gen)) for _ in range(4)
    ]
    data[2][1][5, 1], data[3][1][0, 0] = float("nan"), 1e20
    results, syncs, ops = [], [], []
    for x, _aux in guard.watch([(x.cuda(), aux.cuda()) for x, aux in data]):
        loss = model(x).pow(2).mean()
        loss.backward()
        with OpRecorder() as rec:
            syncs.append(_syncs_in(lambda loss=loss: results.append(guard.check(loss))))
        ops.append([(name, sizes) for name, sizes in rec.ops])
        opt.step()
        opt.zero_grad()
    guard.close()
    assert results == [True, True, False, True]
    assert syncs[0] == syncs[1] == 1
    names = [name for name, _ in ops[0]]
    assert names.count("_foreach_norm") == 1 and names.count("stack") == 1, names
    assert "linalg_vector_norm" not in names and "amax" not in names, names
    [(_, sizes)] = [op for op in ops[0] if op[0] == "_foreach_norm"]
    assert len(sizes) == 4 + 2  # the 4 gradients and the 2 input tensors


def test_grad_clip_on_cuda_matches_clip_grad_norm(tmp_path: Path) -> None:
    bare, guarded = _mlp(), _mlp()
    bare_opt = torch.optim.SGD(bare.parameters(), lr=0.1)
    opt = torch.optim.SGD(guarded.parameters(), lr=0.1)
    guard = tg.Guard(guarded, opt, run_dir=tmp_path, hang_timeout=0, grad_clip=0.05)
    for batch in guard.watch(_batches(4)):
        bare(batch).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(bare.parameters(), 0.05)
        bare_opt.step()
        bare_opt.zero_grad()
        loss = guarded(batch).pow(2).mean()
        loss.backward()
        guard.step(loss)
    guard.close()
    torch.testing.assert_close(_flat(guarded), _flat(bare), rtol=1e-5, atol=1e-6)


def test_amp_overflow_on_cuda_is_left_to_the_scaler(tmp_path: Path) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16)
    guard = tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0, scaler=scaler)
    results = []
    for i, batch in enumerate(guard.watch(_batches(4))):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(batch).float().pow(2).mean()
        scaled = scaler.scale(loss)
        if i == 1:
            scaled = scaled * 1e38  # fp32 overflow in the gradients; the loss is finite
        scaled.backward()
        ok = guard.check(loss)
        results.append(ok)
        if ok:
            scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    guard.close()
    assert results == [True, False, True, True]
    assert guard.state.overflow_steps == 1 and guard.state.total_nonfinite == 0
    assert scaler.get_scale() == 2.0**15


def test_capture_on_cuda_replays_on_cuda(tmp_path: Path) -> None:
    model = models.make_model("forward").cuda()
    data = [{k: v.cuda() for k, v in b.items()} for b in models.batches("forward", 3, bad_step=1)]
    models.train(model, models.ce_loss, data, tmp_path)
    (bundle,) = sorted((tmp_path / "captures").glob("step-*"))
    env = tg.load_bundle(bundle).meta(0)["env"]
    assert env["device"] == "cuda:0" and env["cuda_device"] == torch.cuda.get_device_name()
    report = tg.replay(bundle, models.forward_factory, device="cuda").to_dict()
    assert report["verdict"] == "numerical"
    assert report["reproduced"] is True
    assert "encoder.layers.0.norm" in report["summary"]


# -- issue 28: the CUDA paths written and tested on the CPU first -----------------------------


def _cuda_batches(data: list[Any]) -> list[Any]:
    return [tuple(t.cuda() for t in batch) for batch in data]


def _events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (run_dir / "events" / "rank-0.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


@pytest.mark.parametrize("fused", [False, True])
def test_skip_on_cuda_puts_the_buffers_back(tmp_path: Path, fused: bool) -> None:
    """A NaN input on the GPU (the input check, on the device) skips its step, and the
    BatchNorm / EMA buffers its forward wrote are put back (on the device from the agreed
    flag with the fused step): bit-identical to a run that never saw the batch."""
    bad, steps = 3, 8

    def make(model: nn.Module) -> torch.optim.Optimizer:
        if fused:
            return torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    torch.manual_seed(0)
    ref = bufmodels.BufferNet().cuda()
    ref_opt = make(ref)
    data = _cuda_batches(bufmodels.batches(steps, bad=bad))
    bufmodels.train_bare(ref, ref_opt, [b for i, b in enumerate(data) if i != bad])
    torch.manual_seed(0)
    model = bufmodels.BufferNet().cuda()
    opt = make(model)
    with tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0, capture=False) as guard:
        bufmodels.train_guarded(guard, model, opt, data, fused)
    assert list(guard.state.nonfinite_steps) == [bad]
    bufmodels.assert_identical(bufmodels.state_of(model), bufmodels.state_of(ref))
    [event] = _events(tmp_path, "bad_input")  # found on the device, read on the host
    assert event["step"] == bad and event["tensors"][0]["positions"] == [3]


def test_sync_free_step_with_every_feature_reports_no_sync(tmp_path: Path) -> None:
    """Fetch (input check), forward (step-start hook, buffer copy), backward and the fused
    ``guard.step()`` with every per-step feature on: the device spike rule (``"skip"``),
    clipping, the input check, buffer restore, straggler timing, capture, replica checks."""
    torch.manual_seed(0)
    model = bufmodels.BufferNet().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    config = tg.GuardConfig(
        run_dir=tmp_path,
        hang_timeout=0,
        on_spike="skip",
        grad_clip=1.0,
        spikes=tg.SpikeConfig(warmup=2),
    )
    guard = tg.Guard(model, opt, config=config)
    assert guard._deferred
    batches = iter(guard.watch(_cuda_batches(bufmodels.batches(10))))
    counts = []
    while True:
        box: list[Any] = []
        fetched = _syncs_in(lambda box=box: box.append(next(batches, None)))
        if box[0] is None:
            break

        def train(batch: Any = box[0]) -> None:
            loss = bufmodels.loss_fn(model, batch)
            loss.backward()
            guard.step(loss)

        counts.append(fetched + _syncs_in(train))
    guard.close()
    assert len(counts) == 10 and guard.state.total_nonfinite == 0
    assert counts[1:] == [0] * 9, counts  # step 0 learns which buffers the forward writes


def test_rollback_on_cuda_restores_the_snapshot(tmp_path: Path) -> None:
    """Two NaN steps escalate; the guard rolls back to its CPU snapshot of a CUDA model and
    its optimizer: the weights are those the restored step started from, still on the GPU."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    config = tg.GuardConfig(
        run_dir=tmp_path,
        hang_timeout=0,
        on_escalation="rollback",
        max_consecutive=2,
        capture=False,
        recovery=tg.RecoveryConfig(snapshot_every=2, good_after=1),
    )
    data = _batches(12)
    data[5] = data[5] * float("nan")
    data[6] = data[6] * float("nan")
    at_start: dict[int, Tensor] = {}
    restored: list[tuple[int, int]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tg.Guard(model, opt, config=config) as guard:
            for batch in guard.watch(data):
                step = guard.state.step
                at_start[step] = _flat(model).clone()
                loss = model(batch).pow(2).mean()
                loss.backward()
                guard.step(loss)
                if guard.state.step <= step:  # rolled back
                    restored.append((step, guard.state.step))
                    torch.testing.assert_close(_flat(model), at_start[guard.state.step])
    [event] = _events(tmp_path, "rollback")
    assert restored == [(event["step"], event["restored_step"])] and event["source"] == "memory"
    assert torch.isfinite(_flat(model)).all()
    assert all(p.device.type == "cuda" for p in model.parameters())
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)]
    assert states and all(v.device.type == "cuda" for v in states)


def test_snapshot_of_a_cuda_model_is_taken_without_a_host_sync(sync_debug: None) -> None:
    """Pinned non-blocking copies: no sync while taking it; the next update does not leak in;
    a restore waits for the copies and puts back the weights and the optimizer state."""
    from trainguard.recovery import snapshot as snap

    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    objects = snap.TrainingObjects(model, opt)
    for batch in _batches(2):
        model(batch).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    before = _flat(model).clone()
    moments = [s["exp_avg"].clone() for s in opt.state.values()]
    torch.cuda.set_sync_debug_mode("error")  # any sync while taking it raises
    taken = snap.take(objects, step=2, position=2, stream_id=0, guard={}, extra={})
    torch.cuda.set_sync_debug_mode("default")
    assert taken.copies and all(t.is_pinned() for t in taken.state["model"].values())
    for batch in _batches(3):  # updates queued right behind the copies
        model(batch).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert not torch.equal(_flat(model), before)
    snap.restore(objects, taken)
    assert torch.equal(_flat(model), before) and taken.copies == []
    for state, moment in zip(opt.state.values(), moments, strict=True):
        assert state["exp_avg"].is_cuda and torch.equal(state["exp_avg"], moment)


FP16_CUDA = {"enabled": True, "device_type": "cuda", "dtype": "float16"}


def _fp16_overflow_on_cuda(run_dir: Path) -> Path:
    """``tg_replay_cases.train_under_autocast`` on the GPU: CUDA autocast float16."""
    model = cases.Overflow().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [{k: v.cuda() for k, v in b.items()} for b in cases.overflow_batches()]
    with tg.Guard(model, opt, run_dir=run_dir, hang_timeout=0) as guard:
        for batch in guard.watch(data):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = cases.ce(model, batch)
            loss.backward()
            if guard.check(loss):
                opt.step()
            opt.zero_grad()
    assert list(guard.state.nonfinite_steps) == [1]
    (bundle,) = sorted((run_dir / "captures").glob("step-*"))
    return bundle


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fp16_overflow_captured_on_cuda_replays_on(tmp_path: Path, device: str) -> None:
    bundle = _fp16_overflow_on_cuda(tmp_path)
    meta = tg.load_bundle(bundle).meta(0)
    assert meta["autocast"] == FP16_CUDA and meta["env"]["device"] == "cuda:0"
    r = tg.replay(bundle, cases.overflow_factory, device=device, repeats=1).to_dict()
    assert (r["reproduced"], r["verdict"], r["phase"]) == (True, "overflow_fp16", "forward")
    assert r["module"] == "lin" and r["float32_reproduced"] is False
    used = r["autocast"]
    assert (used["device_type"], used["dtype"], used["source"]) == (device, "float16", "bundle")
    if device == "cpu":
        assert "recorded cuda autocast float16, run as cpu autocast here" in used["text"]
    else:
        assert used["text"] == "float16 on cuda (as recorded)"


def test_fp16_overflow_captured_on_the_cpu_replays_on_cuda(tmp_path: Path) -> None:
    bundle = cases.train_under_autocast(tmp_path)  # CPU autocast float16
    assert tg.load_bundle(bundle).meta(0)["autocast"] == cases.FP16_CPU
    r = tg.replay(bundle, cases.overflow_factory, device="cuda", repeats=1).to_dict()
    assert (r["reproduced"], r["verdict"], r["phase"]) == (True, "overflow_fp16", "forward")
    assert r["module"] == "lin" and r["float32_reproduced"] is False
    assert (r["autocast"]["device_type"], r["autocast"]["dtype"]) == ("cuda", "float16")
    assert "recorded cpu autocast float16, run as cuda autocast here" in r["autocast"]["text"]


_RECORDER_SCRIPT = """
import json, pickle, sys, time
import torch
import torch.distributed as dist
from trainguard.hang import flight_recorder as fr
from trainguard.hang.watchdog_start import group_name

store = dist.FileStore(sys.argv[1], 1)
dist.init_process_group("nccl", store=store, rank=0, world_size=1)
x = torch.ones(4, device="cuda")
for _ in range(3):
    dist.all_reduce(x)
torch.cuda.synchronize()
name = group_name(None)
status = fr.pg_status(name)
deadline = time.monotonic() + 10
while (status is None or status[0] < 1 or status[0] != status[1]) and time.monotonic() < deadline:
    time.sleep(0.1)
    status = fr.pg_status(name)
calls = fr.read_calls(name)
out = {"name": name, "status": status, "setting": fr.setting(), "calls": None, "raw": {}}
if calls is not None:
    out["calls"] = [[c.seq, c.op, c.sizes, c.done] for c in calls]
from torch._C import _distributed_c10d as c10d
for fn in ("_dump_fr_trace", "_dump_nccl_trace"):  # what each recorder holds, for a failure
    dump = getattr(c10d, fn, None)
    if dump is not None:
        data = pickle.loads(dump(includeStackTraces=False))
        out["raw"][fn] = [len(data.get("entries", [])), data.get("pg_status")]
print("RESULT " + json.dumps(out, default=str), flush=True)
dist.destroy_process_group()
"""


def _recorder_run(tmp_path: Path, **env_vars: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if "BUFFER_SIZE" not in k} | env_vars
    src = str(Path(tg.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    store = tmp_path / f"store-{len(env_vars)}"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_RECORDER_SCRIPT), str(store)],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    out: dict[str, Any] = json.loads(lines[0].removeprefix("RESULT "))
    return out


def test_flight_recorder_reads_nccl_collectives(tmp_path: Path) -> None:
    """torch's flight recorder over NCCL (one rank on this GPU), sized by the variable
    trainguard's launcher sets: the hang path's reader (``hang/flight_recorder.py``) sees the
    group's all-reduces and their completion."""
    out = _recorder_run(tmp_path, TORCH_FR_BUFFER_SIZE="2000")
    if out["calls"] is None:  # say whether the older variable alone would have done it
        old = _recorder_run(
            tmp_path, TORCH_FR_BUFFER_SIZE="2000", TORCH_NCCL_TRACE_BUFFER_SIZE="2000"
        )
        out["with TORCH_NCCL_TRACE_BUFFER_SIZE too"] = old
    assert out["setting"] == "on" and out["calls"] is not None, out
    seqs = [c[0] for c in out["calls"]]
    assert len(seqs) == 3 and seqs == list(range(seqs[0], seqs[0] + 3)), out
    assert out["status"] == [seqs[-1], seqs[-1]], out  # enqueued and completed
    assert all(c[1] == "all_reduce" and c[2] == [[4]] and c[3] for c in out["calls"]), out


def test_rng_snapshot_is_reused_until_a_cuda_generator_moves() -> None:
    """CUDA initialized: a step that draws nothing gets the last snapshot again; a dropout on
    the device gives a new one, and restoring the earlier one replays that dropout exactly."""
    from trainguard.capture.rng import RngSnapshot, set_rng_state

    torch.cuda.init()
    torch.cuda.manual_seed_all(3)
    first = RngSnapshot.take()
    assert "cuda" in first.state()
    assert _syncs_in(RngSnapshot.take) == 0
    assert RngSnapshot.take() is first
    ones = torch.ones(4096, device="cuda")
    dropped = nn.functional.dropout(ones, 0.5)
    moved = RngSnapshot.take()
    assert moved is not first
    now = torch.cuda.get_rng_state_all()
    assert all(torch.equal(a, b) for a, b in zip(moved.state()["cuda"], now, strict=True))
    set_rng_state(first.state())
    assert torch.equal(nn.functional.dropout(ones, 0.5), dropped)
    torch.cuda.manual_seed_all(4)
    assert RngSnapshot.take() is not moved
