"""This host's side of a distributed job: versions, GPUs and driver, visible devices,
``/dev/shm`` and the open-file limit. Nothing here needs a GPU; nothing here can hang (the one
subprocess, ``nvidia-smi``, runs with a timeout)."""

from __future__ import annotations

import os
import platform
import resource
import shutil
import socket
import subprocess
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainguard.doctor.findings import Finding

GIB = 1024**3
SHM_MIN_BYTES = 1 * GIB
"""Below this, ``/dev/shm`` is a finding. Docker's default is 64 MiB. A DataLoader worker hands
every batch to the main process through shared memory: one batch of 256 RGB images at 224x224
in float32 is 154 MB, and 4 workers with ``prefetch_factor=2`` keep 8 batches in flight
(1.2 GB). NCCL's shared-memory transport between ranks on one host allocates its buffers in
``/dev/shm`` too ("failed to extend /dev/shm/nccl-..."). 1 GiB is a floor, not a comfort."""

NOFILE_MIN = 4096
"""Below this soft ``RLIMIT_NOFILE``, the open-file limit is a finding. DataLoader workers share
tensors through file descriptors (torch's default ``file_descriptor`` strategy keeps one open
per shared tensor), NCCL and gloo open sockets per peer, and the common default of 1024 gives
"Too many open files" with a few workers and batches made of many tensors."""

NVIDIA_SMI_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Gpus:
    """What ``nvidia-smi`` says (``found`` False: not installed)."""

    found: bool
    names: list[str]
    driver: str | None
    error: str | None = None


def versions() -> dict[str, Any]:
    """The versions that must match across ranks, and where this process runs."""
    return {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl_version(),
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "platform": platform.platform(),
    }


def nccl_version() -> str | None:
    """NCCL's version as ``"2.21.5"``, or None for a build without NCCL."""
    if not (dist.is_available() and dist.is_nccl_available()):
        return None
    try:
        version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
    except (AttributeError, RuntimeError):
        return None
    if isinstance(version, tuple):
        return ".".join(str(part) for part in version)
    return str(version)


def query_gpus(timeout_s: float = NVIDIA_SMI_TIMEOUT_S) -> Gpus:
    """The driver's view of the GPUs. Never raises: no driver is an answer, not an error."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return Gpus(found=False, names=[], driver=None)
    query = [exe, "--query-gpu=name,driver_version", "--format=csv,noheader"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Gpus(found=True, names=[], driver=None, error=f"{type(exc).__name__}: {exc}")
    if out.returncode != 0:
        detail = (out.stderr or out.stdout).strip().splitlines()
        error = detail[0] if detail else f"exit status {out.returncode}"
        return Gpus(found=True, names=[], driver=None, error=error)
    rows = [line.split(",") for line in out.stdout.strip().splitlines() if line.strip()]
    names = [row[0].strip() for row in rows]
    driver = rows[0][1].strip() if rows and len(rows[0]) > 1 else None
    return Gpus(found=True, names=names, driver=driver)


def versions_finding(info: dict[str, Any]) -> Finding:
    cuda = f"CUDA {info['cuda']}" if info["cuda"] else "CPU build (no CUDA)"
    nccl = f"NCCL {info['nccl']}" if info["nccl"] else "no NCCL"
    return Finding(
        "environment.versions",
        "ok",
        f"torch {info['torch']}, {cuda}, {nccl}, Python {info['python']} on {info['host']}",
    )


def gpu_finding(gpus: Gpus, cuda_build: str | None, cuda_available: bool) -> Finding:
    """Driver and torch build agree? (A CUDA build on a driver that is too old sees no GPU.)"""
    check = "environment.gpu"
    if gpus.error is not None:
        return Finding(
            check,
            "warn",
            f"nvidia-smi failed: {gpus.error}",
            "run nvidia-smi by hand; a driver that does not answer cannot run CUDA jobs",
        )
    if not gpus.found or not gpus.names:
        build = f"a CUDA {cuda_build} build of torch" if cuda_build else "a CPU build of torch"
        return Finding(
            check,
            "info",
            f"no NVIDIA GPU (nvidia-smi not found) and {build}: distributed runs use gloo on CPU",
        )
    listed = f"{len(gpus.names)} x {gpus.names[0]}, driver {gpus.driver}"
    if cuda_build is None:
        return Finding(
            check,
            "warn",
            f"{listed}, but torch is a CPU build: the GPUs go unused",
            "install a CUDA build of torch (https://pytorch.org/get-started/locally/)",
        )
    if not cuda_available:
        return Finding(
            check,
            "fail",
            f"{listed}, but torch (CUDA {cuda_build}) sees no GPU",
            f"update the driver to one that supports CUDA {cuda_build}, or install a torch "
            "build for the CUDA version the driver supports (nvidia-smi shows it)",
        )
    return Finding(check, "ok", f"{listed}; torch sees {torch.cuda.device_count()}")


def devices_finding(visible: str | None, count: int, local_world_size: int | None) -> Finding:
    """CUDA_VISIBLE_DEVICES and whether every local rank gets a GPU of its own."""
    check = "environment.devices"
    shown = "unset" if visible is None else repr(visible)
    if local_world_size is not None and 0 < count < local_world_size:
        return Finding(
            check,
            "fail",
            f"{local_world_size} ranks on this host but {count} GPU(s) visible "
            f"(CUDA_VISIBLE_DEVICES {shown}): ranks would share a GPU (NCCL refuses that)",
            f"start at most {count} ranks per host (torchrun --nproc-per-node={count}) or make "
            "more GPUs visible",
        )
    if visible is not None and count == 0 and visible.strip() not in ("", "-1"):
        return Finding(
            check, "info", f"CUDA_VISIBLE_DEVICES {shown} but no GPU is visible to torch"
        )
    return Finding(check, "ok", f"{count} CUDA device(s) visible (CUDA_VISIBLE_DEVICES {shown})")


def shm_finding(path: str = "/dev/shm") -> tuple[dict[str, Any], Finding]:
    check = "environment.shm"
    try:
        stat = os.statvfs(path)
    except OSError as exc:
        return {"path": path}, Finding(check, "info", f"{path}: {exc.strerror}; not checked")
    size, free = stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize
    info = {"path": path, "size_bytes": size, "free_bytes": free, "min_bytes": SHM_MIN_BYTES}
    shown = f"{path}: {_gib(size)} GiB, {_gib(free)} GiB free"
    if size < SHM_MIN_BYTES or free < SHM_MIN_BYTES:
        return info, Finding(
            check,
            "warn",
            f"{shown} (< {_gib(SHM_MIN_BYTES)} GiB): DataLoader workers die with "
            "'bus error'/'insufficient shared memory' and NCCL fails to extend its segments",
            "give the container more: docker run --shm-size=16g (or --ipc=host); Kubernetes: "
            "mount an emptyDir with medium: Memory at /dev/shm",
        )
    return info, Finding(check, "ok", f"{shown} (>= {_gib(SHM_MIN_BYTES)} GiB)")


def open_files_finding() -> tuple[dict[str, Any], Finding]:
    check = "environment.open_files"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    info = {"soft": _limit(soft), "hard": _limit(hard), "min": NOFILE_MIN}
    shown = f"open-file limit {_limit_text(soft)} (hard {_limit_text(hard)})"
    if soft != resource.RLIM_INFINITY and soft < NOFILE_MIN:
        raise_to = "the hard limit: ulimit -n " + _limit_text(hard)
        if hard != resource.RLIM_INFINITY and hard < NOFILE_MIN:
            raise_to = "a higher hard limit (limits.conf, docker --ulimit nofile=65536:65536)"
        return info, Finding(
            check,
            "warn",
            f"{shown} < {NOFILE_MIN}: DataLoader workers and many ranks per host "
            "run out of file descriptors ('Too many open files')",
            f"raise it to {raise_to}; or torch.multiprocessing.set_sharing_strategy('file_system')",
        )
    return info, Finding(check, "ok", f"{shown} (>= {NOFILE_MIN})")


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def _limit(value: int) -> int | None:
    return None if value == resource.RLIM_INFINITY else value


def _limit_text(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)
