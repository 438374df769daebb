"""``trainguard run`` around a Hugging Face Trainer whose accelerator holds a GradScaler (fp16 on
a GPU; a CPU GradScaler put on it here). The Trainer scales the loss, clips, and steps through
the scaler; ``trainguard run`` checks inside the scaler's step. A NaN gradient: the step left
out, the scale backed off, the weights bit for bit the bare Trainer's (docs/transformers.md:
``TrainGuardCallback`` under the same scaler)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

SCRIPT = """
import hashlib, sys, tempfile
import torch
sys.path.insert(0, sys.argv[1])
import hf_trainer as ex
from transformers import Trainer, TrainingArguments

torch.manual_seed(0)
model = ex.tiny_gpt2()
backwards = {"n": 0}


def poison(grad):
    backwards["n"] += 1
    return grad * float("nan") if backwards["n"] == 3 else grad


model.transformer.ln_f.weight.register_hook(poison)
args = TrainingArguments(
    output_dir=tempfile.mkdtemp(), per_device_train_batch_size=1, max_steps=6,
    learning_rate=1e-3, save_strategy="no", report_to="none", use_cpu=True,
    disable_tqdm=True, seed=0, max_grad_norm=1.0,
)
trainer = Trainer(model=model, args=args, train_dataset=ex.Tokens(masked=None))
trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
trainer.train()
digest = hashlib.sha256()
for tensor in model.state_dict().values():
    digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
print("RESULT", trainer.accelerator.scaler.get_scale(), digest.hexdigest())
"""


def _result(out: subprocess.CompletedProcess[str]) -> list[str]:
    assert out.returncode == 0, out.stderr[-2000:]
    return [line for line in out.stdout.splitlines() if line.startswith("RESULT")]


@pytest.mark.timeout(160)
def test_a_trainer_with_a_grad_scaler_leaves_a_nan_step_out_as_bare(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(SCRIPT)
    python = [sys.executable, str(tmp_path / "script.py"), str(EXAMPLES)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRAINGUARD_RUN", None)
    bare = subprocess.run(python, capture_output=True, text=True, timeout=120, env=env)
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "trainguard", "run", "--run-dir", str(run_dir), "--"]
    guarded = subprocess.run(
        [*command, *python], capture_output=True, text=True, timeout=150, env=env
    )
    assert _result(guarded) == _result(bare)
    assert _result(bare)[0].startswith("RESULT 32768.0 ")  # the scaler's own back-off
    assert "step 2 non-finite grad on ranks [0]" in guarded.stderr
    assert "guarding AdamW over GPT2LMHeadModel" in guarded.stderr
