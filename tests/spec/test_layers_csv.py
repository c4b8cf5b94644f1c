"""The optional per-layer file of a model profile (layers.csv): round trip, old profiles
without it, and malformed files ending in errors that name the file, the field and the fix."""

from __future__ import annotations

import pytest
import yaml

from ppipe.errors import SpecError
from ppipe.spec import load_profile
from ppipe.spec.profile import (
    BlockSpec,
    LayerMethod,
    LayerRow,
    LayersSpec,
    LayerTimingSpec,
    ModelManifest,
    ModelProfile,
    SourceSpec,
    make_layer_timings,
)

ROWS = [LayerRow("conv0", "Conv", 12.5), LayerRow("relu0", "Relu", 3.0), LayerRow("fc", "Gemm", 4.25)]


def _profile(with_layers=True) -> ModelProfile:
    layers = LayersSpec(gpus={"L4": LayerTimingSpec(method=LayerMethod.PER_NODE, provenance="test"),
                              "cpu": LayerTimingSpec(method=LayerMethod.ORT_OPTIMIZED)}) if with_layers else None
    manifest = ModelManifest(
        name="m",
        source=SourceSpec(kind="synthetic"),
        blocks=[
            BlockSpec(index=0, first_node="conv0", last_node="relu0", num_nodes=2, out_bytes_per_sample=8),
            BlockSpec(index=1, first_node="fc", last_node="fc", num_nodes=1, out_bytes_per_sample=4),
        ],
        layers=layers,
    )
    table = {(g, 1, 1, b): 10.0 + b for g in ("L4", "cpu") for b in (0, 1)}
    lt = None
    if with_layers:
        cpu = [LayerRow(r.node, r.op_type, 2 * r.latency_us) for r in ROWS]
        lt = make_layer_timings(manifest, {"L4": ROWS, "cpu": cpu}, {"L4": LayerMethod.PER_NODE, "cpu": LayerMethod.ORT_OPTIMIZED})
    return ModelProfile(manifest=manifest, table=table, layers=lt)


def test_layers_round_trip_and_map_nodes_to_blocks(tmp_path):
    d = _profile().save(tmp_path / "m")
    text = (d / "layers.csv").read_text().splitlines()
    assert text[0] == "gpu,node,op_type,latency_us" and text[1] == "L4,conv0,Conv,12.500"
    back = load_profile(d)
    assert back.layers == _profile().layers
    assert back.layers.node_blocks == {"conv0": 0, "relu0": 0, "fc": 1}
    assert back.layers.latency_us("cpu")["fc"] == pytest.approx(8.5)
    assert back.layers.methods == {"L4": LayerMethod.PER_NODE, "cpu": LayerMethod.ORT_OPTIMIZED}
    assert yaml.safe_load((d / "model.yaml").read_text())["layers"]["gpus"]["L4"]["method"] == "per-node"


def test_profiles_without_layers_still_load(tmp_path):
    d = _profile(with_layers=False).save(tmp_path / "old")
    assert not (d / "layers.csv").exists() and "layers" not in yaml.safe_load((d / "model.yaml").read_text())
    assert load_profile(d).layers is None


def _saved(tmp_path):
    return _profile().save(tmp_path / "m")


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda t: t.replace("gpu,node,op_type,latency_us", "gpu,node,latency_us"), r"header is .*expected \['gpu', 'node', 'op_type', 'latency_us'\]"),
        (lambda t: t.replace("L4,relu0,Relu,3.000", "L4,relu0,Relu,fast"), r"line 3: latency_us 'fast' is not a number"),
        (lambda t: t.replace("L4,relu0,Relu,3.000", "L4,relu0,Relu,-1"), r"line 3: latency_us -1.0 is not a finite non-negative"),
        (lambda t: t.replace("L4,relu0,Relu", "L4,relu0,"), r"line 3: gpu, node and op_type must not be empty"),
        (lambda t: t.replace("L4,fc,Gemm", "T4,fc,Gemm"), r"device type 'T4' is not listed in model.yaml's layers.gpus"),
        (lambda t: t.replace("L4,relu0,Relu,3.000\n", ""), r"device types L4 and cpu list different nodes"),
        (lambda t: t.replace("relu0", "relu9"), r"block 0's last_node 'relu0' is not in the table"),
        (lambda t: t.replace("conv0", "stem"), r"block 0 starts at node 'conv0' \(first_node\), the table has 'stem'"),
    ],
)
def test_malformed_layers_files_name_file_field_and_fix(tmp_path, edit, match):
    d = _saved(tmp_path)
    p = d / "layers.csv"
    p.write_text(edit(p.read_text()))
    with pytest.raises(SpecError, match=match) as err:
        load_profile(d)
    assert err.value.file == str(p) and err.value.fix


def test_layers_that_do_not_match_the_blocks(tmp_path):
    d = _saved(tmp_path)
    doc = yaml.safe_load((d / "model.yaml").read_text())
    doc["blocks"][0]["num_nodes"] = 3
    (d / "model.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(SpecError, match="block 0 has 2 nodes in the table, model.yaml says num_nodes 3") as err:
        load_profile(d)
    assert "re-run `ppipe profile`" in err.value.fix
    doc["blocks"][0]["num_nodes"] = 2
    doc["layers"]["gpus"]["V100"] = {"method": "per-node"}
    (d / "model.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(SpecError, match=r"layers.gpus lists \['V100'\], which have no rows"):
        load_profile(d)
    del doc["layers"]["gpus"]["V100"]
    doc["layers"]["gpus"]["L4"]["method"] = "guessed"
    (d / "model.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(SpecError, match="layers.gpus.L4.method"):
        load_profile(d)
    (d / "layers.csv").unlink()
    doc["layers"]["gpus"]["L4"]["method"] = "per-node"
    (d / "model.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(SpecError, match="per-layer timing table not found"):
        load_profile(d)
