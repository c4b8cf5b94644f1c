"""Strict pydantic base model and YAML loading with readable errors.

Every schema in :mod:`ppipe.spec` derives from :class:`StrictModel`: unknown keys are
errors, units are in the field names, and every field has a description. Loading goes
through :func:`load_yaml_model`, which turns pydantic's validation errors into one
:class:`~ppipe.errors.SpecError` that names the file, the field path and the fix, with a
"did you mean" for misspelt keys.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

# libyaml's safe loader where PyYAML has it (the same documents, about ten times faster to read)
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

from ppipe.errors import SpecError

SCHEMA_VERSION = 1

M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    """Base of all ppipe schemas: no unknown keys, validated on assignment, frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def _field_names_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field names valid at location ``loc`` (for "did you mean")."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return []
        field = current.model_fields.get(part)
        if field is None:
            return []
        current = _inner_model(field.annotation)
    if isinstance(current, type) and issubclass(current, BaseModel):
        names = []
        for name, field in current.model_fields.items():
            names.append(field.alias or name)
        return names
    return []


def _inner_model(annotation: Any) -> Any:
    """Find a BaseModel class inside ``list[X]``, ``X | None``, ``dict[str, X]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def format_location(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def describe_validation_error(err: ValidationError, model: type[BaseModel], file: str) -> SpecError:
    """Turn a pydantic ValidationError into one SpecError with fixes."""
    lines = []
    fixes = []
    for e in err.errors():
        loc = tuple(e.get("loc", ()))
        where = format_location(loc)
        if e["type"] == "extra_forbidden":
            key = str(loc[-1]) if loc else "?"
            valid = _field_names_at(model, loc)
            close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            lines.append(f"field '{where}': unknown key '{key}'{hint}")
            fixes.append(
                f"rename it to '{close[0]}'" if close else f"remove it; valid keys here: {', '.join(sorted(valid))}"
            )
        elif e["type"] == "missing":
            lines.append(f"field '{where}': required but missing")
            field_name = str(loc[-1]) if loc else "?"
            fixes.append(f"add '{field_name}'")
        else:
            msg = e.get("msg", "invalid value")
            value = e.get("input")
            shown = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
            lines.append(f"field '{where}': {msg} (got {shown})")
    message = "invalid " + model.__name__ + ":\n  " + "\n  ".join(lines)
    fix = "; ".join(dict.fromkeys(fixes)) or f"correct the field(s) named above ({_schema_hint(model.__name__)})"
    return SpecError(message, fix=fix, file=file)


def _schema_hint(model_name: str) -> str:
    """Where a user reads the layout of the file a model class describes."""
    from ppipe.spec.schema import kind_of

    kind = kind_of(model_name)
    return f"`ppipe schema {kind}` prints the fields of this file" if kind else "see the field descriptions in ppipe.spec"


def read_yaml(path: str | Path) -> Any:
    """Read a YAML file; a missing file or bad syntax is a SpecError naming the file."""
    p = Path(path)
    if not p.exists():
        raise SpecError("file not found", fix="check the path", file=str(p))
    if p.is_dir():
        raise SpecError("is a directory, expected a YAML file", fix="name the YAML file itself", file=str(p))
    try:
        with p.open() as fh:
            return yaml.load(fh, Loader=_SAFE_LOADER)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError(f"malformed YAML{where}: {problem}", fix="fix the YAML syntax there", file=str(p)) from None


def validate_data(model: type[M], data: Any, file: str) -> M:
    """Validate already-parsed data against ``model``, raising a SpecError on failure."""
    if not isinstance(data, dict):
        raise SpecError(
            f"expected a mapping of {model.__name__} fields at the top level, got {type(data).__name__}",
            fix=_schema_hint(model.__name__).capitalize(),
            file=file,
        )
    version = data.get("version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise SpecError(
            f"field 'version': unsupported version {version!r}",
            fix=f"this ppipe reads version {SCHEMA_VERSION}",
            file=file,
        )
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise describe_validation_error(err, model, file) from None


def load_yaml_model(model: type[M], path: str | Path) -> M:
    """Load and validate a YAML file against ``model``."""
    return validate_data(model, read_yaml(path), str(path))


def dump_yaml(data: Any, path: str | Path) -> None:
    """Write ``data`` (plain Python values) as block-style YAML, keys in insertion order."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w") as fh:
        yaml.safe_dump(data, fh, sort_keys=False, default_flow_style=None, width=100)
