"""docs/formats.md names every field of the file schemas (so it cannot fall behind them)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import Plan
from ppipe.spec.profile import LAYER_COLUMNS, PROFILE_COLUMNS, ModelManifest

DOC = Path(__file__).resolve().parents[2] / "docs" / "formats.md"


def _models(model: type[BaseModel]) -> list[type[BaseModel]]:
    """``model`` and every pydantic model its fields hold (lists, dicts, optionals)."""
    out: list[type[BaseModel]] = [model]

    def walk(annotation) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if annotation not in out:
                out.extend(m for m in _models(annotation) if m not in out)
            return
        for arg in getattr(annotation, "__args__", ()) or ():
            walk(arg)

    for field in model.model_fields.values():
        walk(field.annotation)
    return out


def _fields(model: type[BaseModel]) -> list[tuple[str, str]]:
    return [(m.__name__, name) for m in _models(model) for name in m.model_fields]


@pytest.mark.parametrize("owner,name", [f for top in (ClusterSpec, ModelManifest, Plan) for f in _fields(top)])
def test_every_schema_field_is_documented(owner, name):
    text = DOC.read_text()
    assert re.search(rf"`[^`\n]*\b{re.escape(name)}\b[^`\n]*`", text), f"docs/formats.md does not name {owner}.{name}"


def test_csv_headers_are_documented():
    text = DOC.read_text()
    assert ",".join(PROFILE_COLUMNS) in text
    assert ",".join(LAYER_COLUMNS) in text
