"""The plan: ``plan.yaml``, written by the planner and read by the data plane.

For each model: SLO, weight, planned throughput and its pooled pipelines. For each
pipeline: one unified batch size, its throughput and its partitions (block range, GPU
type, vGPU level, number of vGPUs, inference and transfer latency at that batch). Then
the solver's report, and the placement: which vGPU of which partition sits on which
physical GPU of which server.

A :class:`Plan` is immutable. Block ranges are inclusive and 0-based.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveInt, model_validator

from ppipe.spec.base import SCHEMA_VERSION, StrictModel, dump_yaml, load_yaml_model


class PartitionPlan(StrictModel):
    first_block: NonNegativeInt = Field(description="First block of the partition (0-based, inclusive).")
    last_block: NonNegativeInt = Field(description="Last block of the partition (inclusive).")
    gpu: str = Field(description="GPU type of the pool.")
    vgpu: PositiveInt = Field(le=4, description="vGPU level: each vGPU is a 1/vgpu share of a GPU.")
    count: PositiveInt = Field(description="Number of vGPUs in the pool.")
    infer_us: NonNegativeFloat = Field(description="Inference latency of the partition at the pipeline's batch, in us.")
    transfer_us: NonNegativeFloat = Field(
        default=0.0, description="Time to send the batch's feature map to the next partition, in us (0 for the last)."
    )
    throughput_rps: NonNegativeFloat = Field(description="Throughput of the whole pool at the pipeline's batch, req/s.")
    headroom: NonNegativeInt = Field(
        default=0,
        description="vGPUs of 'count' added by the headroom pass from GPUs the MILP left idle (0: all are the MILP's).",
    )

    @model_validator(mode="after")
    def _range(self) -> "PartitionPlan":
        if self.last_block < self.first_block:
            raise ValueError(f"last_block {self.last_block} < first_block {self.first_block}")
        return self


class PipelinePlan(StrictModel):
    batch: PositiveInt = Field(description="Unified batch size of every partition of the pipeline.")
    throughput_rps: NonNegativeFloat = Field(description="Planned throughput of the pipeline, req/s.")
    latency_us: NonNegativeFloat = Field(description="Sum of inference and transfer latencies at the batch, in us.")
    template: list[str] = Field(default_factory=list, description="GPU type per partition slot (informational).")
    partitions: list[PartitionPlan] = Field(min_length=1, description="Partitions in order.")

    @model_validator(mode="after")
    def _contiguous(self) -> "PipelinePlan":
        if self.partitions[0].first_block != 0:
            raise ValueError("the first partition must start at block 0")
        for a, b in zip(self.partitions, self.partitions[1:]):
            if b.first_block != a.last_block + 1:
                raise ValueError(f"partitions not contiguous: block {a.last_block} then {b.first_block}")
        return self


class ModelPlan(StrictModel):
    name: str = Field(description="Model name (from its model.yaml).")
    profile: str = Field(description="Model profile folder, relative to plan.yaml or absolute.")
    slo_ms: float = Field(gt=0, description="End-to-end latency SLO in ms (the runtime deadline = arrival + SLO).")
    weight: float = Field(gt=0, description="Workload weight of the model.")
    throughput_rps: NonNegativeFloat = Field(description="Planned throughput of the model, req/s (sum over pipelines).")
    pipelines: list[PipelinePlan] = Field(default_factory=list, description="Pooled pipelines.")


class SolverReport(StrictModel):
    name: str = Field(description="Solver used (highs, cbc, gurobi, or 'none' for closed-form planners).")
    status: Literal["optimal", "time_limit", "feasible", "heuristic"] = Field(description="Outcome of the solve.")
    gap: NonNegativeFloat = Field(default=0.0, description="Relative MIP gap at the end (0 when proven optimal).")
    seconds: NonNegativeFloat = Field(description="Wall time of building and solving the model, in s.")
    objective: float = Field(description="Objective value.")
    columns: NonNegativeInt = Field(default=0, description="Number of MILP columns (configurations).")
    method: str = Field(
        default="",
        description="What proved the status: '' = the solver's own search (branch and bound); "
        "'highs incumbent + cover bound' or 'highs incumbent + price bound' = HiGHS's plan, proven within "
        "the gap by that bound of ppipe's; 'LP-support incumbent + LP bound' or 'LP-support incumbent + cover "
        "bound' = the best plan over the configurations the LP relaxation uses, proven by the relaxation's "
        "bound or the cover bound, with no branch and bound on the whole MILP (docs/planning-model.md, "
        "'Bounds'). With status time_limit: what proved the gap reported.",
    )
    nodes: int = Field(default=-1, ge=-1, description="Branch-and-bound nodes of the final solve (-1: not reported).")
    lp_iterations: int = Field(default=-1, ge=-1, description="Simplex iterations of the final solve (-1: not reported).")


class PlanSettings(StrictModel):
    planner: str = Field(description="ppipe | np | dart-r.")
    formulation: str = Field(description="ppipe (default) or ppipe-atc25 (the paper's).")
    gpu_rule: str = Field(description="physical (packing) or paper.")
    configs_per_template: str = Field(default="many", description="'many' or 'one' (the paper).")
    objective: str = Field(description="Objective name.")
    margin: float = Field(ge=0, lt=1, description="Share of the SLO the planner keeps free.")
    max_partitions: PositiveInt = Field(description="At most this many partitions per pipeline.")
    batch_build: bool = Field(default=False, description="Whether the batch-gathering estimate was applied.")
    headroom_util: float | None = Field(
        default=None,
        ge=0,
        lt=1,
        description="Utilization target of the headroom pass (idle GPUs -> extra vGPUs for pools busier than this); "
        "None: no headroom pass.",
    )


class VgpuPlacement(StrictModel):
    model: str = Field(description="Model name.")
    pipeline: NonNegativeInt = Field(description="Index of the pipeline in the model's list.")
    partition: NonNegativeInt = Field(description="Index of the partition in the pipeline.")
    replica: NonNegativeInt = Field(description="Index of this vGPU within the partition's pool.")
    server: str = Field(description="Server name '<group>-<i>' of the cluster.")
    gpu_index: NonNegativeInt = Field(description="GPU index on the server.")
    vgpu: PositiveInt = Field(le=4, description="vGPU level (share 1/vgpu of the GPU).")
    slot: NonNegativeInt = Field(description="Slot of this vGPU on its GPU (0-based).")

    @property
    def vgpu_id(self) -> str:
        return f"{self.server}/gpu{self.gpu_index}/s{self.slot}"


class Plan(StrictModel):
    version: int = Field(default=SCHEMA_VERSION, description="File format version.")
    cluster: str = Field(description="Cluster name.")
    cluster_file: str | None = Field(default=None, description="Cluster YAML the plan was made for.")
    settings: PlanSettings = Field(description="Planner settings.")
    solver: SolverReport = Field(description="How the plan was solved.")
    models: list[ModelPlan] = Field(min_length=1, description="Per-model plans.")
    gpus_used: dict[str, int] = Field(default_factory=dict, description="Physical GPUs used per type.")
    placement: list[VgpuPlacement] = Field(default_factory=list, description="vGPU -> physical GPU placement.")

    def model(self, name: str) -> ModelPlan:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def placements_of(self, model: str, pipeline: int, partition: int) -> list[VgpuPlacement]:
        out = [p for p in self.placement if p.model == model and p.pipeline == pipeline and p.partition == partition]
        return sorted(out, key=lambda p: p.replica)

    def save(self, path: str | Path) -> Path:
        dump_yaml(self.model_dump(mode="json"), path)
        return Path(path)


def load_plan(path: str | Path) -> Plan:
    return load_yaml_model(Plan, path)
