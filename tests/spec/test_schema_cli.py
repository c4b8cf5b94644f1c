"""`ppipe schema`: the file formats rendered from the schemas, and errors that point to it."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from ppipe.cli import main
from ppipe.spec.cluster import ClusterSpec
from ppipe.spec.plan import Plan, PlanSettings
from ppipe.spec.profile import ModelManifest


@pytest.mark.parametrize("kind,model", [("cluster", ClusterSpec), ("model", ModelManifest), ("plan", Plan)])
def test_every_top_level_field_is_listed(kind, model):
    res = CliRunner().invoke(main, ["schema", kind])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    for name, info in model.model_fields.items():
        assert any(line.startswith(f"{name}: ") for line in lines), name
        if info.description:
            assert info.description in res.output


def test_nested_models_and_enums_are_expanded():
    out = CliRunner().invoke(main, ["schema", "plan"]).output
    for name in PlanSettings.model_fields:  # nested under 'settings'
        assert f"\n  {name}: " in out
    model = CliRunner().invoke(main, ["schema", "model"]).output
    assert "'per-node' | 'fused-split' | 'ort-optimized'" in model
    assert "gpu,vgpu,batch,block,latency_us" in model


def test_layout_errors_point_to_the_schema_command(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("- just a list\n")
    res = CliRunner().invoke(main, ["plan", str(bad)])
    assert res.exit_code == 2
    assert "ppipe schema cluster" in res.output and "DESIGN.md" not in res.output


def test_unknown_kind_is_a_usage_error():
    res = CliRunner().invoke(main, ["schema", "clusters"])
    assert res.exit_code == 2 and "cluster" in res.output
