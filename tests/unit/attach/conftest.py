"""``attached``: ``trainguard run``'s hooks installed in this process for one test."""

from __future__ import annotations

import atexit
import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainguard.attach.hooks import Attacher
from trainguard.attach.options import RunOptions


@pytest.fixture
def attached(tmp_path: Path) -> Iterator[Attacher]:
    attacher = Attacher(RunOptions(run_dir=str(tmp_path), hang_timeout=0))
    attacher.install()
    try:
        yield attacher
    finally:
        attacher.close()
        attacher._remove_hooks()
        atexit.unregister(attacher.close)  # it holds the model: let it go with the test
        attacher.model = None
        gc.collect()
