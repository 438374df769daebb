"""Which reason a rank stands aside with when the ranks' verdicts are agreed, and a hook made
inert while torch iterates its dict (``attach/leaving.py``; the jobs themselves:
``tests/distributed/test_run_attach.py``)."""

from __future__ import annotations

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
)

from trainguard.attach.leaving import AsideReason, agreed_reason, disarm, peer_reason


def test_a_rank_keeps_its_own_reason_and_names_another_ranks() -> None:
    mine, theirs = AsideReason("mine"), AsideReason("theirs", then="later", own_guard=True)
    assert agreed_reason([None, None, None], 0) is None
    assert agreed_reason([None, mine, theirs], 1) == mine
    named = agreed_reason([None, theirs, mine], 0)
    assert named == AsideReason("theirs", "later", True, origin=1)
    assert named is not None and named.said == "rank 1: theirs"
    assert mine.said == "mine"
    assert peer_reason([0]).reason.startswith("rank 0 found a loop it cannot guard")
    assert peer_reason([0, 2]).reason.startswith("ranks 0, 2 found")


def test_a_hook_disarmed_inside_the_step_leaves_the_steps_other_hooks_running() -> None:
    """Deleting our hook from torch's process-wide dict while torch iterates it fails the
    script's step when another hook follows; made inert, every other hook still runs."""
    seen: list[str] = []
    handles = []

    def ours(*_: object) -> None:
        seen.append("ours")
        for handle in handles:
            disarm(handle)

    handles.append(register_optimizer_step_post_hook(ours))
    theirs = register_optimizer_step_post_hook(lambda *_: seen.append("theirs"))
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    opt = torch.optim.SGD([param], lr=1.0)
    try:
        opt.step()
        opt.step()
    finally:
        theirs.remove()
        handles[0].remove()
    assert seen == ["ours", "theirs", "theirs"]
