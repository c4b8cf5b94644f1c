"""Cluster description: GPU types, servers, NICs and the mapping to Ray nodes.

A cluster file (``clusters/*.yaml``) looks like::

    version: 1
    name: HC2-S
    bandwidth_efficiency: 0.2        # effective NIC bandwidth = nominal x this
    gpu_types:
      - {name: L4, vgpu_levels: [1, 2, 3, 4], price_per_gpu: 1.0}
      - {name: T4, vgpu_levels: [1, 2, 3, 4], price_per_gpu: 1.0}
    servers:
      - {name: l4, gpu_type: L4, gpus_per_server: 4, count: 1, nic_bandwidth_gbps: 50}
      - {name: t4, gpu_type: T4, gpus_per_server: 2, count: 6, nic_bandwidth_gbps: 50}

Servers are given in groups; instance ``i`` of group ``l4`` is the server ``l4-i``.

The name ``local-gpu`` is no file: it is this machine's GPUs, found when it is loaded
(:mod:`ppipe.spec.local_gpu`).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from pydantic import Field, PositiveInt, field_validator, model_validator

from ppipe.errors import SpecError
from ppipe.spec.base import SCHEMA_VERSION, StrictModel, load_yaml_model
from ppipe.spec.local_gpu import LOCAL_GPU, is_local_gpu, local_gpu_cluster


class GpuType(StrictModel):
    name: str = Field(description="GPU type name as used in model profiles, e.g. 'L4', 'T4', 'cpu'.")
    vgpu_levels: list[int] = Field(
        default=[1],
        description="Allowed vGPU (MPS) levels: level v splits one GPU into v equal shares. Subset of 1..4.",
    )
    price_per_gpu: float = Field(
        default=1.0, ge=0, description="Cost of one GPU of this type per unit of time (for the cheapest-GPUs objective)."
    )
    memory_gib: float | None = Field(default=None, gt=0, description="GPU memory in GiB (informational).")

    @field_validator("vgpu_levels")
    @classmethod
    def _levels(cls, v: list[int]) -> list[int]:
        if not v or any(level not in (1, 2, 3, 4) for level in v) or len(set(v)) != len(v):
            raise ValueError("must be a non-empty list of distinct levels from 1, 2, 3, 4")
        return sorted(v)


class ServerGroup(StrictModel):
    name: str = Field(description="Group name; its servers are named '<name>-<i>' for i in 0..count-1.")
    gpu_type: str = Field(description="Type of every GPU on these servers (a name from gpu_types).")
    gpus_per_server: PositiveInt = Field(description="GPUs on one server of this group.")
    count: PositiveInt = Field(default=1, description="Number of such servers.")
    nic_bandwidth_gbps: float = Field(gt=0, description="Nominal NIC bandwidth of one server in Gbit/s (each way).")
    ray_resource: str | None = Field(
        default=None,
        description="Ray custom resource that marks the Ray nodes of this group (for `ppipe serve`); "
        "server i of the group must offer resource '<ray_resource>' (or '<ray_resource>-<i>' if present).",
    )


class ClusterSpec(StrictModel):
    version: int = Field(default=SCHEMA_VERSION, description="File format version.")
    name: str = Field(description="Cluster name.")
    description: str = Field(default="", description="Free text.")
    bandwidth_efficiency: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="Effective over nominal NIC bandwidth (the paper uses 0.2: 50 Gbit/s -> 10).",
    )
    gpu_types: list[GpuType] = Field(min_length=1, description="The GPU types of the cluster.")
    servers: list[ServerGroup] = Field(min_length=1, description="Server groups.")

    @model_validator(mode="after")
    def _check_refs(self) -> "ClusterSpec":
        names = [g.name for g in self.gpu_types]
        if len(set(names)) != len(names):
            raise ValueError(f"gpu_types: duplicate names in {names}")
        groups = [s.name for s in self.servers]
        if len(set(groups)) != len(groups):
            raise ValueError(f"servers: duplicate group names in {groups}")
        for s in self.servers:
            if s.gpu_type not in names:
                raise ValueError(f"servers '{s.name}': gpu_type '{s.gpu_type}' is not one of gpu_types {names}")
        return self

    # ---- derived views -------------------------------------------------------------
    def gpu_type(self, name: str) -> GpuType:
        for g in self.gpu_types:
            if g.name == name:
                return g
        raise KeyError(name)

    @cached_property
    def gpu_counts(self) -> dict[str, int]:
        """Physical GPUs per type."""
        counts = {g.name: 0 for g in self.gpu_types}
        for s in self.servers:
            counts[s.gpu_type] += s.gpus_per_server * s.count
        return counts

    def servers_of(self, gpu_type: str) -> list[ServerGroup]:
        return [s for s in self.servers if s.gpu_type == gpu_type]

    def gpus_per_server(self, gpu_type: str) -> int:
        """GPUs per server for a type (the largest group's value if groups differ)."""
        groups = self.servers_of(gpu_type)
        return max(groups, key=lambda s: s.count * s.gpus_per_server).gpus_per_server

    def effective_bandwidth_gbps(self, gpu_type: str) -> float:
        """Effective NIC bandwidth of the servers holding this type (smallest group's value)."""
        return min(s.nic_bandwidth_gbps for s in self.servers_of(gpu_type)) * self.bandwidth_efficiency

    def server_names(self) -> list[tuple[str, ServerGroup]]:
        """All servers as (name, group), in file order."""
        return [(f"{s.name}-{i}", s) for s in self.servers for i in range(s.count)]

    @property
    def total_gpus(self) -> int:
        return sum(self.gpu_counts.values())


def builtin_dirs(kind: str) -> list[Path]:
    """Folders that hold built-in ``clusters`` or ``models``: the source tree, then the installed share."""
    import sys

    here = Path(__file__).resolve().parent.parent.parent / kind
    share = Path(sys.prefix) / "share" / "ppipe" / kind
    return [p for p in (here, share) if p.is_dir()]


def resolve_cluster_path(ref: str | Path) -> Path:
    """A cluster file path, or the name of a built-in cluster (e.g. ``HC2-S``).

    Raises:
        SpecError: no such file or built-in cluster, or ``local-gpu``, which has no file.
    """
    p = Path(ref)
    if p.exists():
        return p
    if is_local_gpu(ref):
        raise SpecError(f"cluster '{LOCAL_GPU}' is detected when loaded and has no file",
                        fix=f"load it with load_cluster('{LOCAL_GPU}'), which detects this machine's GPUs")
    for d in builtin_dirs("clusters"):
        for cand in (d / f"{ref}.yaml", d / str(ref)):
            if cand.exists():
                return cand
    known = sorted({c.stem for d in builtin_dirs("clusters") for c in d.glob("*.yaml")})
    raise SpecError(
        "no such cluster file or built-in cluster",
        fix=f"give a path to a cluster YAML or one of the built-in clusters: {', '.join(known)}, "
        f"or {LOCAL_GPU} (this machine's GPUs)",
        file=str(ref),
    )


def load_cluster(ref: str | Path) -> ClusterSpec:
    """Load a cluster by path or built-in name; ``local-gpu`` is this machine's GPUs, detected now."""
    if is_local_gpu(ref):
        return local_gpu_cluster()
    return load_yaml_model(ClusterSpec, resolve_cluster_path(ref))
