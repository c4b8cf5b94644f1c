"""One Ray actor per vGPU: runs its partition and hands the batch to the next worker.

A batch travels along its reserved path without going back through the frontend: the
frontend calls the first worker; worker i runs its partition, casts floating feature maps
to fp16 and calls worker i+1 itself, passing the arrays as call arguments (Ray puts large
ones in its object store, so worker i+1 reads them from there, on its own node or over the
network). Each call returns ``(report, next)``: ``report`` says when the stage really ran
(wall-clock stamps) and ``next`` is the ObjectRef of the following stage's call, or, for
the last stage, the model's outputs. The frontend walks that chain, feeding each report
to the scheduler as soon as its stage ends.

The actor is asynchronous so that ``ping`` answers while a batch runs; an asyncio lock
makes batches on one vGPU run one at a time, in arrival order.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ppipe.runtime.clock import wall_us


@dataclass(frozen=True)
class WorkerSpec:
    """What one vGPU worker runs (from the plan's placement)."""

    vgpu_id: str
    server: str
    gpu_index: int
    model: str
    pipeline: int
    partition: int
    first_block: int
    last_block: int
    gpu: str
    vgpu: int
    profile_dir: str


def to_wire(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Feature maps cross partitions as fp16 (floating tensors only; integers unchanged)."""
    return {k: (v.astype(np.float16) if v.dtype.kind == "f" and v.dtype != np.float16 else v) for k, v in tensors.items()}


class VgpuWorker:
    """The body of a vGPU actor (wrapped with ``ray.remote`` by :mod:`ppipe.runtime.deploy`).

    Args:
        spec: the vGPU and the partition it runs.
        backend: ``ort``, ``tensorrt`` or ``emulated``.
        backend_options: passed to :func:`ppipe.runtime.backends.make_backend`.
    """

    def __init__(self, spec: WorkerSpec, backend: str, backend_options: dict[str, Any] | None = None):
        from ppipe.runtime.backends import make_backend
        from ppipe.spec.profile import load_profile

        self.spec = spec
        profile = load_profile(spec.profile_dir)
        self.backend = make_backend(
            backend, profile, spec.gpu, spec.vgpu, spec.first_block, spec.last_block,
            **{k: v for k, v in (backend_options or {}).items() if k != "emulate_network"},
        )
        # the emulated backend rehearses a cluster: feature maps take the planned NIC time
        self.emulate_network = backend == "emulated" and bool((backend_options or {}).get("emulate_network", True))
        self._peers: dict[str, Any] = {}
        self._lock: asyncio.Lock | None = None
        self.batches = 0

    def set_peers(self, peers: dict[str, Any]) -> int:
        """Handles of the other workers, by vGPU id (to forward batches to)."""
        self._peers = dict(peers)
        return len(self._peers)

    async def ping(self) -> dict[str, Any]:
        """Liveness probe; also tells where the worker runs."""
        import ray

        return {
            "vgpu_id": self.spec.vgpu_id,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "batches": self.batches,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "mps_thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        }

    async def run_stage(
        self,
        batch_id: int,
        route: list[str],
        index: int,
        inputs: dict[str, np.ndarray],
        batch: int,
        sent_wall_us: float,
        timing: list[tuple[float | None, float, float]] | None = None,
    ) -> tuple[dict[str, Any], Any]:
        """Run stage ``index`` of ``route`` on ``inputs``; forward to the next stage.

        Args:
            timing: per stage, the reservation in wall-clock us: ``(transfer_start,
                transfer_us, start)``. A stage does not start before its reserved start
                (as in the simulator): running a batch early could push an earlier-reserved
                batch, whose data is still on its way, past its slot. With
                ``emulate_network`` (emulated backend), a feature map from another stage
                also "arrives" no sooner than ``max(sent, transfer_start) + transfer_us``.

        Returns:
            ``(report, next)``: ``report`` with wall-clock ``start_us``/``end_us`` and the
            transfer's ``transfer_start_us`` (sender's stamp) / ``transfer_end_us`` (arrival
            here); ``next`` is the next stage's ObjectRef, or the outputs if this is the last.
        """
        import ray

        received = wall_us()
        if route[index] != self.spec.vgpu_id:
            raise RuntimeError(f"batch {batch_id} stage {index} is for {route[index]}, not {self.spec.vgpu_id}")
        t_xfer_start = t_end_xfer = None
        not_before = received
        if timing is not None:
            xfer_start, xfer_us, planned_start = timing[index]
            if index > 0 and self.emulate_network and xfer_us > 0:
                t_xfer_start = max(sent_wall_us, xfer_start if xfer_start is not None else sent_wall_us)
                t_end_xfer = t_xfer_start + xfer_us
                not_before = max(not_before, t_end_xfer)
            not_before = max(not_before, planned_start)
        wait_s = (not_before - wall_us()) / 1e6
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            start = wall_us()
            outputs = await self.backend.run(inputs, batch)
            end = wall_us()
        self.batches += 1
        report = {
            "batch_id": batch_id,
            "partition": index,
            "vgpu_id": self.spec.vgpu_id,
            "start_us": start,
            "end_us": end,
            "transfer_start_us": (t_xfer_start if t_end_xfer is not None else sent_wall_us) if index > 0 else None,
            "transfer_end_us": (t_end_xfer if t_end_xfer is not None else received) if index > 0 else None,
            "node_id": ray.get_runtime_context().get_node_id(),
        }
        if index + 1 == len(route):
            return report, outputs
        nxt = self._peers.get(route[index + 1])
        if nxt is None:
            raise RuntimeError(f"worker {self.spec.vgpu_id} has no handle for the next stage {route[index + 1]}")
        ref = nxt.run_stage.remote(batch_id, route, index + 1, to_wire(outputs), batch, wall_us(), timing)
        return report, ref
