"""Replay runs the step as it ran: its autocast, its masks, its replicas, its factory file.

- a float16 overflow under a loop-level ``torch.autocast("cpu", dtype=torch.float16)`` is
  replayed under that autocast (recorded by the guard in meta.json) and called
  ``overflow_fp16``, naming the Linear; in float32 the same step is finite;
- a row that a mask covers entirely names the reduction over it and the row's sample, not
  the ``masked_fill`` that wrote the -inf;
- the ranks' replicated weights are compared (the 2-rank runs are in
  tests/distributed/test_replay_origin_dist.py; here the rule on stand-in bundles);
- ``--factory path/to/file.py:func`` imports the file's sibling modules.
"""

from __future__ import annotations

import json
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import tg_replay_cases as cases
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import trainguard as tg
from trainguard.cli import EXIT_FINDING, EXIT_OK, main
from trainguard.replay.replicas import check_replicas
from trainguard.replay.runner import resolve_factory
from trainguard.replay.verdicts import ADVICE

pytestmark = pytest.mark.timeout(60)

FACTORY = "tg_replay_cases:overflow_factory"


@pytest.fixture(scope="module")
def fp16_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cases.train_under_autocast(tmp_path_factory.mktemp("fp16"))


def _copy(bundle: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(bundle, tmp_path / bundle.name))


# -- autocast ----------------------------------------------------------------------------------


def test_fp16_overflow_under_loop_autocast_is_overflow_fp16_naming_the_linear(
    fp16_bundle: Path,
) -> None:
    assert tg.load_bundle(fp16_bundle).meta(0)["autocast"] == cases.FP16_CPU  # the guard's
    r = tg.replay(fp16_bundle, cases.overflow_factory).to_dict()
    assert (r["reproduced"], r["verdict"], r["phase"]) == (True, "overflow_fp16", "forward")
    assert r["op"] in ("aten.addmm", "aten.mm", "aten.linear") and r["module"] == "lin"
    assert r["culprit_samples"] == [{"micro_batch": 0, "position": 5, "index": 1013}]
    assert r["float32_reproduced"] is False and r["advice"] == ADVICE["overflow_fp16"]
    assert r["autocast"]["enabled"] and r["autocast"]["source"] == "bundle"
    assert r["summary"].startswith(
        f"The step is non-finite under float16 autocast and finite in float32: {r['op']} in lin"
    )
    text = str(tg.replay(fp16_bundle, cases.overflow_factory, repeats=1, bisect=False))
    assert "autocast       float16 on cpu (as recorded)" in text
    assert "in float32 (autocast off) the step is finite" in text


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_half_dtypes_rounding_at_a_domain_edge_is_numerical_not_an_overflow(
    dtype: torch.dtype, tmp_path: Path
) -> None:
    """``log(1 - sigmoid(z))`` with ``sigmoid`` rounded to 1: finite in float32, non-finite
    under autocast, and no value out of the dtype's range. It was called an overflow, with
    advice to train in bfloat16 (which rounds coarser still)."""
    bundle = cases.train_rounding_under_autocast(tmp_path, dtype)
    r = tg.replay(bundle, cases.rounding_factory, repeats=1).to_dict()
    name = "bfloat16" if dtype == torch.bfloat16 else "float16"
    assert (r["reproduced"], r["float32_reproduced"]) == (True, False)
    assert (r["verdict"], r["op"]) == ("numerical", "aten.log")
    assert r["culprit_samples"] == [{"micro_batch": 0, "position": 5, "index": 13}]
    assert r["summary"].startswith(
        f"The step is non-finite under {name} autocast and finite in float32: aten.log met "
        f"the edge of its domain because {name} rounded its input"
    ), r["summary"]
    assert "overflow" not in r["verdict"] and r["advice"] == ADVICE["numerical"]


def test_no_float32_claim_when_loss_fn_enters_autocast_itself(fp16_bundle: Path) -> None:
    """The factory's loss_fn enters float16 autocast itself: the replay's run "without
    autocast" still runs float16, so it says nothing about float32 (it said "non-finite
    too", against its own verdict)."""
    model, loss = cases.overflow_factory()

    def own_autocast(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            out: torch.Tensor = loss(m, batch)
        return out

    r = tg.replay(fp16_bundle, lambda: (model, own_autocast), repeats=1, bisect=False)
    assert r.verdict == "overflow_fp16" and r.details["float32_reproduced"] is None
    assert "in float32 (autocast off) the step" not in str(r)


def test_autocast_off_replays_in_float32_where_the_step_is_finite(fp16_bundle: Path) -> None:
    r = tg.replay(fp16_bundle, cases.overflow_factory, autocast="off", repeats=1).to_dict()
    assert (r["reproduced"], r["verdict"]) == (False, "not_reproduced")
    assert r["autocast"]["enabled"] is False and r["autocast"]["source"] == "option"
    assert r["summary"] == (
        "The step is finite when replayed under off (float32) (--autocast off), but it ran "
        "under cpu autocast float16: replay without --autocast to run it as it ran."
    )


def test_cuda_autocast_recorded_runs_as_cpu_autocast_and_says_so(
    fp16_bundle: Path, tmp_path: Path
) -> None:
    bundle = _copy(fp16_bundle, tmp_path)
    cases.set_meta(bundle, 0, autocast={**cases.FP16_CPU, "device_type": "cuda"})
    r = tg.replay(bundle, cases.overflow_factory, repeats=1).to_dict()
    assert (r["verdict"], r["module"]) == ("overflow_fp16", "lin")
    assert (r["autocast"]["device_type"], r["autocast"]["dtype"]) == ("cpu", "float16")
    assert "recorded cuda autocast float16, run as cpu autocast here" in r["autocast"]["text"]
    assert "run as cpu autocast here" in str(tg.replay(bundle, cases.overflow_factory, repeats=1))


def test_unrecorded_autocast_says_so_and_the_cli_option_sets_it(
    fp16_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = _copy(fp16_bundle, tmp_path)
    cases.set_meta(bundle, 0, autocast=None)  # a bundle of a guard that did not record it
    assert main(["replay", str(bundle), "--factory", FACTORY, "--repeats", "1"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "autocast       off (float32) (the bundle did not record the autocast state)" in out
    assert "replay with --autocast float16 or bfloat16" in out
    args = ["replay", str(bundle), "--factory", FACTORY, "--autocast", "float16", "--json"]
    assert main(args) == EXIT_FINDING
    r = json.loads(capsys.readouterr().out)
    assert (r["verdict"], r["module"], r["autocast"]["source"]) == (
        "overflow_fp16",
        "lin",
        "option",
    )


def test_a_bad_autocast_value_names_the_option(fp16_bundle: Path) -> None:
    with pytest.raises(tg.ReplayError, match="--autocast 'fp8': use one of off, float16"):
        tg.replay(fp16_bundle, cases.overflow_factory, autocast="fp8")


# -- masks --------------------------------------------------------------------------------------

B, L, DIM = 4, 5, 8


class Attention(nn.Module):
    def __init__(self, fill: float = float("-inf")) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, 3)
        self.fill = fill

    def forward(self, x: Tensor, pad: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-1, -2)).masked_fill(pad[:, None, :], self.fill)
        if self.fill != float("-inf"):  # a second mask on top: finfo.min + finfo.min = -inf
            scores = scores + torch.zeros_like(scores).masked_fill(pad[:, None, :], self.fill)
        attn = torch.softmax(scores, dim=-1)  # ROW
        out: Tensor = self.out((attn @ v).mean(1))
        return out


def attention_loss(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    x, pad, y = batch
    return F.cross_entropy(model(x, pad), y)


def _padded_batch(empty: int = 2) -> tuple[Tensor, Tensor, Tensor]:
    x = torch.randn(B, L, DIM, generator=torch.Generator().manual_seed(0))
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[:, 3:] = True  # partly padded rows are fine
    pad[empty] = True  # sample `empty` has no token at all
    return x, pad, torch.arange(B) % 3


def _line(marker: str) -> int:
    return next(
        n for n, text in enumerate(Path(__file__).read_text().splitlines(), 1) if marker in text
    )


@pytest.mark.parametrize("fill", [float("-inf"), torch.finfo(torch.float32).min])
def test_a_fully_masked_row_names_the_softmax_and_its_sample(fill: float) -> None:
    r = tg.diagnose(Attention(fill), attention_loss, _padded_batch(), bisect=True).to_dict()
    assert (r["verdict"], r["phase"], r["op"]) == ("masked_row", "forward", "aten._softmax")
    assert r["source"].endswith(f"test_replay_fidelity.py:{_line('# ROW')}")
    assert r["masked_row"]["sample"] == 2 and r["masked_row"]["index"] == [2, 0]
    assert [c["position"] for c in r["culprit_samples"]] == [2]
    assert all(root["op"] != "aten.masked_fill" for root in r["roots"])
    assert "mask covered entirely (sample 2)" in r["summary"] and "masked_fill" not in r["op"]
    assert r["advice"] == ADVICE["masked_row"]


def test_a_hand_written_softmax_names_the_max_over_the_masked_row() -> None:
    def loss(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        x, pad, y = batch
        scores = model.qkv(x)[..., :L].masked_fill(pad[:, None, :], float("-inf"))
        e = (scores - scores.amax(-1, keepdim=True)).exp()  # AMAX
        p = e / e.sum(-1, keepdim=True)
        return F.cross_entropy(model.out((p @ x).mean(1)), y)

    r = tg.diagnose(Attention(), loss, _padded_batch(1), bisect=True).to_dict()
    assert (r["verdict"], r["op"], r["nan_op"]) == ("masked_row", "aten.amax", "aten.sub")
    assert r["source"].endswith(f":{_line('# AMAX')}") and r["masked_row"]["sample"] == 1
    assert [c["position"] for c in r["culprit_samples"]] == [1]


def test_a_mask_written_with_a_huge_constant_in_float16_is_no_root() -> None:
    """``where(mask, x, -1e9)`` in float16 writes -inf on purpose: no overflow_fp16 there."""
    x, pad, y = _padded_batch()

    def loss(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        x, pad, y = batch
        scores = model.qkv(x)[..., :L].half()
        masked = torch.where(pad[:, None, :], -1e9, scores)  # -inf in float16
        return F.cross_entropy(model.out((masked.float().softmax(-1) @ x).mean(1)), y)

    r = tg.diagnose(Attention(), loss, (x, pad, y), bisect=True).to_dict()
    assert (r["verdict"], r["op"], r["masked_row"]["sample"]) == ("masked_row", "aten._softmax", 2)


def test_a_partly_masked_batch_is_finite_and_a_real_cause_wins_over_a_mask() -> None:
    x, pad, y = _padded_batch()
    pad[2, 0] = False
    r = tg.diagnose(Attention(), attention_loss, (x, pad, y))
    assert r.verdict == "not_reproduced"

    def loss(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        x, pad, y = batch
        scores = model.qkv(x)[..., :L].masked_fill(pad[:, None, :], float("-inf"))
        scores = scores + 1.0 / x[..., :L]  # 1/0 = inf at [3, 0, 1]: inf - inf in softmax
        return F.cross_entropy(model.out((scores.softmax(-1) @ x).mean(1)), y)

    x2 = x.clone()
    x2[3, 0, 1] = 0.0
    r2 = tg.diagnose(Attention(), loss, (x2, pad, y)).to_dict()
    assert r2["op"] == "aten.reciprocal" and r2["nan_op"] == "aten._softmax"
    assert (r2["verdict"], r2["masked_row"]) == ("numerical", None)


def test_a_minus_inf_mask_buffer_is_no_weight_corruption() -> None:
    class Causal(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.proj = nn.Linear(DIM, L)
            self.out = nn.Linear(L, 3)
            self.register_buffer("mask", torch.full((L, L), float("-inf")).triu(1))

        def forward(self, x: Tensor) -> Tensor:
            scores = self.proj(x) + self.mask
            scores = scores.masked_fill(torch.arange(L) == 0, float("-inf"))  # row 0 now empty
            out: Tensor = self.out(torch.softmax(scores, dim=-1).mean(1))
            return out

    x, _, y = _padded_batch()
    r = tg.diagnose(Causal(), lambda m, b: F.cross_entropy(m(b[0]), b[1]), (x, y)).to_dict()
    assert r["weights_nonfinite"] == [] and r["verdict"] == "masked_row"
    assert r["op"] == "aten._softmax" and r["masked_row"]["index"][1] == 0


# -- replicas (the rule; real 2-rank bundles in tests/distributed) ------------------------------


@dataclass
class _Bundle:
    """What check_replicas reads of a bundle: ranks, files and each rank's weights."""

    states: dict[int, dict[str, Tensor]]
    sharded: bool = False
    files: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def saved_ranks(self) -> list[int]:
        return sorted(self.states)

    def model_state(self, rank: int) -> dict[str, Tensor]:
        return self.states[rank]


def _states(n: int) -> dict[int, dict[str, Tensor]]:
    torch.manual_seed(0)
    w, b = torch.randn(3, 4), torch.randn(3)
    return {
        r: {"fc.weight": w.clone(), "fc.bias": b.clone(), "bn.running_mean": b * r}
        for r in range(n)
    }


def test_replicas_a_minority_rank_is_named_and_buffers_are_not_compared() -> None:
    states = _states(3)
    states[2]["fc.weight"][1, 2] += 1e-3
    check = check_replicas(_Bundle(states), ["fc.weight", "fc.bias"])  # type: ignore[arg-type]
    (m,) = check.mismatches
    assert (m.name, m.groups, m.disagree, m.elements) == ("fc.weight", [[0, 1], [2]], [2], 1)
    assert m.max_abs_diff == pytest.approx(1e-3, rel=1e-3)
    assert "fc.weight: rank 2 differs from ranks 0 and 1" in check.sentence()


def test_replicas_two_ranks_name_both_and_a_nan_copy() -> None:
    states = _states(2)
    states[1]["fc.bias"][0] = float("nan")
    check = check_replicas(_Bundle(states), ["fc.weight", "fc.bias"])  # type: ignore[arg-type]
    (m,) = check.mismatches
    assert (m.name, m.disagree, m.nonfinite) == ("fc.bias", [0, 1], [1])
    assert check.to_dict()["disagreeing_ranks"] == [0, 1]
    same = _states(2)
    same[1]["fc.bias"] = same[0]["fc.bias"].clone()
    assert check_replicas(_Bundle(same), ["fc.weight", "fc.bias"]).mismatches == []  # type: ignore[arg-type]


def test_replicas_whose_nans_differ_only_in_their_bits_agree() -> None:
    """NaNs at the same places are the same value, whatever sign or payload the op that made
    them chose (a blown-up DDP run's replicas); a NaN where the other rank holds a number,
    or any other difference, is still a mismatch."""
    states = _states(2)
    for rank, nan in ((0, float("nan")), (1, -float("nan"))):
        states[rank]["fc.bias"][0] = nan
    assert torch.isnan(states[1]["fc.bias"][0]) and states[1]["fc.bias"].signbit()[0]
    check = check_replicas(_Bundle(states), ["fc.weight", "fc.bias"])  # type: ignore[arg-type]
    assert check.mismatches == []
    states[1]["fc.bias"][1] += 1e-3
    check = check_replicas(_Bundle(states), ["fc.weight", "fc.bias"])  # type: ignore[arg-type]
    assert [m.name for m in check.mismatches] == ["fc.bias"]


def test_replicas_of_a_sharded_or_one_rank_bundle_are_not_compared() -> None:
    assert not check_replicas(_Bundle(_states(2), sharded=True), ["fc.weight"]).checked  # type: ignore[arg-type]
    assert not check_replicas(_Bundle(_states(1)), ["fc.weight"]).checked  # type: ignore[arg-type]


# -- the factory file ---------------------------------------------------------------------------


def test_a_factory_file_imports_its_sibling_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("model", "factory"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "model.py").write_text(
        textwrap.dedent(
            """
            from torch import nn

            class GPT(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.fc = nn.Linear(2, 2)
            """
        )
    )
    (folder / "factory.py").write_text(
        textwrap.dedent(
            """
            from model import GPT

            def make():
                return GPT(), lambda model, batch: model.fc(batch).sum()
            """
        )
    )
    monkeypatch.chdir(tmp_path)  # not the file's folder
    spec = resolve_factory(f"{folder / 'factory.py'}:make")
    assert type(spec.model).__name__ == "GPT"
    spec = resolve_factory("project/factory.py:make")  # a relative path too
    assert type(spec.model).__name__ == "GPT"


def test_a_factory_file_that_parses_its_command_line_at_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training script with its argument parser at module level: imported for the replay,
    it sees only its own name in ``sys.argv`` (so its defaults), not the replay's options;
    one whose parser requires an option exits at import: a ReplayError saying so."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", ["trainguard", "replay", "BUNDLE", "--factory", "x"])
    script = tmp_path / "train_args.py"
    script.write_text(
        textwrap.dedent(
            """
            import argparse
            from torch import nn

            parser = argparse.ArgumentParser()
            parser.add_argument("--width", type=int, default=3)
            args = parser.parse_args()

            def make():
                return nn.Linear(2, args.width), lambda model, batch: model(batch).sum()
            """
        )
    )
    monkeypatch.delitem(sys.modules, "train_args", raising=False)
    spec = resolve_factory(f"{script}:make")
    assert spec.model.out_features == 3  # type: ignore[union-attr]
    assert sys.argv == ["trainguard", "replay", "BUNDLE", "--factory", "x"]  # put back

    strict = tmp_path / "train_strict.py"
    strict.write_text(
        "import argparse\nparser = argparse.ArgumentParser()\n"
        "parser.add_argument('--data', required=True)\nparser.parse_args()\n"
    )
    monkeypatch.delitem(sys.modules, "train_strict", raising=False)
    with pytest.raises(tg.ReplayError) as raised:
        resolve_factory(f"{strict}:make")
    assert "train_strict.py exited (sys.exit(2): " in str(raised.value)
    assert "the following arguments are required: --data" in str(raised.value)
    assert sys.argv[0] == "trainguard" and "train_strict" not in sys.modules


# -- an additive mask carried in the batch -----------------------------------------------------


def test_a_deliberate_mask_in_the_batch_is_input_mask_not_bad_data(tmp_path: Path) -> None:
    """The input check stops a step whose batch holds -inf; an additive bias of 0 / -inf is
    deliberate. The replay says so (it said "the loss does not read them", listed every
    padded sample as a culprit and suspected the host), and the report's line names it."""
    from trainguard.report.summary import summarize
    from trainguard.report.text import report_text

    bundle = cases.train_with_bias(tmp_path, check_inputs=True, empty=None)
    r = tg.replay(bundle, cases.bias_factory, repeats=1).to_dict()
    assert (r["verdict"], r["reproduced"], r["culprit_samples"]) == ("input_mask", False, [])
    assert r["summary"].startswith(
        "The batch's non-finite values are an additive mask: ['bias'] (micro-batch 0"
    )
    assert "suspect that GPU" not in r["summary"] and "does not read" not in r["summary"]
    assert "inputs=InputConfig(ignore=('attention_mask',))" in r["advice"]
    text = report_text(summarize(tmp_path))
    assert (
        "non-finite input on ranks [0] (['bias']: only 0 and -inf, an additive mask: "
        "inputs.ignore=('bias',) if deliberate)" in text
    )


def test_a_mask_in_the_batch_that_covers_a_whole_row_is_masked_row(tmp_path: Path) -> None:
    """With ``check_inputs=False`` a sample with no valid token makes the softmax NaN: the
    batch's -inf are a mask (no bad input), the root is the softmax over the masked row."""
    bundle = cases.train_with_bias(tmp_path, check_inputs=False, empty=5)
    r = tg.replay(bundle, cases.bias_factory, repeats=1).to_dict()
    assert (r["verdict"], r["reproduced"], r["phase"]) == ("masked_row", True, "forward")
    assert r["op"] == "aten._softmax"
    assert r["culprit_samples"] == [{"micro_batch": 0, "position": 5, "index": 15}]


def test_only_zero_and_minus_inf_make_an_additive_mask() -> None:
    from trainguard.numerics import is_additive_mask

    inf = float("inf")
    assert is_additive_mask(torch.tensor([[0.0, -inf], [0.0, 0.0]]))
    assert not is_additive_mask(torch.zeros(3))  # no -inf: no mask to speak of
    assert not is_additive_mask(torch.tensor([0.5, -inf]))  # log(0) among features
    assert not is_additive_mask(torch.tensor([0.0, inf]))
    assert not is_additive_mask(torch.tensor([0.0, float("nan")]))


@dataclass
class InputBundle:
    """A stand-in bundle of a step the input check stopped on ranks 0 and 1 (loss and
    gradients finite everywhere)."""

    trigger: str = "input"
    ranks: list[int] = field(default_factory=lambda: [0, 1])
    saved_ranks: list[int] = field(default_factory=lambda: [0, 1, 2])
    manifest: dict[str, Any] = field(
        default_factory=lambda: {"loss_ranks": [], "grad_ranks": [], "ranks": [0, 1]}
    )

    def meta(self, rank: int) -> dict[str, Any]:
        return {}


def test_an_input_stopped_step_names_every_rank_with_the_bad_input() -> None:
    """It said "made on [0] (by the recorded gradients)": the first rank only, and gradients
    that were finite."""
    from trainguard.replay.origin import find_origin
    from trainguard.replay.render import _ranks_text

    found = find_origin(InputBundle(), None, lambda rank: None)  # type: ignore[arg-type]
    assert (found.rank, found.origin_ranks) == (0, [0, 1])
    report = {"world_size": 3, "origin_ranks": [0, 1], "trigger": "input"}
    assert _ranks_text(report) == "made on [0, 1] (by the recorded inputs)"
