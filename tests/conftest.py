"""Shared fixtures. Tiers: plain unit tests; `ray` integration tests; `gpu` tests (skip
without CUDA); `artifact` tests (skip without ../shared/data/ppipe-artifact)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ARTIFACT = Path(os.environ.get("PPIPE_ARTIFACT", REPO.parent / "shared" / "data" / "ppipe-artifact"))


@pytest.fixture(scope="session")
def artifact_dir() -> Path:
    """The PPipe artifact folder; tests that use it skip where it is absent."""
    if not (ARTIFACT / "block-timing").is_dir():
        pytest.skip(f"PPipe artifact not found at {ARTIFACT} (set PPIPE_ARTIFACT to its folder)")
    return ARTIFACT


@pytest.fixture(scope="session")
def artifact_profiles(artifact_dir, tmp_path_factory):
    """Import a few artifact models once per session; returns {name: folder}."""
    from ppipe.spec.artifact import import_artifact

    out = tmp_path_factory.mktemp("artifact-profiles")
    names = ["repvgg-b3", "googlenet-v3-pytorch", "colorization-v2", "atss_r101_fpn_1x_coco"]
    return {p.name: p for p in import_artifact(artifact_dir, out, names)}


def has_cuda() -> bool:
    try:
        import ctypes

        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


requires_cuda = pytest.mark.skipif(not has_cuda(), reason="needs an NVIDIA GPU with CUDA (none on this machine)")
