"""One model, two optimizers (Muon over its matrices beside AdamW over the rest, as nanochat
and modded-nanogpt train): ``Guard(model, adamw, extra_state={"muon": muon})`` checks every
gradient of the model, and a skipped step leaves both optimizers as the bare loop leaving
that step out does (docs/guard.md, "One model, several optimizers")."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tg_optimizers import Muon
from torch import nn

import trainguard as tg
from trainguard.testing import poison_grad

VOCAB = 40


def _run(run_dir: Path | None, nan_step: int = -1, left_out: int = -1) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, VOCAB)
    )
    named = list(model.named_parameters())
    matrices = [p for name, p in named if p.ndim == 2 and not name.startswith("0.")]
    rest = [p for name, p in named if not (p.ndim == 2 and not name.startswith("0."))]
    muon, adamw = Muon(matrices), torch.optim.AdamW(rest, lr=1e-2)
    guard = None
    if run_dir is not None:
        guard = tg.Guard(model, adamw, run_dir=run_dir, extra_state={"muon": muon})
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        x, y = torch.randint(0, VOCAB, (2, 8, 4), generator=gen)
        if step == left_out:
            continue
        loss = F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1))
        loss.backward()  # type: ignore[no-untyped-call]
        if step == nan_step:  # one of Muon's matrices alone: the loss and AdamW's are finite
            poison_grad(model, "1.weight")
        if guard is None or guard.check(loss):
            adamw.step()
            muon.step()
        adamw.zero_grad()
        muon.zero_grad()
    if guard is not None:
        guard.close()
    return [model.state_dict(), adamw.state_dict()["state"], muon.state_dict()["state"]]


def test_a_skip_leaves_both_optimizers_as_the_bare_loop_leaving_the_step_out(
    tmp_path: Path,
) -> None:
    bare = _run(None, left_out=3)
    guarded = _run(tmp_path / "run", nan_step=3)
    weights, adamw_state, muon_state = guarded
    assert bare[0].keys() == weights.keys()
    for name, value in bare[0].items():
        assert torch.equal(value, weights[name]), name
    for bare_state, state in ((bare[1], adamw_state), (bare[2], muon_state)):
        assert bare_state.keys() == state.keys() and bare_state
        for index, entries in bare_state.items():
            for key, value in entries.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(state[index][key]))
    events = tg.read_events(tmp_path / "run", 0)
    (bad,) = [e for e in events if e["kind"] == "nonfinite"]
    assert (bad["step"], bad["where"], bad["params"]) == (3, "grad", ["1.weight"])
    assert [e["step"] for e in events if e["kind"] == "skip"] == [3]


def test_a_rollback_restores_the_second_optimizer_given_as_extra_state(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1))
    muon = Muon([model[0].weight, model[2].weight])
    adamw = torch.optim.AdamW([model[0].bias, model[2].bias], lr=1e-2)
    config = tg.GuardConfig.from_options(
        {"run_dir": tmp_path, "hang_timeout": 0, "on_escalation": "rollback",
         "max_consecutive": 2, "recovery.snapshot_every": 2}
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(6, 4, generator=gen), torch.randn(6, 1, generator=gen)) for _ in range(12)]
    seen: dict[int, Any] = {}  # Muon's state at each step's start
    with tg.Guard(model, adamw, config=config, extra_state={"muon": muon}) as guard:
        for call, (x, y) in enumerate(guard.watch(data)):
            seen.setdefault(guard.state.step, copy.deepcopy(muon.state_dict()))
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            if call in (7, 8):  # Muon's matrix alone goes bad: two in a row escalate
                poison_grad(model, "0.weight")
            if guard.check(loss):
                adamw.step()
                muon.step()
            adamw.zero_grad()
            muon.zero_grad()
            if call == 8:
                (rollback,) = [e for e in tg.read_events(tmp_path, 0) if e["kind"] == "rollback"]
                restored = seen[rollback["restored_step"]]["state"]
                assert restored and restored.keys() == muon.state_dict()["state"].keys()
                for index, entries in restored.items():
                    buffer = muon.state_dict()["state"][index]["momentum_buffer"]
                    assert torch.equal(entries["momentum_buffer"], buffer)
