"""Is torch's flight recorder on? It records every collective of a process group (gloo and
NCCL in torch 2.13), and a hang report compares those records across ranks: the first
collective where the ranks' ops or sizes differ, or the ranks that never entered it. With it
off, the report falls back to each rank's Python stack (no sequence ids, no sizes, nothing
for NCCL's asynchronous collectives).

torch reads ``TORCH_FR_BUFFER_SIZE`` (or the older ``TORCH_NCCL_TRACE_BUFFER_SIZE``) when
the first process group is created; unset, torch's default applies (torch 2.13 records the
last 2000 collectives). Importing trainguard sets nothing (no import-time side effects);
trainguard's own launchers (``trainguard demo``) set it for their workers. So the doctor
judges the environment the job gets, and says how to turn the recorder on.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from trainguard.doctor.findings import Finding

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
OLD_BUFFER_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"
SUGGESTED = 2000
CHECK = "environment.recorder"
TURN_ON = (
    f"unset it, or export {BUFFER_ENV}={SUGGESTED} in the job's environment (torch reads it "
    "when the process group is created, so setting it in the script after "
    "init_process_group does nothing)"
)


def recorder_available() -> bool:
    """Whether this torch can dump its flight recorder from Python (gloo and NCCL)."""
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return False
    return hasattr(c10d, "_dump_fr_trace")


def flight_recorder_finding(env: Mapping[str, str], available: bool) -> Finding:
    name = BUFFER_ENV if BUFFER_ENV in env else OLD_BUFFER_ENV if OLD_BUFFER_ENV in env else None
    if not available:
        return Finding(
            CHECK,
            "info",
            f"flight recorder: torch {torch.__version__} cannot dump it from Python; a hang "
            "report names each rank's collective from its Python stack only",
            "a newer torch (2.13 records gloo and NCCL collectives) for sequence ids and sizes",
        )
    if name is None:
        return Finding(
            CHECK,
            "ok",
            f"flight recorder: {BUFFER_ENV} unset, torch's default applies (torch 2.13 records "
            f"the last {SUGGESTED} collectives); export {BUFFER_ENV}={SUGGESTED} to be sure",
        )
    value = env[name].strip()
    if not value.isdigit():
        return Finding(CHECK, "info", f"flight recorder: {name}={value!r} is not a number", TURN_ON)
    if int(value) == 0:
        return Finding(
            CHECK,
            "info",
            f"flight recorder off ({name}=0): a hang report names each rank's collective "
            "from its Python stack only (no sequence ids or sizes, nothing for NCCL's "
            "asynchronous collectives)",
            TURN_ON,
        )
    return Finding(
        CHECK,
        "ok",
        f"flight recorder on ({name}={value}): a hang report compares the ranks' last collectives",
    )
