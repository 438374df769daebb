"""DDP's ``Join`` (``torch.distributed.algorithms.Join``: uneven inputs) and the guard.

Inside ``with Join([ddp_model]):`` a rank that runs out of batches early keeps *shadowing*
the collectives of the ranks still training: each of their iterations it all-reduces a
count of the ranks not joined, then DDP's join hook stands in for the gradient all-reduce.
It knows nothing of the guard's per-step all-reduce, so a rank still training calls one
collective more than the joined rank answers: gloo aborts a rank on the size mismatch
(SIGABRT), NCCL hangs until its timeout.

Safe with the guard: ``Join(..., throw_on_early_termination=True)`` (every rank raises when
one runs out, nothing is shadowed), and a loop fed by ``guard.watch()``, whose ranks all stop
at the shortest rank's data (``uneven_data``), so no rank joins early. ``shadowed_in_join``
tells the other case: the guard raises before its first all-reduce inside the ``Join``
(``join_error``), at the same step on every rank, and ``trainguard run`` stands aside.
"""

from __future__ import annotations

from torch import nn

from trainguard.errors import ConfigError


def shadowed_in_join(model: nn.Module) -> bool:
    """Whether ``model`` (a DDP module) is inside an enabled ``Join`` that shadows a joined
    rank's collectives (the default: not ``throw_on_early_termination``)."""
    config = getattr(model, "_join_config", None)
    if config is None or not getattr(config, "enable", False):
        return False
    return not getattr(config, "throw_on_early_termination", False)


JOIN_REASON = (
    "the loop trains inside DDP's Join (uneven inputs): a rank that runs out of batches first "
    "shadows DDP's collectives but not the guard's per-step all-reduce, so the ranks' "
    "collectives would stop matching (gloo aborts, NCCL hangs)"
)


def join_error() -> ConfigError:
    """Raised on every rank at the first check inside such a ``Join`` (see the module)."""
    error = ConfigError(
        "Join",
        f"{JOIN_REASON}. Feed the loop through guard.watch(loader): every rank then stops at "
        "the shortest rank's data and Join has nothing to shadow; or pass "
        "throw_on_early_termination=True to Join; or drop Join",
    )
    error.every_rank = True  # type: ignore[attr-defined]
    return error
