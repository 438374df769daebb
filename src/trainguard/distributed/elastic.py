"""What a worker started by torchrun (torchelastic) can tell from its environment.

torchrun's elastic agent hosts one ``TCPStore`` for the whole job and, since torch 2.5, hands
the same store to every restarted attempt without a per-attempt key prefix. A restarted
process group then can read the previous attempt's keys: gloo's peer addresses (the restarted
``init_process_group`` connects to a dead port: ``connectFullMesh ... Connection refused``, or
two ranks pair up with stale peers and hang) and NCCL's unique id (pytorch/pytorch#135712).
Measured here: 5 of 6 restarts of a 2-rank gloo job failed that way; with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a fresh store per rendezvous round) 8 of 8 passed.
``trainguard run`` sets that variable for its command unless it is set already
(``attach.options.child_env``).

torchrun restarts the workers on any non-zero exit while restarts are left; a worker that
knows a restart cannot help (``trainguard.recovery.restart``) stops the agent itself:
``stop_agent`` sends it SIGTERM (its parent process, when that is torchrun).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: ``trainguard run``'s own process imports no torch
    import torch
    import torch.distributed as dist

SHARE_OFF_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
RESTART_HAZARD_FIX = (
    f"export {SHARE_OFF_VAR}=1 before torchrun (a fresh store per restart; pytorch/pytorch#135712)"
)


def max_restarts(env: Mapping[str, str]) -> int:
    """torchrun's ``--max-restarts`` as the worker sees it (0 when not under torchrun)."""
    try:
        return int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return 0


def restart_store_hazard(env: Mapping[str, str]) -> str | None:
    """Why a torchrun restart of this job can fail to rendezvous, or None when it cannot.

    The hazard: restarts are allowed and the agent shares its store across attempts."""
    restarts = max_restarts(env)
    if restarts <= 0 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return (
        f"torchrun may restart this job (--max-restarts={restarts}) but shares one store "
        "across attempts, so a restarted process group can read the previous attempt's "
        "addresses and fail to connect or hang"
    )


RESTART_VAR = "TORCHELASTIC_RESTART_COUNT"
_agreed: list[int] = []
"""The job's attempt as every rank agreed on it (``agree_attempt``), once known."""


def restart_count(env: Mapping[str, str]) -> int:
    """Which attempt this is: torchrun's restarts so far (0: the first attempt, or no torchrun).
    For this process's own environment, the attempt the ranks agreed on once they have."""
    try:
        local = int(env.get(RESTART_VAR, "0"))
    except ValueError:
        local = 0
    return max(local, _agreed[0]) if env is os.environ and _agreed else local


def agree_attempt(group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Collective (every rank of ``group``, under torchrun): agree on the job's attempt.

    torchrun counts restarts per node: when a worker on one node fails, that node's agent
    counts a restart, while the other nodes' agents restart their workers (the rendezvous
    changed) with their count unchanged. The attempt is then the highest count any rank
    sees (one all-reduce per Guard); the watchdog's store keys, the run's identity
    and the restart checks read it through ``restart_count(os.environ)``."""
    import torch
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    if RESTART_VAR not in os.environ or not distributed or dist.get_world_size(group) < 2:
        return
    _agreed.clear()  # this Guard's ranks decide
    count = torch.tensor([restart_count(os.environ)], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    _agreed.append(int(count.item()))


# How torch's elastic launcher shows in its process's command line: ``torchrun`` (the console
# script), ``python -m torch.distributed.run`` and the older ``torch.distributed.launch``.
AGENT_COMMANDS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


def agent_pid(env: Mapping[str, str], proc: Path = Path("/proc")) -> int | None:
    """The pid of the elastic agent that started this worker, or None when it is not sure.

    torchrun's agent starts each worker as its own child (``subprocess.Popen``), so the agent
    is the parent process, unless the worker is a grandchild (a shell wrapper, a launcher of
    one's own). The parent counts as the agent only when this process runs under torchelastic
    (``TORCHELASTIC_RUN_ID``) and the parent's command line names torchrun (read from
    ``/proc``: Linux only; elsewhere None)."""
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    parent = os.getppid()
    if parent <= 1:  # orphaned: the agent is gone
        return None
    try:
        cmdline = (proc / str(parent) / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return None
    words = cmdline.split("\0")
    named = any(command in word for word in words[:3] for command in AGENT_COMMANDS)
    return parent if named else None


def stop_agent(env: Mapping[str, str], proc: Path = Path("/proc")) -> str:
    """Keep torchrun from restarting the job: SIGTERM its agent (the worker's parent).

    torchrun restarts the workers on any non-zero exit while restarts are left; it has no exit
    code that means "do not restart". A SIGTERM makes the agent shut the workers down (it
    sends them SIGTERM, SIGKILL after its shutdown timeout) and exit at once, status 1, with
    ``SignalException: Process N got signal: 15`` (torch.distributed.elastic's
    ``_terminate_process_handler``), without restarting. Only local rank 0 signals (one
    signal per agent: a second one could cut the agent's shutdown short); with no restarts
    left there is nothing to stop and the plain exit code ends the job. Returns what it did,
    for the log and the event."""
    left = max_restarts(env) - restart_count(env)
    if "TORCHELASTIC_RUN_ID" not in env:
        return "not under torchrun"
    if left <= 0:
        return "no restarts left: torchrun ends the job on the exit code"
    if env.get("LOCAL_RANK", "0") != "0":
        return "local rank 0 stops the agent"
    pid = agent_pid(env, proc)
    if pid is None:
        return f"the parent process is not torchrun's agent: torchrun may restart ({left} left)"
    os.kill(pid, signal.SIGTERM)
    return f"SIGTERM sent to torchrun's agent (pid {pid}; {left} restarts left unused)"
