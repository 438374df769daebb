"""The path from a root op to the value that made the step non-finite, and the roots.

A path is a list of hops, root first: ``{"op", "value", "shape", "dtype", "module",
"source", "phase"}`` each (a value that was non-finite before the step has ``op`` None and
a ``label``: ``batch['x']``, ``encoder.fc.weight``). A long path keeps its first and last
hops, with ``{"elided": n}`` between them.
"""

from __future__ import annotations

from typing import Any

from trainguard.replay.localize import Hop, Origin

HEAD, TAIL = 3, 2


def hop_dict(hop: Hop) -> dict[str, Any]:
    site = hop.site
    out: dict[str, Any] = {
        "op": site.op if site else None,
        "value": hop.value,
        "shape": hop.shape,
        "dtype": hop.dtype,
        "module": site.module if site else None,
        "source": site.source if site else None,
        "phase": site.phase if site else "before the step",
    }
    if site is None:
        out["label"] = hop.origin.label
    return out


def path_of(hop: Hop | None, head: int = HEAD, tail: int = TAIL) -> list[dict[str, Any]]:
    """The hops from the root to ``hop``, elided in the middle when long."""
    if hop is None:
        return []
    hops = [hop_dict(h) for h in hop.chain()]
    if len(hops) <= head + tail + 1:
        return hops
    return [*hops[:head], {"elided": len(hops) - head - tail}, *hops[-tail:]]


def root_dict(origin: Origin) -> dict[str, Any]:
    site = origin.site
    return {
        "kind": origin.kind,
        "op": site.op if site else None,
        "value": origin.value,
        "phase": site.phase if site else "before the step",
        "module": site.module if site else None,
        "source": site.source if site else None,
        "label": origin.label,
        "detail": origin.detail,
    }


DELIBERATE = ("constant", "untracked")
"""Origins that are no cause of their own (a mask's -inf): listed only when nothing else is."""


def roots_of(hop: Hop | None, primary: Origin | None) -> list[dict[str, Any]]:
    """Every independent root of ``hop``'s value, the primary one first (deliberate values
    such as a mask's -inf only when no real root reached it)."""
    roots = list(hop.roots) if hop is not None else []
    causes = [r for r in roots if r.kind not in DELIBERATE]
    if causes:
        roots = causes
    if primary is not None and all(r is not primary for r in roots):
        roots.insert(0, primary)
    roots.sort(key=lambda r: r is not primary)
    return [root_dict(r) for r in roots]


def hop_text(hop: dict[str, Any]) -> str:
    if "elided" in hop:
        return f"... {hop['elided']} more hops ..."
    shape = "[" + ", ".join(map(str, hop["shape"])) + "]"
    what = hop["op"] or hop.get("label") or "?"
    where = hop["module"] or "-"
    source = hop["source"] or "-"
    return f"{what:<22} {hop['value']:<5} {hop['dtype']:<9} {shape:<12} {where}  {source}"
