"""The file formats as text a user can read: ``ppipe schema cluster|model|plan``.

Rendered from the pydantic models themselves (field names, types, required or default,
descriptions), so it never drifts from what the loaders accept. Error messages about a
file's layout point here, because the design notes are not shipped with ppipe.
"""

from __future__ import annotations

import typing
from enum import Enum
from types import NoneType, UnionType

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import Plan
from ppipe.spec.profile import LAYER_COLUMNS, PROFILE_COLUMNS, ModelManifest

# kind -> (model, file it describes, extra text after the fields)
KINDS: dict[str, tuple[type[BaseModel], str, str]] = {
    "cluster": (ClusterSpec, "cluster YAML (e.g. clusters/HC2-S.yaml)", ""),
    "model": (
        ModelManifest,
        "models/<name>/model.yaml",
        "profile.csv beside it, one row per GPU type x vGPU level x batch x block:\n"
        f"    {','.join(PROFILE_COLUMNS)}\n"
        "layers.csv (optional), batch-1 latency of every ONNX node per device type:\n"
        f"    {','.join(LAYER_COLUMNS)}",
    ),
    "plan": (Plan, "plan.yaml (written by `ppipe plan`)", ""),
}

_MODEL_TO_KIND = {model.__name__: kind for kind, (model, _f, _x) in KINDS.items()}


def kind_of(model_name: str) -> str | None:
    """The ``ppipe schema`` kind that documents a top-level model class, if any."""
    return _MODEL_TO_KIND.get(model_name)


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, UnionType):
        return " | ".join(_type_name(a) for a in args if a is not NoneType) + (" | null" if NoneType in args else "")
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (list, tuple, set):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"mapping {_type_name(args[0])} -> {_type_name(args[1])}" if args else "mapping"
    if isinstance(tp, type) and issubclass(tp, Enum):
        return " | ".join(repr(m.value) for m in tp)
    if origin is not None and args:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def _nested(tp) -> type[BaseModel] | None:
    """The pydantic model inside a field type (a model, a list of models, a mapping to models)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    for arg in typing.get_args(tp):
        found = _nested(arg)
        if found is not None:
            return found
    return None


def _render(model: type[BaseModel], indent: int, seen: set[str], out: list[str]) -> None:
    pad = "  " * indent
    for name, info in model.model_fields.items():
        if info.is_required():
            need = "required"
        elif info.default_factory is not None:
            need = "optional"
        elif info.default is PydanticUndefined:
            need = "optional"
        else:
            need = f"default {info.default!r}"
        out.append(f"{pad}{name}: {_type_name(info.annotation)}  ({need})")
        if info.description:
            out.append(f"{pad}    {info.description}")
        sub = _nested(info.annotation)
        if sub is not None and sub.__name__ not in seen:
            _render(sub, indent + 1, seen | {sub.__name__}, out)


def render(kind: str) -> str:
    """The field tree of one file format, as text."""
    model, file, extra = KINDS[kind]
    out = [f"# {file}: {model.__name__}", ""]
    _render(model, 0, {model.__name__}, out)
    if extra:
        out += ["", extra]
    return "\n".join(out)
