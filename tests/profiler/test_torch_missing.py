"""Without torch (CI's .[test]), the torch paths fail with a NotAvailableError naming the extra."""

from __future__ import annotations

import sys

import pytest

from ppipe.errors import NotAvailableError


@pytest.fixture
def no_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError


def test_the_torch_backend_names_the_extra_to_install(no_torch, tmp_path):
    from ppipe.profiler.torch_backend import TorchTimer

    with pytest.raises(NotAvailableError, match=r"needs PyTorch") as info:
        TorchTimer()
    assert "pip install 'ppipe[torch]'" in info.value.fix


def test_profile_torch_names_the_extra_to_install(no_torch, tmp_path):
    from click.testing import CliRunner

    from ppipe.cli import main

    res = CliRunner().invoke(main, ["profile", "--torch", "json:loads", "--input-shape", "3,8,8", "-o", str(tmp_path / "o")])
    assert res.exit_code != 0 and "ppipe[torch]" in res.output, res.output
