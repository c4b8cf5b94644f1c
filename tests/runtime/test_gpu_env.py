"""A worker pins its own GPU (issue 23): CUDA_VISIBLE_DEVICES holds whatever Ray set."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from ppipe.runtime.launch.deploy import worker_env
from ppipe.runtime.workers.worker import WorkerSpec, pin_cuda_env


def _spec(gpu_index=3, vgpu=4, gpu="L4"):
    return WorkerSpec("s-0/gpu3/s0", "s-0", gpu_index, "m", 0, 0, 0, 0, gpu, vgpu, "m")


def test_the_worker_overrides_what_ray_set_for_a_num_gpus_0_actor(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # what older Ray left for actors with num_gpus=0
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    pin_cuda_env(worker_env(_spec(), "tensorrt"))
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"


def test_cpu_and_emulated_workers_leave_the_environment_alone(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    pin_cuda_env(worker_env(_spec(gpu="cpu"), "ort"))
    pin_cuda_env(worker_env(_spec(), "emulated"))
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "7"


def test_a_pin_after_cuda_initialized_is_refused_not_ignored(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    fake_torch = SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: True))  # a FAKE torch module
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    with pytest.raises(RuntimeError, match="already initialized"):
        pin_cuda_env(worker_env(_spec(), "torch"))


MPS_PROFILE = "measured: TensorRT 10 on an L4; level v = v processes at once under MPS at 100/v% of the SMs"
SLICED_PROFILE = "measured: PyTorch 2.11 on an L4; level v = v processes at once, time-sliced by the GPU (no MPS daemon ran: not MPS)"


def test_a_gpu_share_profiled_under_mps_is_refused_where_no_mps_daemon_runs():
    from ppipe.errors import UserError
    from ppipe.runtime.workers.worker import check_gpu_sharing

    with pytest.raises(UserError, match=r"1/4 MPS share of a L4.*no MPS control daemon") as exc:
        check_gpu_sharing(_spec(vgpu=4), True, MPS_PROFILE, lambda: False)
    assert "nvidia-cuda-mps-control -d" in exc.value.fix
    estimated = "estimated: roofline of the block ONNX graphs on the L4 spec sheet, not measured"  # fitted on MPS timings
    with pytest.raises(UserError):
        check_gpu_sharing(_spec(vgpu=2), True, estimated, lambda: False)


def test_mps_running_level_1_cpu_workers_and_time_sliced_profiles_pass_the_sharing_check():
    from ppipe.runtime.workers.worker import check_gpu_sharing

    asked = []

    def mps(answer):
        return lambda: asked.append(answer) or answer

    check_gpu_sharing(_spec(vgpu=4), True, MPS_PROFILE, mps(True))
    check_gpu_sharing(_spec(vgpu=1), True, MPS_PROFILE, mps(False))  # a whole GPU shares nothing
    check_gpu_sharing(_spec(vgpu=4, gpu="cpu"), False, "", mps(False))  # off the GPU
    check_gpu_sharing(_spec(vgpu=4), True, SLICED_PROFILE, mps(False))  # served as it was profiled
    assert asked == [True]  # the daemon is asked only when it decides
