"""The capture bundle format: file writing with checksums, and reading back (``load_bundle``).

A bundle is a folder ``run_dir/captures/step-{step:08d}/``::

    manifest.json       format, version, step, world size, trigger, ranks, time, versions,
                        and {"crc32", "bytes"} for every other file in the bundle
    history.json        the last steps before the bad one, the bad step last (written by rank 0):
                        {"format": 1, "records": [{"step", "losses" (per rank), "grad_norm",
                        "decision", "lr"}, ...]}, non-finite floats as "nan"/"inf" strings
    rank-{r}/meta.json  loss, micro-batch losses, gradient norms, non-finite parameters,
                        environment, dataset indices, model mode
    rank-{r}/batch.pt   the step's micro-batches on CPU (see batchcodec: loads weights_only)
    rank-{r}/rng.pt     python, numpy, torch CPU and CUDA generator states
    rank-{r}/model.pt   the weights before the bad update (unsharded models)
    rank-{r}/optimizer.pt  the optimizer state (unsharded models)
    dcp/                FSDP2 runs: weights and optimizer state, one shard per rank, written
                        with torch.distributed.checkpoint (instead of model.pt/optimizer.pt)

The folder is written under a temporary name and renamed when complete, the manifest
last, so a folder named ``step-*`` with a manifest whose checksums match is always whole.
Checksums catch torn or damaged files, not tampering. A ``.pt`` file is a zip archive in
which ``torch.save`` already stores a CRC-32 of every record, so its manifest checksum is
the CRC-32 of that record table (name, CRC, size per record; ``"over": "records"``), read
from the file's central directory: no second pass over the data. ``load_bundle`` checks
the table against the manifest and every record against its CRC (``zipfile.testzip``).
JSON files, and ``.pt`` files written while ``torch.serialization.set_crc32_options(False)``
is in effect, get a CRC-32 of their bytes (``"over": "bytes"``).
The files are flushed to disk (``fsync``) by a background thread after the rename, off
the training step: a killed process loses nothing (the page cache keeps it); after a
machine crash within that moment, ``load_bundle`` reports the damaged file instead of
returning half a bundle.
Every ``.pt`` file loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor

from trainguard.capture import batchcodec
from trainguard.errors import BundleError
from trainguard.events import to_jsonable

FORMAT = "trainguard-capture"
VERSION = 1
MANIFEST = "manifest.json"
HISTORY = "history.json"
CHUNK = 1 << 22

logger = logging.getLogger(__name__)
TMP_PREFIX = ".tmp-"
DCP_DIR = "dcp"
REQUIRED = ("format", "version", "step", "world_size", "trigger", "ranks", "files", "sharded")


RECORDS, BYTES = "records", "bytes"
"""What a file's CRC-32 covers: the zip record table of a ``.pt`` file, or every byte."""

_UNCHECKED_RECORDS = (".data/serialization_id",)
"""A random id per ``torch.save``: left out of the digest (``testzip`` still checks it), so
equal content gives equal checksums (inspect compares the ranks' weights by checksum)."""


@dataclass(frozen=True)
class FileRecord:
    crc32: str
    """CRC-32, 8 hex digits, of what ``over`` says."""
    bytes: int
    over: str = BYTES

    def to_manifest(self) -> dict[str, Any]:
        return {"crc32": self.crc32, "bytes": self.bytes, "over": self.over}


class _ChecksumWriter:
    """A write-only file wrapper that checksums what passes through (no second read)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self._crc = 0
        self.size = 0

    def write(self, data: bytes) -> int:
        self._crc = zlib.crc32(data, self._crc)
        self.size += len(data)
        return self._raw.write(data)

    def flush(self) -> None:
        self._raw.flush()

    def record(self) -> FileRecord:
        return FileRecord(f"{self._crc:08x}", self.size)


def _write(path: Path, fill: Any) -> FileRecord:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as raw:
        writer = _ChecksumWriter(raw)
        fill(writer)
    return writer.record()


def _torch_writes_crcs() -> bool:
    options = getattr(torch.serialization, "get_crc32_options", None)  # torch >= 2.6
    return True if options is None else bool(options())


def write_torch(path: Path, obj: Any) -> FileRecord:
    """``torch.save`` to ``path``; returns its checksum and size."""
    if not _torch_writes_crcs():
        return _write(path, lambda fh: torch.save(obj, fh))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, str(path))  # the C++ writer: no Python call per chunk
    return record_table(path)


def record_table(path: Path) -> FileRecord:
    """The CRC-32 of a ``.pt`` file's record table (from its zip central directory)."""
    crc = 0
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if not info.filename.endswith(_UNCHECKED_RECORDS):
                crc = zlib.crc32(f"{info.filename}:{info.CRC:08x}:{info.file_size}\n".encode(), crc)
    return FileRecord(f"{crc:08x}", path.stat().st_size, RECORDS)


def write_json(path: Path, obj: Any) -> FileRecord:
    text = json.dumps(to_jsonable(obj), indent=2, sort_keys=True, allow_nan=False) + "\n"
    return _write(path, lambda fh: fh.write(text.encode("utf-8")))


def checksum_file(path: Path) -> FileRecord:
    """The CRC-32 of every byte of ``path``."""
    crc, size = 0, 0
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return FileRecord(f"{crc:08x}", size)


def verify_file(path: Path, record: dict[str, Any]) -> str | None:
    """What is wrong with ``path`` against its manifest ``record``, or None."""
    if path.stat().st_size != record["bytes"]:
        return f"{path.stat().st_size} bytes, the manifest says {record['bytes']}"
    if record.get("over", BYTES) == BYTES:
        same = checksum_file(path).crc32 == record["crc32"]
        return None if same else "its CRC-32 does not match the manifest"
    try:
        if record_table(path).crc32 != record["crc32"]:
            return "its record table does not match the manifest"
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError) as exc:
        return f"not a readable torch.save archive ({exc})"
    return None if bad is None else f"record {bad} does not match its CRC-32"


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # not supported on every filesystem
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """Flush every file of ``folder``, the folder itself and its parent to disk."""
    for path in sorted(folder.rglob("*")):
        _fsync(path)
    _fsync(folder)
    _fsync(folder.parent)


def sync_in_background(folder: Path) -> threading.Thread:
    """``fsync_tree`` in a (non-daemon) thread: the interpreter waits for it at exit."""

    def run() -> None:
        try:
            fsync_tree(folder)
        except Exception as exc:  # durability is best effort; the checksums catch the rest
            logger.warning("trainguard: could not flush %s to disk: %s", folder, exc)

    thread = threading.Thread(target=run, name="trainguard-bundle-sync")
    thread.start()
    return thread


# -- reading -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bundle:
    """A validated bundle. Files are read on demand."""

    path: Path
    manifest: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    @property
    def trigger(self) -> str:
        return str(self.manifest["trigger"])

    @property
    def ranks(self) -> list[int]:
        """The ranks where the step went non-finite."""
        return [int(r) for r in self.manifest["ranks"]]

    @property
    def saved_ranks(self) -> list[int]:
        return [int(r) for r in self.manifest.get("saved_ranks", range(self.world_size))]

    @property
    def sharded(self) -> bool:
        """Weights and optimizer state are FSDP2 shards under ``dcp/``."""
        return bool(self.manifest["sharded"])

    @property
    def factory_config(self) -> dict[str, Any] | None:
        """``GuardConfig.factory_config`` as the run gave it (None: none given)."""
        config = self.manifest.get("factory_config")
        return config if isinstance(config, dict) else None

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        files: dict[str, dict[str, Any]] = self.manifest["files"]
        return files

    def rank_dir(self, rank: int) -> Path:
        if rank not in self.saved_ranks:
            raise BundleError(self.path, f"has no rank {rank}; it holds ranks {self.saved_ranks}")
        return self.path / f"rank-{rank}"

    def meta(self, rank: int) -> dict[str, Any]:
        path = self.rank_dir(rank) / "meta.json"
        try:
            meta: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise BundleError(path, f"cannot read: {exc}") from exc
        return meta

    def _load(self, rank: int, name: str) -> Any:
        path = self.rank_dir(rank) / name
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise BundleError(path, f"cannot load ({type(exc).__name__}: {exc})") from exc

    def batches(self, rank: int, restore_types: bool = True) -> list[Any]:
        """The step's micro-batches (one entry without gradient accumulation), on CPU."""
        stored = self._load(rank, "batch.pt")
        micro = stored.get("micro_batches") if isinstance(stored, dict) else None
        if not isinstance(micro, list):
            raise BundleError(self.rank_dir(rank) / "batch.pt", "holds no micro_batches list")
        return [batchcodec.decode(item, restore_types) for item in micro]

    def rng(self, rank: int) -> dict[str, Any] | None:
        stored = self._load(rank, "rng.pt")
        return decode_rng(stored) if stored else None

    def model_state(self, rank: int) -> dict[str, Tensor]:
        if self.sharded:
            raise BundleError(self.path, "weights are FSDP2 shards under dcp/, not model.pt")
        state: dict[str, Tensor] = self._load(rank, "model.pt")
        return state

    def optimizer_state(self, rank: int) -> dict[str, Any]:
        if self.sharded:
            raise BundleError(self.path, "optimizer state is in dcp/ (FSDP2 shards)")
        state: dict[str, Any] = self._load(rank, "optimizer.pt")
        return state

    @property
    def dcp_path(self) -> Path:
        return self.path / DCP_DIR

    @property
    def history(self) -> list[dict[str, Any]] | None:
        """The recent steps' records from ``history.json``, oldest first, the bad step last
        (``{"step", "losses", "grad_norm", "decision", "lr"}``); None when not captured."""
        if HISTORY not in self.files:
            return None
        path = self.path / HISTORY
        try:
            stored = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BundleError(path, f"cannot read: {exc}") from exc
        records = stored.get("records") if isinstance(stored, dict) else None
        if not isinstance(records, list):
            raise BundleError(path, "holds no records list")
        return [r for r in records if isinstance(r, dict)]


def load_bundle(path: Path | str, verify: bool = True) -> Bundle:
    """Open and validate a capture bundle (``verify``: check every file's checksum).

    Raises :class:`BundleError` for a missing path, a folder that is not a bundle (or the
    temporary folder of an interrupted capture), a damaged manifest, another format or a
    newer version, a missing file or a checksum mismatch.
    """
    folder = Path(path)
    if folder.name == MANIFEST:
        folder = folder.parent
    if not folder.exists():
        raise BundleError(folder, "no such file or folder")
    if not folder.is_dir():
        raise BundleError(folder, "not a capture bundle: expected a folder captures/step-NNNNNNNN")
    if folder.name.startswith(TMP_PREFIX):
        raise BundleError(
            folder, "an incomplete capture (temporary folder of an interrupted write), not a bundle"
        )
    manifest = _read_manifest(folder)
    bundle = Bundle(folder, manifest)
    _check_files(bundle, verify)
    return bundle


def _read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if not path.is_file():
        raise BundleError(
            folder, f"not a capture bundle: no {MANIFEST} (a bundle is a captures/step-* folder)"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(path, f"damaged manifest: not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise BundleError(path, f"not a trainguard capture manifest (format {found!r})")
    version = manifest.get("version")
    if not isinstance(version, int) or version > VERSION or version < 1:
        raise BundleError(
            path,
            f"bundle format version {version!r} is not one this trainguard reads (1 to "
            f"{VERSION}); open it with the trainguard version that wrote it",
        )
    missing = [key for key in REQUIRED if key not in manifest]
    if missing:
        raise BundleError(path, f"damaged manifest: missing {', '.join(missing)}")
    if not isinstance(manifest["files"], dict):
        raise BundleError(path, "damaged manifest: 'files' is not an object")
    return manifest


def _check_files(bundle: Bundle, verify: bool) -> None:
    root = bundle.path.resolve()
    for name, record in sorted(bundle.files.items()):
        file = (bundle.path / name).resolve()
        if root not in file.parents:
            raise BundleError(bundle.path, f"damaged manifest: file {name!r} is outside the bundle")
        if not file.is_file():
            raise BundleError(bundle.path, f"missing file {name} (the bundle is incomplete)")
        if not isinstance(record, dict) or "crc32" not in record or "bytes" not in record:
            raise BundleError(bundle.path, f"damaged manifest: no checksum for {name}")
        if not verify:
            continue
        problem = verify_file(file, record)
        if problem is not None:
            raise BundleError(
                bundle.path,
                f"checksum mismatch in {name} ({problem}): the file changed or was"
                " damaged after capture",
            )
    for rank in bundle.saved_ranks:
        if f"rank-{rank}/meta.json" not in bundle.files:
            raise BundleError(bundle.path, f"damaged manifest: rank-{rank}/meta.json not listed")


# -- RNG states as plain values ------------------------------------------------------------------


def encode_rng(state: dict[str, Any]) -> dict[str, Any]:
    """``rng.rng_state()`` with NumPy's array turned into a tensor (weights_only-loadable)."""
    out = dict(state)
    numpy_state = state.get("numpy")
    if numpy_state is not None:
        name, keys, pos, has_gauss, cached = numpy_state
        out["numpy"] = (str(name), torch.as_tensor(keys.astype("int64")), int(pos))
        out["numpy"] += (int(has_gauss), float(cached))
    return out


def decode_rng(state: dict[str, Any]) -> dict[str, Any]:
    out = dict(state)
    numpy_state = state.get("numpy")
    if numpy_state is not None:
        try:
            import numpy as np
        except ImportError:
            out.pop("numpy")
        else:
            name, keys, pos, has_gauss, cached = numpy_state
            out["numpy"] = (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)
    return out
