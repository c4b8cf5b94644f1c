"""The ``local-gpu`` cluster: GPU names to type names, the cluster built from a device list,
detection through fakes of NVML's and torch.cuda's real calls, and the no-GPU error through
the CLI. No test here needs a GPU."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from ppipe.cli import main
from ppipe.errors import NotAvailableError, SpecError
from ppipe.spec import load_cluster, load_plan
from ppipe.spec import cluster as cluster_module
from ppipe.spec.cluster import resolve_cluster_path
from ppipe.spec.local_gpu import (
    Detection,
    Device,
    TimeSlicedWarning,
    build_cluster,
    detect_devices,
    gpu_type_name,
    local_gpu_cluster,
)

SHEET = ["P4", "T4", "V100", "L4", "A10", "A100", "H100"]


@pytest.mark.parametrize("name,want", [
    ("NVIDIA H100 80GB HBM3", "H100"),
    ("NVIDIA H100 PCIe", "H100"),
    ("Tesla T4", "T4"),
    ("NVIDIA L4", "L4"),
    ("Tesla V100-SXM2-16GB", "V100"),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A10", "A10"),
    ("Tesla P4", "P4"),
])
def test_marketing_names_map_to_the_sheet_s_types(name, want):
    assert gpu_type_name(name, SHEET) == want


@pytest.mark.parametrize("name,want", [
    ("NVIDIA H200", "H200"),
    ("NVIDIA L40S", "L40S"),  # a word, not a substring: no L4
    ("Tesla P40", "P40"),  # nor a P4
    ("NVIDIA A10G", "A10G"),
    ("NVIDIA RTX A6000", "A6000"),
    ("NVIDIA GeForce RTX 4090", "RTX-4090"),
])
def test_a_gpu_off_the_sheet_gets_a_sanitized_name(name, want):
    assert gpu_type_name(name, SHEET) == want


def test_the_shipped_sheet_is_the_default():
    assert gpu_type_name("NVIDIA A100-SXM4-40GB") == "A100"


def test_one_server_group_per_type_with_its_count():
    devices = [Device(0, "NVIDIA H200", 140.0), Device(1, "Tesla T4", 15.0), Device(2, "NVIDIA H200", 140.0)]
    c = build_cluster(devices, mps=True, known=SHEET)
    assert c.name == "local-gpu"
    assert c.gpu_counts == {"H200": 2, "T4": 1}
    assert [(s.name, s.gpu_type, s.gpus_per_server, s.count) for s in c.servers] == [("h200", "H200", 2, 1), ("t4", "T4", 1, 1)]
    assert all(g.vgpu_levels == [1, 2, 3, 4] for g in c.gpu_types)
    assert c.gpu_type("T4").memory_gib == 15.0
    assert "devices 0, 2" in c.description and "MPS shares" in c.description


def test_without_mps_the_description_says_time_sliced():
    c = build_cluster([Device(0, "NVIDIA L4")], mps=False, known=SHEET)
    assert "time-sliced, not MPS" in c.description and "nvidia-cuda-mps-control -d" in c.description


def test_time_sliced_levels_are_warned_about_and_mps_ones_are_not():
    found = lambda: Detection((Device(0, "NVIDIA L4"),), "NVML")  # noqa: E731
    with pytest.warns(TimeSlicedWarning, match="time-sliced, not MPS"):
        local_gpu_cluster(found, mps_running=lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert local_gpu_cluster(found, mps_running=lambda: True).gpu_counts == {"L4": 1}


def _nvml(names: list[str], init_error: Exception | None = None):
    """A stand-in for the pynvml module with the calls detection makes (names as bytes, as old releases return them)."""
    calls = []

    def init():
        calls.append("init")
        if init_error:
            raise init_error

    return SimpleNamespace(
        nvmlInit=init,
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: len(names),
        nvmlDeviceGetHandleByIndex=lambda i: ("handle", i),
        nvmlDeviceGetName=lambda h: names[h[1]].encode(),
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=16 * 2**30),
        calls=calls,
    )


def _torch(names: list[str]):
    cuda = SimpleNamespace(device_count=lambda: len(names), get_device_name=lambda i: names[i],
                           get_device_properties=lambda i: SimpleNamespace(total_memory=8 * 2**30))
    return SimpleNamespace(cuda=cuda)


def _importer(**modules):
    def import_module(name):
        if modules.get(name) is None:
            raise ModuleNotFoundError(name)
        return modules[name]

    return import_module


def test_nvml_is_asked_first_and_shut_down_after():
    nvml = _nvml(["Tesla T4", "Tesla T4"])
    found = detect_devices(_importer(pynvml=nvml, torch=_torch(["NVIDIA H200"])))
    assert found.source == "NVML" and [d.name for d in found.devices] == ["Tesla T4", "Tesla T4"]
    assert found.devices[1] == Device(1, "Tesla T4", 16.0)
    assert nvml.calls == ["init", "shutdown"]


def test_torch_cuda_when_nvml_fails_or_is_missing():
    failing = _nvml([], init_error=RuntimeError("NVML Shared Library Not Found"))
    found = detect_devices(_importer(pynvml=failing, torch=_torch(["NVIDIA H200"])))
    assert found.source == "torch.cuda" and found.devices == (Device(0, "NVIDIA H200", 8.0),)
    assert "NVML Shared Library Not Found" in found.tried[0]
    assert detect_devices(_importer(torch=_torch(["NVIDIA L4"]))).devices[0].name == "NVIDIA L4"


def test_nothing_found_says_what_was_looked_for():
    found = detect_devices(_importer(pynvml=_nvml([]), torch=_torch([])))
    assert found.devices == () and found.tried == ("NVML: no GPU", "torch.cuda: no GPU")
    with pytest.raises(NotAvailableError, match=r"no GPU found .*NVML: no GPU; torch.cuda: no GPU"):
        local_gpu_cluster(lambda: found, mps_running=lambda: False)


def test_local_gpu_has_no_file():
    with pytest.raises(SpecError, match="detected when loaded and has no file"):
        resolve_cluster_path("local-gpu")


def _machine(monkeypatch, detect, mps: bool) -> None:
    """Make ``load_cluster('local-gpu')`` detect through ``detect`` (this host may have a GPU)."""
    monkeypatch.setattr(cluster_module, "local_gpu_cluster", lambda: local_gpu_cluster(detect, lambda: mps))


@pytest.fixture
def no_gpu(monkeypatch):
    _machine(monkeypatch, lambda: detect_devices(_importer()), mps=False)


def test_no_gpu_is_exit_2_with_the_fix_and_no_traceback(no_gpu):
    res = CliRunner().invoke(main, ["plan", "local-gpu", "resnet50", "--quiet"])
    assert res.exit_code == 2, res.output
    assert "no GPU found" in res.output and "'pynvml' is not installed" in res.output and "'torch' is not installed" in res.output
    assert "To fix:" in res.output and "local-cpu" in res.output and "nvidia-ml-py" in res.output
    assert "Traceback" not in res.output


@pytest.fixture
def two_t4(monkeypatch):
    _machine(monkeypatch, lambda: Detection((Device(0, "Tesla T4"), Device(1, "Tesla T4")), "NVML"), mps=True)


def test_a_plan_on_local_gpu_names_the_cluster_and_simulate_detects_it_again(two_t4, tmp_path):
    plan_file = tmp_path / "plan.yaml"
    res = CliRunner().invoke(main, ["plan", "local-gpu", "resnet50", "--slo-ms", "resnet50=40", "--quiet", "-o", str(plan_file)])
    assert res.exit_code == 0, res.output
    plan = load_plan(plan_file)
    assert plan.cluster == "local-gpu" and plan.cluster_file is None
    assert {p.server for p in plan.placement} == {"t4-0"}
    assert load_cluster("local-gpu").gpu_counts == {"T4": 2}
    res = CliRunner().invoke(main, ["simulate", str(plan_file), "--load", "0.5"])
    assert res.exit_code == 0, res.output
