"""Fixtures of the simulator tests; the tiny plan and the fake scheduler live in sim_fakes.py."""

from __future__ import annotations

import pytest
from sim_fakes import tiny_cluster, tiny_plan, tiny_profile


@pytest.fixture
def tiny():
    return tiny_plan(), {"tiny": tiny_profile()}, tiny_cluster()
