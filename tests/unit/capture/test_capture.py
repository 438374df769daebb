"""Capture bundles: what a bad step leaves behind, and load_bundle's validation."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import shutil
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import tg_capture_models as models
import torch

import trainguard as tg
from trainguard.capture import batchtree
from trainguard.capture.bundle import MANIFEST
from trainguard.capture.rng import rng_state, set_rng_state
from trainguard.step import capturer as capture

pytestmark = pytest.mark.timeout(60)


def _bundles(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "captures").glob("step-*"))


def _kinds(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in tg.read_events(run_dir) if e["kind"] == kind]


@pytest.fixture(scope="module")
def escalated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tg.NonFiniteError]:
    """Bad steps 2, 4, 5 with max_consecutive=2: captures at 2 (first) and 5 (escalation)."""
    run_dir = tmp_path_factory.mktemp("escalated")
    data = models.batches("forward", 7, bad_step=2)
    for step in (4, 5):
        data[step]["x"][1] = 0.0
    model = models.make_model("forward")
    with pytest.raises(tg.NonFiniteError) as info:
        models.train(model, models.ce_loss, data, run_dir, max_consecutive=2)
    return run_dir, info.value


def test_first_bad_step_and_escalation_are_captured(
    escalated: tuple[Path, tg.NonFiniteError],
) -> None:
    run_dir, error = escalated
    assert [b.name for b in _bundles(run_dir)] == ["step-00000002", "step-00000005"]
    assert error.bundle == run_dir / "captures" / "step-00000005"
    captures = _kinds(run_dir, "capture")
    assert [(e["step"], e["reason"]) for e in captures] == [
        (2, "first_bad_step"),
        (5, "escalation"),
    ]
    assert not list((run_dir / "captures").glob(".tmp-*"))


def test_manifest_and_rank_files(escalated: tuple[Path, tg.NonFiniteError]) -> None:
    run_dir, _ = escalated
    bundle = tg.load_bundle(run_dir / "captures" / "step-00000002")
    manifest = bundle.manifest
    assert manifest["format"] == "trainguard-capture" and manifest["version"] == 1
    assert (bundle.step, bundle.world_size, bundle.trigger, bundle.ranks) == (2, 1, "loss", [0])
    assert manifest["torch"] == torch.__version__ and manifest["python"]
    assert isinstance(manifest["time"], float) and not bundle.sharded
    names = {"meta.json", "batch.pt", "rng.pt", "model.pt", "optimizer.pt"}
    assert set(manifest["files"]) == {f"rank-0/{n}" for n in names} | {"history.json"}
    assert all(len(r["crc32"]) == 8 and r["bytes"] > 0 for r in manifest["files"].values())
    meta = bundle.meta(0)
    assert meta["loss"] == "nan" and meta["loss_finite"] is False
    assert "encoder.layers.0.fc.weight" in meta["nonfinite_params"]
    assert meta["dataset_indices"] == [list(range(1016, 1024))]
    assert meta["env"]["host"] and meta["env"]["device"] == "cpu" and meta["env"]["rank"] == 0
    assert meta["model_training"] is True


def test_bundle_holds_the_pre_update_state(tmp_path: Path) -> None:
    data = models.batches("forward", 3, bad_step=2)
    model = models.make_model("forward")
    models.train(model, models.ce_loss, data, tmp_path)  # the bad step is the last: skipped
    bundle = tg.load_bundle(_bundles(tmp_path)[0])
    for name, value in model.state_dict().items():
        assert torch.equal(bundle.model_state(0)[name], value), name
    assert bundle.optimizer_state(0)["param_groups"][0]["lr"] == 0.05
    (batch,) = bundle.batches(0)
    assert torch.equal(batch["x"], data[2]["x"]) and torch.equal(batch["index"], data[2]["index"])


def test_rng_state_round_trips(tmp_path: Path) -> None:
    data = models.batches("forward", 3, bad_step=1)
    torch.manual_seed(7)
    models.train(models.make_model("forward"), _noisy_loss, data, tmp_path)
    bundle = tg.load_bundle(_bundles(tmp_path)[0])
    saved = bundle.rng(0)
    assert saved is not None and {"python", "torch", "numpy"} <= set(saved)
    set_rng_state(saved)
    first = torch.rand(3)
    set_rng_state(saved)
    assert torch.equal(torch.rand(3), first)
    set_rng_state(rng_state())  # numpy state decodes into a valid state


def _noisy_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return models.ce_loss(model, batch) + 0.0 * torch.rand(())


@dataclasses.dataclass
class Sample:
    pixels: torch.Tensor
    meta: dict[str, Any]
    index: torch.Tensor


Pair = namedtuple("Pair", ["left", "right"])


def test_nested_batches_under_accumulation(tmp_path: Path) -> None:
    def make(step: int) -> Sample:
        x = torch.randn(4, models.D_IN)
        if step == 3:
            x[2] = 0.0
        return Sample(
            pixels=x,
            meta={"pair": Pair(torch.ones(4), [1, "a"]), "names": ["a", "b", "c", "d"]},
            index=torch.arange(4) + 10 * step,
        )

    def loss_fn(model: torch.nn.Module, batch: Sample) -> torch.Tensor:
        return model(batch.pixels).pow(2).mean() + batch.meta["pair"].left.sum() * 0

    data = [make(i) for i in range(6)]
    models.train(models.make_model("forward"), loss_fn, data, tmp_path, accumulation_steps=2)
    bundle = tg.load_bundle(_bundles(tmp_path)[0])
    assert bundle.step == 1
    micro = bundle.batches(0)
    assert len(micro) == 2 and all(isinstance(m, Sample) for m in micro)
    assert torch.equal(micro[1].pixels, data[3].pixels)
    assert isinstance(micro[1].meta["pair"], Pair) and micro[1].meta["pair"].right == [1, "a"]
    assert bundle.meta(0)["dataset_indices"] == [[20, 21, 22, 23], [30, 31, 32, 33]]
    plain = bundle.batches(0, restore_types=False)
    assert isinstance(plain[0], dict) and isinstance(plain[0]["meta"]["pair"], tuple)
    assert len(bundle.meta(0)["micro_losses"]) == 2


def test_select_and_stats_of_nested_batches() -> None:
    batch = {
        "x": torch.arange(12.0).reshape(4, 3),
        "w": torch.ones(3),
        "tags": ["a", "b", "c", "d"],
    }
    sub = batchtree.select(batch, [1, 3], 4)
    assert sub["x"].tolist() == [[3.0, 4.0, 5.0], [9.0, 10.0, 11.0]]
    assert sub["w"].shape == (3,) and sub["tags"] == ["b", "d"]
    batch["x"][2, 1] = float("inf")
    assert batchtree.nonfinite_samples(batch, 4) == [2]
    stats = batchtree.describe_leaf(batch["x"])
    assert (stats["nan"], stats["inf"], stats["min"], stats["max"]) == (0, 1, 0.0, 11.0)


# -- load_bundle validation -------------------------------------------------------------------


@pytest.fixture
def bundle_copy(escalated: tuple[Path, tg.NonFiniteError], tmp_path: Path) -> Path:
    source = escalated[0] / "captures" / "step-00000002"
    target = tmp_path / "step-00000002"
    shutil.copytree(source, target)
    return target


def _edit_manifest(path: Path, **changes: Any) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    manifest.update(changes)
    (path / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: shutil.rmtree(p), "no such file or folder"),
        (lambda p: (p / MANIFEST).unlink(), "no manifest.json"),
        (lambda p: (p / MANIFEST).write_text("{not json"), "damaged manifest"),
        (lambda p: _edit_manifest(p, format="something-else"), "not a trainguard capture"),
        (lambda p: _edit_manifest(p, version=99), "version 99"),
        (lambda p: (p / "rank-0" / "batch.pt").unlink(), "missing file rank-0/batch.pt"),
        (lambda p: _flip_byte(p / "rank-0" / "model.pt"), "checksum mismatch in rank-0/model.pt"),
        (lambda p: _flip_tensor_byte(p / "rank-0" / "model.pt"), r"record .*data/0 does not"),
        (lambda p: _truncate(p / "rank-0" / "optimizer.pt"), r"rank-0/optimizer.pt \(\d+ bytes"),
        (lambda p: _flip_byte(p / "rank-0" / "meta.json"), "mismatch in rank-0/meta.json"),
    ],
)
def test_load_bundle_rejects_damage(bundle_copy: Path, damage: Any, message: str) -> None:
    damage(bundle_copy)
    with pytest.raises(tg.BundleError, match=message) as info:
        tg.load_bundle(bundle_copy)
    assert "\n" not in str(info.value)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _flip_tensor_byte(path: Path) -> None:
    """Bit rot inside a tensor's bytes: torch.load would return wrong weights silently."""
    first = next(iter(torch.load(path, weights_only=True).values()))
    data = bytearray(path.read_bytes())
    at = data.find(first.numpy().tobytes()[:16])
    assert at > 0
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


# -- failures and interruptions ---------------------------------------------------------------


def test_failed_write_is_an_event_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def disk_full(path: Path, obj: Any) -> Any:
        path.write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(capture, "write_torch", disk_full)
    data = models.batches("forward", 5, bad_step=1)
    model = models.make_model("forward")
    with caplog.at_level(logging.ERROR, logger="trainguard.step.capturer"):
        guard = models.train(model, models.ce_loss, data, tmp_path)
    assert guard.state.step == 5 and guard.state.total_nonfinite == 1
    assert guard.state.last_good_step == 4
    (failed,) = _kinds(tmp_path, "capture_failed")
    assert failed["step"] == 1 and "No space left" in failed["error"]
    assert "could not be captured" in caplog.text and "training goes on" in caplog.text
    assert not list((tmp_path / "captures").iterdir())  # the temporary folder is gone


@pytest.mark.parametrize(
    "stop_at", ["batch.pt", "model.pt", "meta.json", "manifest.json", "rename"]
)
def test_interrupted_capture_leaves_no_bundle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop_at: str
) -> None:
    """A capture stopped mid-write (Ctrl-C here; a kill in the CLI test) leaves only a
    temporary folder, which load_bundle and inspect refuse."""

    def interrupting(real_write: Any) -> Any:
        def write(path: Path, obj: Any) -> Any:
            record = real_write(path, obj)
            if path.name == stop_at:
                raise KeyboardInterrupt
            return record

        return write

    def rename(src: Path, dst: Path) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(capture, "write_torch", interrupting(capture.write_torch))
    monkeypatch.setattr(capture, "write_json", interrupting(capture.write_json))
    if stop_at == "rename":
        monkeypatch.setattr(capture.os, "rename", rename)
    data = models.batches("forward", 3, bad_step=1)
    with pytest.raises(KeyboardInterrupt):
        models.train(models.make_model("forward"), models.ce_loss, data, tmp_path)
    assert not _bundles(tmp_path)
    (partial,) = (tmp_path / "captures").iterdir()
    assert partial.name.startswith(".tmp-step-00000001-")
    with pytest.raises(tg.BundleError, match="incomplete capture"):
        tg.load_bundle(partial)
    from trainguard.cli import main

    assert main(["inspect", str(partial)]) == 2


def test_capture_off(tmp_path: Path) -> None:
    data = models.batches("forward", 3, bad_step=1)
    models.train(models.make_model("forward"), models.ce_loss, data, tmp_path, capture=False)
    assert not (tmp_path / "captures").exists()


def test_sync_free_step_captures_the_pre_update_state(tmp_path: Path) -> None:
    """guard.step() with a fused optimizer reads the flag a step late; the bundle still holds
    the weights from before the (skipped) bad step, and that step's own batch."""
    import copy

    model = models.make_model("forward")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    data = models.batches("forward", 4, bad_step=2)
    before: dict[str, torch.Tensor] = {}
    with tg.Guard(model, optimizer, run_dir=tmp_path, hang_timeout=0) as guard:
        for batch in guard.watch(data):
            if guard.state.step == 2:
                before = copy.deepcopy(model.state_dict())
            loss = models.ce_loss(model, batch)
            loss.backward()
            guard.step(loss)
    (path,) = _bundles(tmp_path)
    bundle = tg.load_bundle(path)
    assert bundle.step == 2
    for name, value in before.items():
        assert torch.equal(bundle.model_state(0)[name], value), name
    assert torch.equal(bundle.batches(0)[0]["x"], data[2]["x"])


def test_equal_content_gives_equal_checksums(tmp_path: Path) -> None:
    """torch.save writes a random id into every file; the record-table checksum leaves it
    out, so DDP ranks with identical weights get identical checksums (inspect relies on it)."""
    from trainguard.capture.bundle import verify_file, write_torch

    weights = {"w": torch.arange(1000, dtype=torch.float32)}
    first = write_torch(tmp_path / "a" / "model.pt", weights)
    second = write_torch(tmp_path / "b" / "model.pt", dict(weights))
    changed = write_torch(tmp_path / "c" / "model.pt", {"w": weights["w"] + 1})
    assert first == second and first.over == "records"
    assert changed.crc32 != first.crc32
    assert verify_file(tmp_path / "a" / "model.pt", first.to_manifest()) is None
