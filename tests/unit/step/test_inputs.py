"""Input checks (step/inputs.py): a non-finite input marks the step bad, with where it is."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_models import TinyNet

import trainguard as tg
from trainguard.capture.batchpaths import is_ignored
from trainguard.capture.batchtree import nonfinite_tensors as bad_tensors
from trainguard.step.inputs import float_tensors, mask_note, max_abs

NAN = float("nan")


def test_max_abs_is_non_finite_exactly_when_an_input_is() -> None:
    cpu = torch.device("cpu")
    big = torch.full((4,), 3e38)  # a sum of squares would overflow; the max does not
    assert torch.isfinite(max_abs([big, torch.ones(2, dtype=torch.bfloat16)], cpu))
    assert torch.isnan(max_abs([big, torch.tensor([1.0, NAN])], cpu))
    assert torch.isinf(max_abs([torch.tensor([-float("inf")])], cpu))
    assert float(max_abs([], cpu)) == 0.0
    half = torch.tensor([1.0, -7.0], dtype=torch.float16)  # mixed dtypes, a negative maximum
    assert float(max_abs([half, torch.tensor(-5.0), torch.ones(2, 2)], cpu)) == 7.0
    assert torch.isinf(max_abs([torch.tensor([1.0, -float("inf")], dtype=torch.float16)], cpu))
    assert torch.isnan(max_abs([torch.tensor([NAN], dtype=torch.bfloat16), big], cpu))


def test_bad_tensors_name_path_positions_and_dataset_indices() -> None:
    pixels = torch.zeros(4, 3)
    pixels[2, 1] = NAN
    batch = {"pixel_values": pixels, "labels": torch.arange(4), "index": [10, 11, 12, 13]}
    good = {"pixel_values": torch.zeros(4, 3), "labels": torch.arange(4)}
    found = bad_tensors([good, batch])
    assert found == [
        {
            "micro_batch": 1,
            "path": "['pixel_values']",
            "positions": [2],
            "dataset_indices": [12],
        }
    ]


def _events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (run_dir / "events" / "rank-0.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def _run(
    run_dir: Path, check_inputs: bool, record: bool = False, ignore: tuple[str, ...] = ()
) -> list[bool]:
    """``record``: the loop hands its batches to ``record_batch`` instead of ``watch()``."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = tg.GuardConfig(
        run_dir=run_dir, hang_timeout=0, inputs=tg.InputConfig(check=check_inputs, ignore=ignore)
    )
    guard = tg.Guard(model, opt, config=config)
    batches = [{"x": torch.randn(4, 8), "aux": torch.zeros(4, 2)} for _ in range(4)]
    batches[2]["aux"][3, 0] = NAN  # not used by the loss: only the input check sees it
    oks = []
    for batch in batches if record else guard.watch(batches):
        if record:
            guard.record_batch(batch)
        loss = model(batch["x"]).pow(2).mean()
        loss.backward()
        oks.append(guard.check(loss))
        opt.step()
        opt.zero_grad()
    guard.close()
    return oks


@pytest.mark.parametrize("record", [False, True], ids=["watch", "record_batch"])
def test_a_nan_input_skips_the_step_with_the_event(tmp_path: Path, record: bool) -> None:
    """Batches from ``watch()`` and from ``record_batch()`` (Lightning, HF, ``trainguard
    run``, a loop of its own) are checked alike."""
    assert _run(tmp_path, check_inputs=True, record=record) == [True, True, False, True]
    [event] = _events(tmp_path, "bad_input")
    assert event["step"] == 2 and event["ranks"] == [0]
    assert event["tensors"] == [{"micro_batch": 0, "path": "['aux']", "positions": [3]}]
    [nonfinite] = _events(tmp_path, "nonfinite")
    assert nonfinite["where"] == "input" and nonfinite["ranks"] == [0]


def test_an_input_only_skip_names_the_option_for_inputs_meant_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        _run(tmp_path, check_inputs=True)
    [line] = [r.getMessage() for r in caplog.records if "non-finite input on" in r.getMessage()]
    assert "InputConfig(check=False)" in line and "-inf attention mask" in line


@pytest.mark.parametrize("record", [False, True], ids=["watch", "record_batch"])
@pytest.mark.parametrize("name", ["aux", "['aux']"])
def test_an_ignored_input_is_left_out_and_the_rest_stays_checked(
    tmp_path: Path, record: bool, name: str
) -> None:
    """``ignore_inputs`` by key name or by the path the guard's messages use: the NaN in
    ``aux`` skips nothing; ignoring another entry leaves ``aux`` checked."""
    assert _run(tmp_path / "aux", True, record, ignore=(name,)) == [True] * 4
    assert _events(tmp_path / "aux", "bad_input") == []
    assert _run(tmp_path / "x", True, record, ignore=("x",)) == [True, True, False, True]


def test_ignore_inputs_matches_keys_and_attributes_anywhere_in_the_batch() -> None:
    ignore = frozenset({"attention_mask"})
    for path in (
        "['attention_mask']",
        "[0]['attention_mask']",
        ".attention_mask",
        "[1].attention_mask",
    ):
        assert is_ignored(path, ignore), path
    for path in ("['attention_mask_2']", "['input']", "[0]", ""):
        assert not is_ignored(path, ignore), path
    assert is_ignored("[1]", frozenset({"[1]"}))  # a whole path: a tuple batch's entry
    assert is_ignored("[1]['x']", frozenset({"[1]"}))  # and everything inside it
    assert not is_ignored("[0]['x']", frozenset({"[1]"}))
    mask = torch.zeros(2, 2).fill_diagonal_(-float("inf"))
    batch = ({"x": torch.ones(2), "attention_mask": mask}, torch.zeros(2))
    kept = float_tensors([batch], ignore)
    assert len(kept) == 2 and all(t is not mask for t in kept)
    assert len(float_tensors([batch])) == 3
    [only] = float_tensors([batch], frozenset({"[0]"}))  # the entry left out whole
    assert only is batch[1]


def test_the_mask_note_names_the_entry_to_ignore() -> None:
    assert "InputConfig(ignore=('attention_mask',))" in mask_note("[0]['attention_mask']")
    assert "InputConfig(ignore=('[1]',))" in mask_note("[1]")
    assert "InputConfig(ignore=(\"['args'][1]\",))" in mask_note("['args'][1]")  # not all
    assert "InputConfig(check=False)" in mask_note("")  # the batch is the mask itself


@pytest.mark.parametrize(
    ("value", "says"),
    [("attention_mask", r"inputs.ignore=\('attention_mask',\)"), (("",), "tuple of batch keys")],
)
def test_ignore_inputs_must_be_a_tuple_of_names(value: Any, says: str) -> None:
    with pytest.raises(tg.ConfigError, match=says) as info:
        tg.GuardConfig(inputs=tg.InputConfig(ignore=value))
    assert info.value.option == "inputs.ignore"
    assert tg.GuardConfig(inputs=tg.InputConfig(ignore=["mask"])).inputs.ignore == ("mask",)


def test_check_inputs_off(tmp_path: Path) -> None:
    assert _run(tmp_path, check_inputs=False) == [True] * 4
    assert _events(tmp_path, "bad_input") == []


def test_cpu_max_abs_over_mixed_dtypes_propagates_nan_and_inf() -> None:
    """The CPU path (aminmax per tensor, one stack and one float64 inf-norm per dtype)."""
    cpu = torch.device("cpu")
    a = torch.tensor([[1.0, -7.5], [2.0, 3.0]])
    b = torch.tensor([4.0, -2.0], dtype=torch.bfloat16)
    c = torch.tensor([0.5, 6.0], dtype=torch.float16)
    assert max_abs([a, b, c], cpu).item() == 7.5 and max_abs([a, b, c], cpu).dtype == torch.float64
    for bad in (float("nan"), float("inf"), -float("inf")):
        worse = b.clone()
        worse[1] = bad
        assert not torch.isfinite(max_abs([a, worse, c], cpu)).item(), bad
        assert not torch.isfinite(max_abs([worse], cpu)).item(), bad
    assert max_abs([], cpu).item() == 0.0


def test_batchtree_tensors_walks_as_leaves_does() -> None:
    """The path-free walk the check takes per step finds the tensors of leaves(), in order."""
    import dataclasses
    from collections import OrderedDict, namedtuple

    from trainguard.capture import batchtree

    @dataclasses.dataclass
    class Item:
        x: torch.Tensor
        meta: dict[str, object]

    Pair = namedtuple("Pair", ["a", "b"])
    t = [torch.full((2,), float(i)) for i in range(7)]
    batch = {
        "item": Item(t[0], {"n": 3, "w": t[1], "s": "text"}),
        "pair": Pair(t[2], [t[3], None, (t[4], 1.5)]),
        "od": OrderedDict(z=t[5], y=object()),
        "last": t[6],
    }
    expected = [leaf for _, leaf in batchtree.leaves(batch) if isinstance(leaf, torch.Tensor)]
    found = batchtree.tensors(batch)
    assert len(found) == 7 and all(a is b for a, b in zip(found, expected, strict=True))


def test_a_dtensor_leaf_is_read_from_this_ranks_shard_without_a_collective(
    tmp_path: Path,
) -> None:
    """``nonfinite_tensors`` runs on one rank only (the bad one): no DTensor op may run there
    (an op on a sharded DTensor, such as ``.all()``, can need a collective the other ranks
    never join); it reads this rank's shard (``to_local``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        x = torch.randn(4, 3)
        x[2, 1] = float("nan")
        sharded = distribute_tensor(x, init_device_mesh("cpu", (1,)), [Shard(0)])
        ops: list[str] = []

        class DTensorOps(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if any(isinstance(a, DTensor) for a in tree_flatten((args, kwargs))[0]):
                    ops.append(str(func))
                return func(*args, **(kwargs or {}))

        with DTensorOps():
            found = bad_tensors([{"x": sharded}])
        assert found == [{"micro_batch": 0, "path": "['x']", "positions": [2]}]
        assert ops == []
    finally:
        dist.destroy_process_group()


def _tiny_net_factory() -> tuple[torch.nn.Module, Any]:
    return TinyNet(), lambda model, batch: model(batch["x"]).pow(2).mean()


def test_the_replay_of_a_skip_for_an_unread_input_names_the_input_not_the_device(
    tmp_path: Path,
) -> None:
    """The input check skipped a step for a NaN the loss never reads: its replay is finite,
    and that is the data's doing (``bad_input``, the path and sample), not a transient fault
    of the device the step ran on."""
    _run(tmp_path, check_inputs=True)
    report = tg.replay(tmp_path / "captures" / "step-00000002", _tiny_net_factory, repeats=1)
    assert (report.verdict, report.reproduced) == ("bad_input", False)
    assert report.details["batch_nonfinite"] == ["['aux'] (micro-batch 0, samples [3])"]
    assert [c["position"] for c in report.culprit_samples] == [3]
    assert "['aux']" in report.summary and "suspect" not in report.summary
    assert "transient" not in report.summary + report.advice


def _mask_loop(run_dir: Path, allow_masks: bool, faults: dict[int, str]) -> list[bool]:
    """Six steps whose batches carry an additive mask (0 / -inf, unused by the loss) besides
    ``x``; ``faults``: step -> "nan_x" (a NaN in ``x``, read by the loss), "nan_w" (a NaN in
    another entry, not read), "bias" (a -inf among values other than 0: not a mask)."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mask = torch.zeros(4, 4).masked_fill(torch.eye(4, dtype=torch.bool), -float("inf"))
    batches = []
    for step in range(6):
        batch = {"x": torch.randn(4, 8), "w": torch.ones(4), "mask": mask.clone()}
        if faults.get(step) == "nan_x":
            batch["x"][0, 0] = NAN
        elif faults.get(step) == "nan_w":
            batch["w"][1] = NAN
        elif faults.get(step) == "bias":
            batch["mask"][0, 1] = 0.5
        batches.append(batch)
    oks = []
    with tg.Guard(
        model, opt, run_dir=run_dir, hang_timeout=0, inputs=tg.InputConfig(allow_masks=allow_masks)
    ) as guard:
        for batch in guard.watch(batches):
            loss = model(batch["x"]).pow(2).mean()
            loss.backward()
            oks.append(guard.check(loss))
            opt.step()
            opt.zero_grad()
    return oks


def test_a_mask_at_a_finite_step_is_found_once_and_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        oks = _mask_loop(tmp_path, True, {3: "nan_w"})
    assert oks == [True, True, True, False, True, True]  # only the NaN in ``w`` skips
    assert [(e["step"], e["paths"]) for e in _events(tmp_path, "input_mask")] == [(0, ["['mask']"])]
    assert [e["step"] for e in _events(tmp_path, "bad_input")] == [3]
    assert sum("taken for an additive mask" in r.getMessage() for r in caplog.records) == 1
    assert "InputConfig(ignore=('mask',))" in caplog.text and "--ignore-inputs mask" in caplog.text


@pytest.mark.parametrize(
    ("faults", "expected"),
    [
        ({0: "nan_x"}, [False, True, True, True, True, True]),  # the loss is NaN: bad
        ({0: "nan_w"}, [False, True, True, True, True, True]),  # another entry too: bad
        ({0: "bias"}, [False, True, True, True, True, True]),  # not only 0 and -inf: bad
    ],
)
def test_a_step_with_more_than_a_mask_is_still_bad(
    tmp_path: Path, faults: dict[int, str], expected: list[bool]
) -> None:
    """Not forgiven when anything else is wrong at that step; the mask is found at the next
    clean one."""
    assert _mask_loop(tmp_path, True, faults) == expected
    assert [e["step"] for e in _events(tmp_path, "bad_input")] == [0]
    assert [e["step"] for e in _events(tmp_path, "input_mask")] == [1]


def test_allow_masks_off_makes_a_mask_step_bad(tmp_path: Path) -> None:
    with pytest.raises(tg.NonFiniteError):  # five in a row: max_consecutive
        _mask_loop(tmp_path, False, {})
    assert _events(tmp_path, "input_mask") == []


def test_the_sync_free_step_learns_a_mask_a_step_late(tmp_path: Path) -> None:
    """``guard.step()`` with a fused optimizer decides on the device before the host reads
    the step: its first two steps are left out before the mask is learned (recorded as skips
    for ``input_mask``, not bad steps), the rest train; the report counts them as skips."""
    from trainguard.report.summary import summarize

    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    mask = torch.zeros(4, 4).masked_fill(torch.eye(4, dtype=torch.bool), -float("inf"))
    batches = [{"x": torch.randn(4, 8), "mask": mask} for _ in range(6)]
    with tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0) as guard:
        outcomes = []
        for batch in guard.watch(batches):
            loss = model(batch["x"]).pow(2).mean()
            loss.backward()
            outcomes.append(guard.step(loss))
        assert [bool(o) for o in outcomes] == [False, False, True, True, True, True]
        assert guard.state.total_nonfinite == 0
    skips = _events(tmp_path, "skip")
    assert [(e["step"], e["reason"]) for e in skips] == [(0, "input_mask"), (1, "input_mask")]
    assert [e["step"] for e in _events(tmp_path, "input_mask")] == [0]
    assert summarize(tmp_path).decisions == {"ok": 4, "skip": 2}
