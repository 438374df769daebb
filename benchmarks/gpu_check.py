"""CUDA checks for the sync-free step; needs a GPU (none on the CI or development machines).

    python benchmarks/gpu_check.py [--steps 50] [--out gpu_check.json]

1. ``torch.cuda.set_sync_debug_mode("error")`` around ``guard.step()`` with a fused AdamW on
   good steps: any host sync on the hot path raises.
2. A bad step (NaN loss) under the same mode after warm-up: skipped on the device, reported
   one step later (that read happens outside the checked region).
3. Step time of bare fused AdamW vs ``guard.step()``, interleaved, medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import torch
from torch import nn

import trainguard as tg


def _model() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(2048, 2048), nn.GELU()]
    return nn.Sequential(*layers).cuda()


def _sync_free_check(steps: int, run_dir: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    guard = tg.Guard(model, opt, run_dir=run_dir, hang_timeout=0)
    data = [torch.randn(64, 2048, device="cuda") for _ in range(steps)]
    batches = guard.watch(data)
    errors = []
    for i in range(steps):
        batch = next(batches)
        loss = model(batch).pow(2).mean()
        if i == steps // 2:
            loss = loss * float("nan")
        loss.backward()
        guard._resolve_pending()  # last step's read: allowed to wait, outside the check
        torch.cuda.set_sync_debug_mode("error")
        try:
            guard.step(loss)
        except RuntimeError as exc:
            errors.append(f"step {i}: {exc}")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    guard.close()
    return {"sync_errors": errors, "skipped": list(guard.state.nonfinite_steps)}


def _timing(steps: int, run_dir: str) -> dict[str, float]:
    torch.manual_seed(0)
    bare_model, guarded_model = _model(), _model()
    guarded_model.load_state_dict(bare_model.state_dict())
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=1e-4, fused=True)
    opt = torch.optim.AdamW(guarded_model.parameters(), lr=1e-4, fused=True)
    guard = tg.Guard(guarded_model, opt, run_dir=run_dir, hang_timeout=0)
    batch = torch.randn(64, 2048, device="cuda")
    times: dict[str, list[float]] = {"bare": [], "guarded": []}
    for _ in range(steps):
        for mode in ("bare", "guarded"):
            torch.cuda.synchronize()
            start = time.perf_counter()
            if mode == "bare":
                bare_model(batch).pow(2).mean().backward()
                bare_opt.step()
                bare_opt.zero_grad()
            else:
                loss = guarded_model(batch).pow(2).mean()
                loss.backward()
                guard.step(loss)
            torch.cuda.synchronize()
            times[mode].append(time.perf_counter() - start)
    guard.close()
    bare, guarded = (statistics.median(times[m][5:]) for m in ("bare", "guarded"))
    return {"bare_ms": bare * 1e3, "guarded_ms": guarded * 1e3, "ratio": guarded / bare}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", default="gpu_check.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; run it on a machine with a GPU")
    with tempfile.TemporaryDirectory() as tmp:
        result = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "sync_free": _sync_free_check(args.steps, tmp + "/a"),
            "timing": _timing(args.steps, tmp + "/b"),
        }
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
