"""Each role of the runtime imports only what its role needs: every module of a role,
imported alone in a fresh interpreter, leaves the role's forbidden packages out of
``sys.modules`` and does not even try to import them (so the check holds where one is not
installed). When a module fails here, the message names the lines of ppipe that led to the
import, outermost first.

- ingress (HTTP, gRPC, protocol): no Ray, no torch. A frontend process that imported them
  would pay their import time and memory in every frontend shard, and tie the APIs to one
  launcher.
- the scheduler's host: no Ray, no HTTP server, no torch. It decides on metadata and
  reaches workers only through :class:`~ppipe.runtime.launch.handle.WorkerHandle`, so it
  runs the same under any launcher and behind any ingress; and it reads no clock itself
  (``Runtime(clock_factory=...)``).
- workers: no Ray (the launcher's), no HTTP (the ingress's), no torch (one backend's,
  loaded when a worker is built with it; ``torch_backend`` and ``cuda_ipc`` are that
  backend's own).
- the wire: no Ray, no HTTP server, no torch: message types and connections only.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import ppipe

PPIPE = Path(ppipe.__file__).parent
RUNTIME = PPIPE / "runtime"

ROLES = {  # folder of ppipe/runtime -> (packages it must not import, modules exempt)
    "ingress": (("ray", "torch"), ()),
    "scheduler": (("ray", "starlette", "torch"), ()),
    "workers": (("ray", "starlette", "torch"), ("torch_backend", "cuda_ipc")),
    "wire": (("ray", "starlette", "torch"), ()),
}

# Run in the fresh interpreter: import argv[1], then say which forbidden packages it
# imported or tried to, with the ppipe lines on the stack of the first such import.
_PROBE = r"""
import importlib, json, sys, traceback

forbidden, ppipe_dir = tuple(sys.argv[2].split(",")), sys.argv[3]
chains = {}

class Watch:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in forbidden and top not in chains:
            root = ppipe_dir.rsplit("/", 1)[0]
            chains[top] = [f"{f.filename[len(root) + 1:]}:{f.lineno}" for f in traceback.extract_stack()
                           if f.filename.startswith(ppipe_dir + "/")]
        return None  # the import itself goes on as it would

sys.meta_path.insert(0, Watch())
importlib.import_module(sys.argv[1])
print(json.dumps({top: chains.get(top, []) for top in forbidden if top in chains or top in sys.modules}))
"""


def _modules(role: str) -> list[str]:
    exempt = ROLES[role][1]
    names = []
    for path in sorted((RUNTIME / role).rglob("*.py")):
        parts = path.relative_to(PPIPE.parent).with_suffix("").parts
        if parts[-1] not in exempt:
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


CASES = [(role, module) for role in ROLES for module in _modules(role)]


def test_every_role_and_its_main_modules_are_checked():
    checked = {m for _, m in CASES}
    assert {"ppipe.runtime.ingress.http_server", "ppipe.runtime.ingress.grpc_server", "ppipe.runtime.scheduler.host",
            "ppipe.runtime.scheduler.batches", "ppipe.runtime.workers.worker", "ppipe.runtime.workers.stage_server",
            "ppipe.runtime.wire.datapath", "ppipe.runtime.wire.messages"} <= checked


@pytest.mark.parametrize("role, module", CASES)
def test_a_module_imports_nothing_its_role_forbids(role, module):
    forbidden = ROLES[role][0]
    run = subprocess.run([sys.executable, "-c", _PROBE, module, ",".join(forbidden), str(PPIPE)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"importing {module} failed:\n{run.stderr[-3000:]}"
    imported = json.loads(run.stdout.strip().splitlines()[-1])
    assert imported == {}, f"importing {module} ({role}) imports {', '.join(imported)}, by way of: " + "; ".join(
        f"{top}: {' -> '.join(chain) or '(no ppipe line: a dependency)'}" for top, chain in imported.items())


def test_no_scheduler_module_reads_the_wall_clock_itself():
    offenders = []
    for f in sorted((RUNTIME / "scheduler").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                offenders += [(f.name, a.name) for a in node.names if a.name.split(".")[0] in ("time", "datetime")]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                if (node.module or "").split(".")[0] in ("time", "datetime"):
                    offenders.append((f.name, node.module))
                offenders += [(f.name, f"{node.module}.wall_us") for a in node.names if a.name == "wall_us"]
    assert offenders == []


def test_a_decode_process_imports_neither_the_scheduler_nor_the_data_plane():
    """A JSON decode process (spawned) imports only the module of the job it runs; that
    module keeps the server's scheduler and data plane out, so the pool starts quickly."""
    probe = ("import sys, ppipe.runtime.ingress.decode_process; "
             "print(sorted(m for m in sys.modules if m.startswith(('ppipe.dataplane', 'ppipe.runtime.scheduler'))))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[]"
