"""Ingress imports no Ray and no torch: every module under ``ppipe/runtime/ingress/``,
imported alone in a fresh interpreter, leaves ``ray`` and ``torch`` out of ``sys.modules``
and does not even try to import them (so the check holds where torch is not installed).

Ingress reads, validates and decodes requests and hands them to the scheduler's host; a
frontend process that imported Ray or torch would pay their import time and memory in
every frontend shard, and would tie the HTTP and gRPC APIs to one launcher. When a module
fails here, the message names the lines of ppipe that led to the import, outermost first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import ppipe.runtime.ingress

FORBIDDEN = ("ray", "torch")

INGRESS = Path(ppipe.runtime.ingress.__file__).parent
PPIPE = INGRESS.parent.parent

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


def _ingress_modules() -> list[str]:
    names = []
    for path in sorted(INGRESS.rglob("*.py")):
        parts = path.relative_to(PPIPE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_ingress_module_is_checked():
    names = _ingress_modules()
    assert {"ppipe.runtime.ingress", "ppipe.runtime.ingress.http_server", "ppipe.runtime.ingress.grpc_server",
            "ppipe.runtime.ingress.protocol", "ppipe.runtime.ingress.proto"} <= set(names)


@pytest.mark.parametrize("module", _ingress_modules())
def test_an_ingress_module_imports_no_ray_and_no_torch(module):
    run = subprocess.run([sys.executable, "-c", _PROBE, module, ",".join(FORBIDDEN), str(PPIPE)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"importing {module} failed:\n{run.stderr[-3000:]}"
    imported = json.loads(run.stdout.strip().splitlines()[-1])
    assert imported == {}, f"importing {module} imports {', '.join(imported)}, by way of: " + "; ".join(
        f"{top}: {' -> '.join(chain) or '(no ppipe line: a dependency)'}" for top, chain in imported.items())
