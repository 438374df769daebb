"""Shared test set-up: make ``tests/support`` importable (also in spawned worker processes),
and keep a module's shared fixture on one pytest-xdist worker."""

from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``make test`` runs two tests at a time (``-n 2 --dist loadgroup``). A module-scoped
    fixture is often a whole multi-process run that several tests read: the tests using one
    go to one worker (an ``xdist_group`` per module), so it runs once, not once per worker.
    Only the suite's own fixtures count: pytest's session-scoped ``tmp_path_factory`` (behind
    every ``tmp_path``) is cheap once per worker, and grouping by it would put every module
    on one worker whole. Before xdist's own hook, which reads the groups."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        shared = [
            d
            for defs in info.name2fixturedefs.values()
            for d in defs
            if d.scope in ("module", "session") and d.baseid  # "": pytest's own (tmp_path_factory)
        ]
        if shared:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def pytest_configure(config: pytest.Config) -> None:
    """pytest 9.2 broke ``--dist loadgroup`` with pytest-xdist 3.8 (pytest-dev/pytest-xdist#1386):
    the groups never reach xdist's scheduler, the tests still pass, and each module's shared
    multi-process run runs once per worker, minutes of CI. Refused here instead."""
    if config.getoption("dist", default="no") != "loadgroup":
        return
    if not config.getoption("numprocesses", default=None):  # -n 0: one process, no groups
        return
    xdist = sys.modules.get("xdist")
    xdist_version = _release(getattr(xdist, "__version__", "0"))
    if _release(pytest.__version__) >= (9, 2) and xdist_version <= (3, 8, 0):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist {'.'.join(map(str, xdist_version))} "
            "ignores xdist_group under --dist loadgroup (pytest-dev/pytest-xdist#1386): "
            "pip install -e '.[dev]' (pytest<9.2)"
        )
