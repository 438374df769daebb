"""Shared test set-up: make ``tests/support`` importable (also in spawned worker processes)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
