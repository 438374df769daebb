"""``run_doctor``: this host's checks, then (with ``WORLD_SIZE > 1``) the cross-rank session."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainguard.doctor import environment as envcheck
from trainguard.doctor.findings import DoctorReport
from trainguard.doctor.flight_recorder import flight_recorder_finding, recorder_available
from trainguard.doctor.rendezvous import Launch, check_master, read_launch
from trainguard.doctor.session import run_session
from trainguard.doctor.variables import check_variables, relevant

DNS_TIMEOUT_CAP_S = 10.0
"""A name lookup gets at most this long (or ``timeout`` when shorter): resolvers answer in
milliseconds or, misconfigured, hang for the libc's 5 s x attempts."""


@dataclass(frozen=True)
class DoctorOptions:
    timeout_s: float = 30.0
    """Bound on each wait: the check-in, the store, each collective phase, the exchange."""
    bandwidth_mb: float = 64.0
    """Size of the large all_reduce; 0 skips the bandwidth measurement."""


def run_doctor(options: DoctorOptions, env: Mapping[str, str] | None = None) -> DoctorReport:
    env = dict(os.environ) if env is None else dict(env)
    launch, launch_findings = read_launch(env)
    report = DoctorReport(
        rank=launch.rank if launch else None, world_size=launch.world_size if launch else 1
    )
    gpus = _environment(report, env, launch)
    report.variables, variable_findings = check_variables(env)
    report.add(*variable_findings)
    report.add(*launch_findings)
    if launch is not None:
        dns_timeout = min(options.timeout_s, DNS_TIMEOUT_CAP_S)
        report.rendezvous, master_findings = check_master(launch, dns_timeout)
        report.rendezvous["launch"] = launch.__dict__
        report.add(*master_findings)
    report.smoke = _smoke_plan(report, launch)
    if report.smoke is None and launch is not None:
        payload = _payload(report, env, launch, gpus)
        report.full_text = (launch.rank or 0) == 0
        run_session(report, launch, payload, options.timeout_s, int(options.bandwidth_mb * 2**20))
    return report


def _environment(report: DoctorReport, env: dict[str, str], launch: Launch | None) -> envcheck.Gpus:
    info = envcheck.versions()
    gpus = envcheck.query_gpus()
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    shm, shm_finding = envcheck.shm_finding()
    files, files_finding = envcheck.open_files_finding()
    visible = env.get("CUDA_VISIBLE_DEVICES")
    report.environment = {
        **info,
        "driver": gpus.driver,
        "gpus": gpus.names,
        "cuda_available": cuda,
        "cuda_device_count": count,
        "cuda_visible_devices": visible,
        "shm": shm,
        "open_files": files,
    }
    report.add(
        envcheck.versions_finding(info),
        envcheck.gpu_finding(gpus, torch.version.cuda, cuda),
        envcheck.devices_finding(visible, count, launch.local_world_size if launch else None),
        shm_finding,
        files_finding,
        flight_recorder_finding(env, recorder_available()),
    )
    return gpus


def _smoke_plan(report: DoctorReport, launch: Launch | None) -> dict[str, Any] | None:
    """None when the cross-rank session should run; otherwise why it does not."""
    if any(f.status == "fail" and f.section == "rendezvous" for f in report.findings):
        return {"skipped": "the rendezvous checks failed"}
    if launch is None or not launch.distributed:
        return {"skipped": "single process: run under torchrun for the collective smoke test"}
    return None


def _payload(
    report: DoctorReport, env: dict[str, str], launch: Launch, gpus: envcheck.Gpus
) -> dict[str, Any]:
    """What this rank tells the others at check-in."""
    versions = {k: report.environment[k] for k in ("host", "python", "torch", "cuda", "nccl")}
    local_rank = launch.local_rank or 0
    count = report.environment["cuda_device_count"]
    nccl_ready = (
        dist.is_nccl_available() and count > local_rank and (launch.local_world_size or 1) <= count
    )
    return {
        "rank": launch.rank,
        "versions": {**versions, "driver": gpus.driver},
        "variables": relevant(env),
        "findings": [f.to_dict() for f in report.findings if f.counts],
        "nccl_ready": nccl_ready,
        "device": f"cuda:{local_rank}" if nccl_ready else "cpu",
    }
