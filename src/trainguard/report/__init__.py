"""``trainguard report RUN_DIR``: a run at a glance (text, JSON, a self-contained HTML page).

- ``readers``  tolerant JSONL/JSON reading: torn or garbage lines are counted, not fatal
- ``summary``  events, the metrics log, capture bundles and hang reports into a RunSummary
- ``starts``   a run's starts (restarts, resumes, loaded states) and the steps each ran
- ``decisions`` the ``decisions`` line: ok steps and the steps of each bad decision
- ``text``     the printed summary
- ``plot``     the timeline picture (matplotlib, the ``plot`` extra, imported lazily)
- ``html``     ``RUN_DIR/report.html``, the picture inlined (no network)
- ``command``  what the CLI command does

A top-level tool: it reads what a run left on disk. Offers: ``summarize``, ``RunSummary``,
``REPLAY_RESULT``. Imports only the shared base modules (and matplotlib, lazily).
"""

from trainguard.report.readers import REPLAY_RESULT
from trainguard.report.summary import RunSummary, summarize

__all__ = ["REPLAY_RESULT", "RunSummary", "summarize"]
