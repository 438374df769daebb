"""Nested batches: walk, describe and slice them (``batchcodec.py`` stores them in a bundle,
``batchpaths.py`` reads their paths).

A batch may be any nesting of tensors, dicts (and other mappings), lists, tuples,
namedtuples and dataclasses, with plain scalars and strings as leaves.

Dataset indices: when the batch is a mapping with a key ``"index"`` or ``"indices"`` (or a
dataclass / object with such an attribute) holding one integer per sample (a 1-d integer
tensor or a list of ints), those are the samples' dataset indices.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from trainguard.numerics import coalesced, is_additive_mask, is_sparse, stored_values

INDEX_KEYS = ("index", "indices")
PRIMITIVES = (str, int, float, bool, type(None))


@dataclasses.dataclass(frozen=True)
class Opaque:
    """A batch leaf that could not be stored (not a tensor, container or plain scalar)."""

    type_name: str
    text: str


def call_batch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A model call's input as one micro-batch: the only positional argument as it is,
    several as a tuple, keyword arguments as ``{"args": (...), "kwargs": {...}}``."""
    if kwargs:
        return {"args": args, "kwargs": kwargs}
    if len(args) == 1:
        return args[0]
    return args


def call_versions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int]:
    """The version counters of a call's tensors, its arguments and one level into their
    containers (a batch dict, a tuple): one changes when its tensor is written in place (an
    input buffer refilled). Cheap: no deeper walk, every training forward pays it."""
    found = []
    try:
        for value in (*args, *kwargs.values()):
            if isinstance(value, Tensor):
                found.append(value._version)
            elif isinstance(value, (list, tuple)):
                found += [item._version for item in value if isinstance(item, Tensor)]
            elif isinstance(value, dict):
                found += [item._version for item in value.values() if isinstance(item, Tensor)]
    except RuntimeError:  # an inference tensor keeps no version counter (nor is written)
        found.append(-1)
    return found


def type_name(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}:{cls.__qualname__}"


def is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


# -- walk ------------------------------------------------------------------------------------


def _children(obj: Any) -> list[tuple[str, Any]] | None:
    """``(path suffix, child)`` pairs of a container, or None for a leaf."""
    named = named_children(obj)
    return None if named is None else [(suffix, child) for suffix, _, child in named]


def named_children(obj: Any) -> list[tuple[str, str | None, Any]] | None:
    """``(path suffix, name, child)`` of a container (``name``: a string dict key or an
    attribute name, None for an index or another key), or None for a leaf."""
    if isinstance(obj, (Tensor, *PRIMITIVES)):
        return None
    if is_dataclass_instance(obj):
        return [(f".{f.name}", f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    if is_namedtuple(obj):
        return [(f".{name}", name, value) for name, value in zip(obj._fields, obj, strict=True)]
    if isinstance(obj, Mapping):
        return [(f"[{k!r}]", k if isinstance(k, str) else None, v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", None, v) for i, v in enumerate(obj)]
    return None


def leaves(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf with its path, e.g. ``["x"]``, ``[1].labels``."""
    children = _children(obj)
    if children is None:
        yield path, obj
        return
    for suffix, child in children:
        yield from leaves(child, path + suffix)


def map_tensors(obj: Any, fn: Callable[[Tensor], Any]) -> Any:
    """``obj`` with every tensor leaf replaced by ``fn(tensor)`` (same container types)."""
    if isinstance(obj, Tensor):
        return fn(obj)
    return _rebuild(obj, lambda child: map_tensors(child, fn))


def _rebuild(obj: Any, fn: Callable[[Any], Any]) -> Any:
    if is_dataclass_instance(obj):
        changes = {f.name: fn(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    if is_namedtuple(obj):
        return type(obj)(*(fn(v) for v in obj))
    if isinstance(obj, Mapping):
        items = {k: fn(v) for k, v in obj.items()}
        if type(obj) is dict:
            return items
        try:
            return type(obj)(items)  # type: ignore[call-arg]
        except Exception:
            return items
    if isinstance(obj, (list, tuple)):
        return type(obj)(fn(v) for v in obj)
    return obj


def tensors(obj: Any) -> list[Tensor]:
    """The tensor leaves, in ``leaves()`` order (the same walk, without building paths: the
    input check calls it every step)."""
    if isinstance(obj, Tensor):
        return [obj]
    if type(obj) is tuple or type(obj) is list:  # the usual batch: (inputs, targets)
        flat = [child for child in obj if isinstance(child, Tensor)]
        if len(flat) == len(obj):
            return flat
    found: list[Tensor] = []
    _collect(obj, found)
    return found


def _collect(obj: Any, found: list[Tensor]) -> None:
    if isinstance(obj, Tensor):
        found.append(obj)
    elif isinstance(obj, PRIMITIVES):
        return
    elif is_dataclass_instance(obj):
        for f in dataclasses.fields(obj):
            _collect(getattr(obj, f.name), found)
    elif isinstance(obj, (list, tuple)):  # namedtuples too
        for child in obj:
            _collect(child, found)
    elif isinstance(obj, Mapping):
        for child in obj.values():
            _collect(child, found)


# -- samples ---------------------------------------------------------------------------------


def batch_size(obj: Any) -> int | None:
    """The batch dimension: the leading size most tensor leaves share (None: no tensors)."""
    sizes = Counter(t.shape[0] for t in tensors(obj) if t.dim() >= 1)
    if not sizes:
        return None
    return sizes.most_common(1)[0][0]


def select(obj: Any, positions: Sequence[int], size: int) -> Any:
    """The sub-batch of the given sample positions. Tensors whose leading dimension is
    ``size`` are indexed, and so are lists of plain values of length ``size`` below the top
    level; everything else is kept whole."""
    index = torch.as_tensor(list(positions), dtype=torch.long)

    def pick(node: Any, top: bool) -> Any:
        if isinstance(node, Tensor):
            if node.dim() >= 1 and node.shape[0] == size:
                return node.index_select(0, index.to(node.device))
            return node
        if (
            not top
            and isinstance(node, list)
            and len(node) == size
            and all(isinstance(v, PRIMITIVES) for v in node)
        ):
            return [node[i] for i in positions]
        return _rebuild(node, lambda child: pick(child, False))

    return pick(obj, True)


def dataset_indices(obj: Any) -> list[int] | None:
    """The samples' dataset indices from an ``index`` / ``indices`` field, or None."""
    for key in INDEX_KEYS:
        if isinstance(obj, Mapping) and key in obj:
            value = obj[key]
        elif not isinstance(obj, (Mapping, Tensor, list, tuple)) and hasattr(obj, key):
            value = getattr(obj, key)
        else:
            continue
        found = _as_int_list(value)
        if found is not None:
            return found
    return None


def _as_int_list(value: Any) -> list[int] | None:
    if isinstance(value, Tensor):
        if value.dim() != 1 or value.is_floating_point() or value.is_complex():
            return None
        return [int(v) for v in value.tolist()]
    if isinstance(value, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return [int(v) for v in value]
    return None


# -- description -----------------------------------------------------------------------------


def describe_leaf(value: Any) -> dict[str, Any]:
    """Shape, dtype and value statistics of a leaf (non-finite counts, finite min/max)."""
    if isinstance(value, Tensor):
        info: dict[str, Any] = {
            "kind": "tensor",
            "shape": list(value.shape),
            "dtype": str(value.dtype).replace("torch.", ""),
        }
        if value.layout != torch.strided:  # sparse: its stored values (a graph's adjacency)
            info["layout"] = str(value.layout).replace("torch.", "")
            value = stored_values(value.detach())
            info["stored"] = value.numel()
        info["bytes"] = value.numel() * value.element_size()
        info.update(tensor_stats(value))
        return info
    if isinstance(value, Opaque):
        return {"kind": "opaque", "type": value.type_name, "repr": value.text}
    return {
        "kind": type(value).__name__,
        "value": value if isinstance(value, PRIMITIVES) else None,
    }


def tensor_stats(value: Tensor) -> dict[str, Any]:
    if value.numel() == 0 or value.dtype == torch.bool:
        return {}
    if not (value.is_floating_point() or value.is_complex()):
        return {"min": int(value.min()), "max": int(value.max())}
    data = value.detach().float() if value.is_floating_point() else value.detach().abs().float()
    nan = int(torch.isnan(data).sum())
    inf = int(torch.isinf(data).sum())
    finite = data[torch.isfinite(data)]
    stats: dict[str, Any] = {"nan": nan, "inf": inf}
    if finite.numel():
        stats["min"] = _round(float(finite.min()))
        stats["max"] = _round(float(finite.max()))
    return stats


def _round(value: float) -> float:
    return value if not math.isfinite(value) else float(f"{value:.6g}")


def nonfinite_samples(obj: Any, size: int) -> list[int]:
    """Positions along the batch dimension whose floating-point values are not all finite."""
    bad: set[int] = set()
    for tensor in tensors(obj):
        if tensor.dim() >= 1 and tensor.shape[0] == size and tensor.is_floating_point():
            rows = ~torch.isfinite(tensor.detach().reshape(size, -1)).all(dim=1)
            bad.update(int(i) for i in rows.nonzero().flatten().tolist())
    return sorted(bad)


def nonfinite_tensors(
    batches: Sequence[Any], drawn: Sequence[list[int] | None] | None = None
) -> list[dict[str, Any]]:
    """Where the non-finite values are (host reads: bad steps only): per tensor, the
    micro-batch, the path in the batch, the sample positions and the dataset indices (of a
    DTensor, in this rank's shard): the batch's own, else ``drawn``'s (per micro-batch, what
    its ``DataLoader``'s sampler drew: ``capture/sampler_indices.py``)."""
    found: list[dict[str, Any]] = []
    for micro, batch in enumerate(batches):
        size = batch_size(batch)
        indices = dataset_indices(batch)
        if indices is None and drawn is not None and micro < len(drawn):
            indices = drawn[micro]
        for path, leaf in leaves(batch):
            if not isinstance(leaf, Tensor) or not leaf.is_floating_point():
                continue
            to_local = getattr(leaf, "to_local", None)
            if to_local is not None:  # a DTensor: this rank's shard (a read, no collective)
                leaf = to_local()
            if bool(torch.isfinite(stored_values(leaf.detach())).all()):
                continue
            rows = _nonfinite_rows(leaf, size) if size is not None else []
            entry: dict[str, Any] = {"micro_batch": micro, "path": path, "positions": rows}
            if is_additive_mask(leaf):
                entry["additive_mask"] = True
            if indices is not None and rows and max(rows) < len(indices):
                entry["dataset_indices"] = [indices[i] for i in rows]
            found.append(entry)
    return found


def _nonfinite_rows(leaf: Tensor, size: int) -> list[int]:
    """Sample positions of a tensor's non-finite values; of a sparse tensor from its indices
    (never densified: a sparse feature matrix can be far larger dense)."""
    if not is_sparse(leaf):
        return nonfinite_samples(leaf, size)
    if leaf.dim() < 1 or leaf.shape[0] != size:
        return []
    coo = coalesced(leaf)
    values = coo.values()
    bad = ~torch.isfinite(values.reshape(values.shape[0], -1)).all(dim=1)
    return sorted(set(coo.indices()[0][bad].tolist()))
