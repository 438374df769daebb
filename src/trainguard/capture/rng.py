"""Snapshot and restore of every random number generator a training step may use."""

from __future__ import annotations

import random
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    """Python, NumPy (when installed), torch CPU and every CUDA device's generator state."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        pass
    else:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` saved (generators absent here are left alone)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            np.random.set_state(state["numpy"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
