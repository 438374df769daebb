"""A replay's result kept beside its bundle (``BUNDLE/replay.json``), for ``trainguard report``.

The file is not part of the bundle's manifest (the bundle stays as captured); a second replay
replaces it. ``trainguard replay`` keeps only the bundle's own diagnosis (no ``--rank``, no
``--autocast``): a look at another rank or another autocast does not replace it. Writing is
best effort: a read-only bundle only loses the note.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from trainguard.events import to_jsonable
from trainguard.report.readers import REPLAY_RESULT

logger = logging.getLogger(__name__)


def save_replay_result(bundle: Path | str, report: dict[str, Any]) -> Path | None:
    """Write ``report`` (``ReplayReport.to_dict()``) to ``bundle/replay.json``; None on failure."""
    path = Path(bundle) / REPLAY_RESULT
    tmp = path.with_name(f".{REPLAY_RESULT}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(to_jsonable(report), allow_nan=False, indent=2) + "\n")
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError) as exc:
        logger.warning("trainguard: cannot keep the replay result in %s: %s", path, exc)
        tmp.unlink(missing_ok=True)
        return None
    return path
