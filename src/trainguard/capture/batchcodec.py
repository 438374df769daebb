"""A batch stored in a bundle, and rebuilt from it.

For a bundle the nesting (``batchtree.py``) is encoded into tagged dicts of plain values, so
it loads back with ``torch.load(weights_only=True)`` (no pickled classes: opening a bundle
runs no code). Containers of user types (dataclasses, namedtuples, mapping subclasses) are
rebuilt from their recorded ``module:qualname`` when that type can be imported, and fall
back to a dict / tuple when it cannot.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from torch import Tensor

from trainguard.capture.batchtree import (
    PRIMITIVES,
    Opaque,
    is_dataclass_instance,
    is_namedtuple,
    type_name,
)

TAG = "__trainguard__"


def encode(obj: Any) -> Any:
    """A copy of ``obj`` made of plain values and CPU tensors (detached)."""
    if isinstance(obj, Tensor):
        to_local = getattr(obj, "full_tensor", None)  # a DTensor leaf: store it whole
        tensor = to_local() if callable(to_local) else obj
        return tensor.detach().cpu()
    if isinstance(obj, PRIMITIVES):
        return obj
    if is_dataclass_instance(obj):
        names = [f.name for f in dataclasses.fields(obj)]
        values = [encode(getattr(obj, name)) for name in names]
        return {TAG: "dataclass", "type": type_name(obj), "keys": names, "values": values}
    if is_namedtuple(obj):
        return {
            TAG: "namedtuple",
            "type": type_name(obj),
            "keys": list(obj._fields),
            "values": [encode(v) for v in obj],
        }
    if isinstance(obj, Mapping):
        keys = [k if isinstance(k, PRIMITIVES) else repr(k) for k in obj]
        kind = None if type(obj) is dict else type_name(obj)
        values = [encode(v) for v in obj.values()]
        return {TAG: "dict", "type": kind, "keys": keys, "values": values}
    if isinstance(obj, (list, tuple)):
        return {
            TAG: "tuple" if isinstance(obj, tuple) else "list",
            "values": [encode(v) for v in obj],
        }
    return {TAG: "opaque", "type": type_name(obj), "text": repr(obj)[:200]}


_MAIN_STAND_INS: list[ModuleType] = []
"""Modules searched for the types of module ``__main__`` (``main_stand_in``)."""


def main_stand_in(module: ModuleType) -> None:
    """Look up the types the training script defined while it ran as ``__main__`` (a batch
    dataclass, a ``UserDict`` such as HF's ``BatchEncoding``) in ``module`` too: the replay's
    factory file, often that script imported under its own name. Only the latest factory's
    (an earlier replay's script in the same process must not lend its ``Batch`` class)."""
    _MAIN_STAND_INS[:] = [module]


def _import_type(name: str | None) -> type | None:
    if not name or ":" not in name:
        return None
    module_name, qualname = name.split(":", 1)
    try:
        modules = [importlib.import_module(module_name)]
    except ImportError:
        return None
    if module_name == "__main__":
        modules += _MAIN_STAND_INS
    for module in modules:
        found = _attribute(module, qualname)
        if isinstance(found, type):
            return found
    return None


def _attribute(module: ModuleType, qualname: str) -> Any:
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def decode(obj: Any, restore_types: bool = True) -> Any:
    """Rebuild what :func:`encode` stored. ``restore_types=False``: never import user types
    (dataclasses come back as dicts, namedtuples as tuples)."""
    if not isinstance(obj, dict) or TAG not in obj:
        return obj
    kind = obj[TAG]
    if kind == "opaque":
        return Opaque(obj["type"], obj["text"])
    values = [decode(v, restore_types) for v in obj["values"]]
    if kind == "list":
        return values
    if kind == "tuple":
        return tuple(values)
    fields = dict(zip(obj["keys"], values, strict=True))
    name = obj.get("type")
    cls = _import_type(name) if restore_types else None
    if kind == "namedtuple":
        return cls(*values) if cls is not None else _unrebuilt(name, tuple, restore_types)(values)
    if kind == "dataclass" and cls is not None and dataclasses.is_dataclass(cls):
        return _build_dataclass(cls, fields)
    if kind == "dict" and cls is not None:
        try:
            return cls(fields)
        except Exception:
            return fields
    if kind == "dataclass":
        return _unrebuilt(name, dict, restore_types)(fields)
    return fields


class UnrebuiltTypeError(AttributeError):
    """An attribute of a captured container whose type the replay could not import."""


_UNREBUILT: dict[tuple[str, type], type] = {}


def _unrebuilt(name: Any, base: type, restore_types: bool) -> type:
    """A ``dict`` (``tuple``) subclass standing in for the type ``name`` that could not be
    imported: it behaves as the plain container, and reading an attribute (``batch.x``)
    raises ``UnrebuiltTypeError`` naming the type and how to make it importable, not
    "'dict' object has no attribute 'x'" (copies keep the class: ``_rebuild``)."""
    if not restore_types or not isinstance(name, str):
        return base
    key = (name, base)
    if key not in _UNREBUILT:

        def __getattr__(self: Any, attribute: str) -> Any:
            if attribute.startswith("__"):
                raise AttributeError(attribute)
            raise UnrebuiltTypeError(_unrebuilt_text(name, base, attribute))

        _UNREBUILT[key] = type(
            f"Unrebuilt_{base.__name__}", (base,), {"__getattr__": __getattr__, "type": name}
        )
    return _UNREBUILT[key]


def _unrebuilt_text(name: str, base: type, attribute: str) -> str:
    module, _, qualname = name.partition(":")
    where = (
        f"the training script defined it while it ran as __main__: import it into the "
        f"factory's module (from <your training script> import {qualname}) or define it in "
        "an importable module"
        if module == "__main__"
        else f"make {module} importable where you replay"
    )
    return (
        f"the captured batch holds a {qualname} ({module}) that the replay could not import, "
        f"so it came back as a {base.__name__} with no attribute {attribute!r}; {where}"
    )


def _build_dataclass(cls: type, fields: dict[str, Any]) -> Any:
    init = {f.name for f in dataclasses.fields(cls) if f.init}
    try:
        instance = cls(**{k: v for k, v in fields.items() if k in init})
    except Exception:
        return fields
    for key, value in fields.items():
        if key not in init:
            object.__setattr__(instance, key, value)
    return instance
