"""Paths in a batch, as ``batchtree.leaves`` writes them (``[0]['mask'].x``), and the walk
that leaves named entries out (``InputConfig.ignore``)."""

from __future__ import annotations

import ast
import re
from typing import Any

from torch import Tensor

from trainguard.capture.batchtree import named_children

_SEGMENT = re.compile(r"\[(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^\]]*)\]|\.\w+")
"""One step of a batch path (``leaves``): ``['key']``, ``[3]`` or ``.name``."""


def _segment_name(segment: str) -> str | None:
    """The dict key (a string) or attribute name of one path segment; None for an index."""
    if segment.startswith("."):
        return segment[1:]
    inner = segment[1:-1]
    if inner[:1] in ("'", '"'):
        name: str = ast.literal_eval(inner)
        return name
    return None


def path_names(path: str) -> list[str]:
    """The dict keys (strings) and attribute names along a batch path (``leaves``):
    ``"[0]['mask'].x"`` -> ``["mask", "x"]``."""
    names = (_segment_name(segment) for segment in _SEGMENT.findall(path))
    return [name for name in names if name is not None]


def path_prefixes(path: str) -> list[str]:
    """``path`` and the paths of its containers in the batch, outermost first:
    ``"[0]['mask']"`` -> ``["[0]", "[0]['mask']"]``."""
    prefixes, at = [], ""
    for segment in _SEGMENT.findall(path):
        at += segment
        prefixes.append(at)
    return prefixes


def ignore_name(path: str) -> str:
    """What ``InputConfig.ignore`` takes for ``path``: its key or attribute name when
    it ends in one, else the whole path (``"['args'][1]"``: the name ``args`` would leave out
    every positional argument)."""
    segments = _SEGMENT.findall(path)
    name = _segment_name(segments[-1]) if segments else None
    return name if name is not None else path


def is_ignored(path: str, ignore: frozenset[str]) -> bool:
    """Whether ``ignore`` names ``path`` or an entry holding it, by key or attribute name or
    by the whole path: the rule ``tensors_outside`` walks by, for paths already written."""
    if any(name in ignore for name in path_names(path)):
        return True
    return any(prefix in ignore for prefix in path_prefixes(path))


def tensors_outside(obj: Any, ignore: frozenset[str], path: str = "") -> list[Tensor]:
    """The tensor leaves of ``obj`` outside the entries ``ignore`` names: an entry whose key
    or attribute name, or whose whole path, is in ``ignore`` is left out with everything in
    it (``InputConfig.ignore``)."""
    found: list[Tensor] = []
    _collect_outside(obj, ignore, path, found)
    return found


def _collect_outside(obj: Any, ignore: frozenset[str], path: str, found: list[Tensor]) -> None:
    if isinstance(obj, Tensor):
        found.append(obj)
        return
    for suffix, name, child in named_children(obj) or ():
        at = path + suffix
        if name in ignore or at in ignore:
            continue
        _collect_outside(child, ignore, at, found)
