"""The scheduler's host imports no Ray, no HTTP server and no torch, and reads no clock itself.

Every module under ``ppipe/runtime/scheduler/``, imported alone in a fresh interpreter,
leaves ``ray``, ``starlette`` and ``torch`` out of ``sys.modules``: the host decides on
metadata and reaches workers only through :class:`~ppipe.runtime.launch.handle.WorkerHandle`,
so it runs the same under any launcher (in process, Ray) and behind any ingress. Time
comes from the clock it is given (``Runtime(clock_factory=...)``), so no module of it
imports ``time`` or the wall clock's ``wall_us``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import ppipe.runtime.scheduler

FORBIDDEN = ("ray", "starlette", "torch")

SCHEDULER = Path(ppipe.runtime.scheduler.__file__).parent

# Run in a fresh interpreter: import argv[1], print the forbidden packages it left in sys.modules.
_PROBE = r"""
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(top for top in sys.argv[2].split(",") if top in sys.modules)))
"""


def _modules() -> list[str]:
    return sorted("ppipe.runtime.scheduler" + ("" if f.stem == "__init__" else "." + f.stem) for f in SCHEDULER.glob("*.py"))


def test_every_scheduler_module_is_checked():
    assert {"ppipe.runtime.scheduler", "ppipe.runtime.scheduler.host", "ppipe.runtime.scheduler.budgets",
            "ppipe.runtime.scheduler.metrics"} <= set(_modules())


@pytest.mark.parametrize("module", _modules())
def test_a_scheduler_module_imports_no_ray_starlette_or_torch(module):
    run = subprocess.run([sys.executable, "-c", _PROBE, module, ",".join(FORBIDDEN)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"importing {module} failed:\n{run.stderr[-3000:]}"
    imported = json.loads(run.stdout.strip().splitlines()[-1])
    assert imported == [], f"importing {module} imports {', '.join(imported)} (find the chain with: python -X importtime -c 'import {module}')"


def test_no_scheduler_module_reads_the_wall_clock_itself():
    offenders = []
    for f in sorted(SCHEDULER.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                offenders += [(f.name, a.name) for a in node.names if a.name.split(".")[0] in ("time", "datetime")]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                if (node.module or "").split(".")[0] in ("time", "datetime"):
                    offenders.append((f.name, node.module))
                offenders += [(f.name, f"{node.module}.wall_us") for a in node.names if a.name == "wall_us"]
    assert offenders == []
