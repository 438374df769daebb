"""The report of a diagnosis: a replayed bundle's or a live traced step's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KEYS = (
    "reproduced",
    "deterministic",
    "phase",
    "op",
    "module",
    "source",
    "culprit_samples",
    "verdict",
    "summary",
    "nan_op",
    "advice",
    "path",
    "roots",
)
"""The keys every report has, in this order (``--json`` prints more after them). The first
nine are the original contract; later keys are only ever appended."""


@dataclass
class ReplayReport:
    """The diagnosis of one step. ``to_dict()`` is what ``--json`` prints; ``str()`` the text.

    ``op`` is the root: the op that first made a non-finite value from finite inputs;
    ``nan_op`` the op that later turned its ±inf into NaN (None when the root made NaN).
    ``path``: the hops from the root to the value that made the step non-finite (see
    ``chain``); ``roots``: every independent root of that value, the primary one first.
    """

    reproduced: bool
    deterministic: bool
    phase: str | None
    op: str | None
    module: str | None
    source: str | None
    culprit_samples: list[dict[str, Any]]
    verdict: str
    summary: str
    nan_op: str | None = None
    advice: str = ""
    path: list[dict[str, Any]] = field(default_factory=list)
    roots: list[dict[str, Any]] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {key: getattr(self, key) for key in KEYS}
        out.update(self.details)
        return out

    def __str__(self) -> str:
        from trainguard.replay.render import replay_text

        return replay_text(self.to_dict())


DiagnosisReport = ReplayReport
"""The name the live API (``trainguard.diagnose``, ``trace().diagnose()``) documents."""
