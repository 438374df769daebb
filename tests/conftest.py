"""Shared test set-up: make ``tests/support`` importable (also in spawned worker processes),
and keep a module's shared fixture on one pytest-xdist worker."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``make test`` runs two tests at a time (``-n 2 --dist loadgroup``). A module-scoped
    fixture is often a whole multi-process run that several tests read: the tests using one
    go to one worker (an ``xdist_group`` per module), so it runs once, not once per worker.
    Before xdist's own hook, which reads the groups."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        scopes = {d.scope for defs in info.name2fixturedefs.values() for d in defs}
        if "module" in scopes or "session" in scopes:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
