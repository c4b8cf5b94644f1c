"""A worker pins its own GPU (issue 23): CUDA_VISIBLE_DEVICES holds whatever Ray set."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from ppipe.runtime.deploy import worker_env
from ppipe.runtime.worker import WorkerSpec, pin_cuda_env


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
