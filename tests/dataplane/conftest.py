"""Fixtures for the data-plane tests: hand-built worlds from ppipe.dataplane.testing."""

from __future__ import annotations

import pytest

from ppipe.dataplane.testing import fig5_world


@pytest.fixture
def fig5():
    """Factory: ``fig5(slo_ms=..., batch=..., policy=..., **options) -> (scheduler, clock)``."""
    return fig5_world
