"""A worker's body imports no launcher, no HTTP and no torch: ``ppipe.runtime.workers.worker``,
``stage_server``, ``stage_clock`` and ``backends``, each imported alone in a fresh interpreter,
leave ``ray``, ``starlette`` and ``torch`` out of ``sys.modules`` and do not even try to
import them (so the check holds where one is not installed).

The same worker runs as a Ray actor and in the frontend's process (ppipe.runtime.launch.inproc):
Ray is the launcher's (``ppipe.runtime.launch.ray_workers.actor_class``), HTTP is the ingress's, and
torch is one backend's, loaded when a worker is built with it. When a module fails here,
the message names the lines of ppipe that led to the import, outermost first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import ppipe

FORBIDDEN = ("ray", "starlette", "torch")
MODULES = ("ppipe.runtime.workers.worker", "ppipe.runtime.workers.stage_server", "ppipe.runtime.workers.stage_clock",
           "ppipe.runtime.workers.backends")
PPIPE = Path(ppipe.__file__).parent

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


@pytest.mark.parametrize("module", MODULES)
def test_a_workers_module_imports_no_ray_starlette_or_torch(module):
    run = subprocess.run([sys.executable, "-c", _PROBE, module, ",".join(FORBIDDEN), str(PPIPE)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"importing {module} failed:\n{run.stderr[-3000:]}"
    imported = json.loads(run.stdout.strip().splitlines()[-1])
    assert imported == {}, f"importing {module} imports {', '.join(imported)}, by way of: " + "; ".join(
        f"{top}: {' -> '.join(chain) or '(no ppipe line: a dependency)'}" for top, chain in imported.items())
