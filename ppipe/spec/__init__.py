"""Schemas and file I/O: clusters, model profiles, plans (docs/formats.md)."""

from ppipe.spec.cluster import ClusterSpec, GpuType, ServerGroup, load_cluster, resolve_cluster_path
from ppipe.spec.plan import (
    ModelPlan,
    PartitionPlan,
    PipelinePlan,
    Plan,
    PlanSettings,
    SolverReport,
    VgpuPlacement,
    load_plan,
)
from ppipe.spec.profile import BlockSpec, ModelManifest, ModelProfile, SourceSpec, TensorSpec, load_profile, load_profiles

__all__ = [
    "BlockSpec",
    "ClusterSpec",
    "GpuType",
    "ModelManifest",
    "ModelPlan",
    "ModelProfile",
    "PartitionPlan",
    "PipelinePlan",
    "Plan",
    "PlanSettings",
    "ServerGroup",
    "SolverReport",
    "SourceSpec",
    "TensorSpec",
    "VgpuPlacement",
    "load_cluster",
    "load_plan",
    "load_profile",
    "load_profiles",
    "resolve_cluster_path",
]
