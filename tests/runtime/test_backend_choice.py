"""ppipe serve --backend auto: no GPU plan runs on the CPU without saying so (ppipe.runtime.workers.backend_choice)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from ppipe.errors import UserError
from ppipe.runtime.workers.backend_choice import choose_backend


def probes(*available: str) -> dict:
    return {name: (lambda name=name: name in available) for name in ("tensorrt", "torch", "ort")}


def test_cpu_pools_run_on_onnxruntime():
    assert choose_backend("auto", {"cpu"}, probes()) == ("ort", None)


@pytest.mark.parametrize("available, chosen", [(("tensorrt", "torch", "ort"), "tensorrt"), (("torch", "ort"), "torch"), (("ort",), "ort")])
def test_gpu_pools_take_the_best_gpu_backend_installed(available, chosen):
    assert choose_backend("auto", {"L4", "T4"}, probes(*available)) == (chosen, None)


def test_gpu_pools_with_no_gpu_backend_are_refused_with_the_extra_to_install():
    with pytest.raises(UserError) as err:
        choose_backend("auto", {"L4", "T4"}, probes())
    assert "L4, T4" in err.value.message and "ppipe[gpu]" in err.value.fix and "ppipe[torch]" in err.value.fix
    assert "--backend emulated" in err.value.fix


def test_an_explicit_ort_on_gpu_pools_runs_on_the_cpu_with_a_warning():
    backend, warning = choose_backend("ort", {"L4"}, probes())
    assert backend == "ort" and "on the CPU" in warning
    assert choose_backend("ort", {"L4"}, probes("ort")) == ("ort", None)
    assert choose_backend("emulated", {"L4"}, probes()) == ("emulated", None)


def test_ppipe_serve_refuses_the_default_gpu_plan_here_before_starting_anything(tmp_path, monkeypatch):
    from ppipe.cli import main
    from ppipe.planner.api import plan as make_plan
    from ppipe.runtime.workers import backend_choice

    monkeypatch.setattr(backend_choice, "PROBES", probes())  # as on a host without GPU backends
    make_plan().save(tmp_path / "plan.yaml")
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "plan.yaml")])
    assert r.exit_code == 2 and "no GPU backend can run here" in r.output and "ppipe[gpu]" in r.output, r.output
