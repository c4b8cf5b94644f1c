"""Schemas and formats: clusters, profiles, plans, the artifact importer, the CLI's errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ppipe.errors import SpecError
from ppipe.spec import load_cluster, load_profile
from ppipe.spec.artifact import load_artifact_model
from ppipe.spec.profile import read_profile_csv


@pytest.mark.parametrize(
    "name,counts",
    [
        ("HC1-L", {"L4": 25, "P4": 75}),
        ("HC2-L", {"L4": 25, "T4": 75}),
        ("HC3-S", {"V100": 4, "P4": 12}),
        ("HC4-S", {"V100": 4, "T4": 12}),
        ("local-cpu", {"cpu": 1}),
    ],
)
def test_builtin_clusters(name, counts):
    c = load_cluster(name)
    assert c.gpu_counts == counts


def test_paper_cluster_settings():
    hc2 = load_cluster("HC2-L")
    assert hc2.effective_bandwidth_gbps("L4") == pytest.approx(10.0)
    assert hc2.gpus_per_server("L4") == 4 and hc2.gpus_per_server("T4") == 2
    assert hc2.gpu_type("T4").vgpu_levels == [1, 2, 3, 4]
    hc1 = load_cluster("HC1-L")
    assert hc1.effective_bandwidth_gbps("P4") == pytest.approx(6.0)
    assert hc1.gpu_type("P4").vgpu_levels == [1]


def _write(tmp_path: Path, data) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def _cluster(**over):
    base = dict(
        version=1,
        name="t",
        gpu_types=[dict(name="L4", vgpu_levels=[1, 2])],
        servers=[dict(name="a", gpu_type="L4", gpus_per_server=2, count=1, nic_bandwidth_gbps=10)],
    )
    base.update(over)
    return base


def test_unknown_key_did_you_mean(tmp_path):
    data = _cluster()
    data["servers"][0]["nic_bandwith_gbps"] = data["servers"][0].pop("nic_bandwidth_gbps")
    with pytest.raises(SpecError, match=r"did you mean 'nic_bandwidth_gbps'") as info:
        load_cluster(_write(tmp_path, data))
    assert "servers[0]" in str(info.value) and str(tmp_path) in str(info.value)


def test_unknown_gpu_type_in_server(tmp_path):
    data = _cluster(servers=[dict(name="a", gpu_type="H100", gpus_per_server=1, nic_bandwidth_gbps=10)])
    with pytest.raises(SpecError, match=r"gpu_type 'H100' is not one of"):
        load_cluster(_write(tmp_path, data))


def test_bad_vgpu_level(tmp_path):
    with pytest.raises(SpecError, match=r"gpu_types\[0\]\.vgpu_levels"):
        load_cluster(_write(tmp_path, _cluster(gpu_types=[dict(name="L4", vgpu_levels=[1, 8])])))


def test_malformed_yaml_names_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match=r"malformed YAML at line"):
        load_cluster(p)


def test_missing_cluster_lists_builtins():
    with pytest.raises(SpecError, match=r"HC2-S"):
        load_cluster("no-such-cluster")


def test_profile_csv_missing_blocks(tmp_path):
    p = tmp_path / "profile.csv"
    p.write_text("gpu,vgpu,batch,block,latency_us\nL4,1,1,0,10\n")
    with pytest.raises(SpecError, match=r"missing timings for gpu=L4 vgpu=1 batch=1: blocks \[1\]"):
        read_profile_csv(p, num_blocks=2)


def test_profile_csv_bad_header(tmp_path):
    p = tmp_path / "profile.csv"
    p.write_text("gpu,level,batch,block,latency_us\n")
    with pytest.raises(SpecError, match=r"expected \['gpu', 'vgpu'"):
        read_profile_csv(p, num_blocks=1)


@pytest.mark.artifact
def test_artifact_import_roundtrip(artifact_dir, tmp_path):
    prof = load_artifact_model(artifact_dir, "repvgg-b3")
    assert prof.num_blocks == 10
    assert prof.gpus() == ["L4", "P4", "T4", "V100"]
    assert prof.levels("P4") == [1] and prof.levels("T4") == [1, 2, 3, 4]
    assert prof.batches("L4", 1) == tuple(range(1, 9)) and prof.batches("L4", 2) == (1, 2, 3, 4)
    assert prof.batches("L4", 3) == (1, 2)
    first_row = (artifact_dir / "block-timing" / "repvgg-b3-L4-1.csv").read_text().splitlines()[0].split(",")
    assert prof.block_latency_us("L4", 1, 3, 0) == float(first_row[2])
    cut0 = int((artifact_dir / "cut-bytes" / "repvgg-b3.csv").read_text().split()[0])
    assert prof.cut_bytes(0) == cut0
    saved = prof.save(tmp_path / "repvgg-b3")
    again = load_profile(saved)
    assert again.table == prof.table and again.manifest == prof.manifest


@pytest.mark.artifact
def test_import_ppipe_cli(artifact_dir, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "ppipe.cli", "import-ppipe", str(artifact_dir), "--model", "repvgg-b3", "-o", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert load_profile(tmp_path / "repvgg-b3").num_blocks == 10
    bad = subprocess.run(
        [sys.executable, "-m", "ppipe.cli", "import-ppipe", str(artifact_dir), "--model", "nope", "-o", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert "no block timings for model 'nope'" in bad.stderr and "Traceback" not in bad.stderr
