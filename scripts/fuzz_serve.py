#!/usr/bin/env python
"""The frontend's fuzz tests, longer than CI runs them (issue 20's proof).

Runs the two generated-request tests of the HTTP frontend with ``--examples`` requests each
(CI: 300 and 150): hostile edits of valid requests (``tests/runtime/test_hardening.py``)
and requests generated from the server's own OpenAPI description
(``tests/runtime/test_openapi.py``). Each request must get a 200 or a 400 with a JSON
``{"error": ...}``, counted in the metrics, within 5 s; afterwards the server must still
answer correctly. Prints the host line, the counts and the time.

    python scripts/fuzz_serve.py --examples 5000
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

TESTS = [
    "tests/runtime/test_hardening.py::test_fuzzed_infer_requests_never_get_a_500",
    "tests/runtime/test_hardening.py::test_the_server_still_answers_correctly_after_the_fuzz",
    "tests/runtime/test_openapi.py::test_requests_generated_from_the_document_never_get_a_500",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=3000, help="generated requests per fuzz test")
    ap.add_argument("--seed", type=int, default=None, help="Hypothesis seed (default: random, printed on failure)")
    args = ap.parse_args()
    from hostspeed import host_line

    print(host_line(), flush=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS]
    if args.seed is not None:
        cmd.append(f"--hypothesis-seed={args.seed}")
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PPIPE_FUZZ_EXAMPLES": str(args.examples)})
    print(f"{2 * args.examples} generated requests (+ the known hostile ones) in {time.perf_counter() - t:.0f} s: "
          f"{'no 5xx, every answer a 200 or a JSON 400 within 5 s' if r.returncode == 0 else 'FAILED (see above)'}")
    sys.exit(r.returncode)


if __name__ == "__main__":
    main()
