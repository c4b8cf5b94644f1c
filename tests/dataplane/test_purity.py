"""The data plane is pure logic: no wall clock, sleeping, threads, sockets or asyncio."""

import ast
from pathlib import Path

import ppipe.dataplane

FORBIDDEN = {"time", "threading", "asyncio", "socket", "multiprocessing", "concurrent", "random", "datetime"}


def test_no_module_of_the_data_plane_imports_a_clock_threads_or_io():
    pkg = Path(ppipe.dataplane.__file__).parent
    offenders = []
    for f in sorted(pkg.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module or ""]
            else:
                continue
            offenders += [(f.name, m) for m in mods if m.split(".")[0] in FORBIDDEN and f.name != "testing.py"]
    # testing.py (test helpers, not used by the schedulers) may seed a PRNG for jitter
    assert offenders == []
