#!/usr/bin/env python3
"""A node lost and back under load: what clients see, and how long recovery takes.

Starts two real Ray nodes on this machine as README "Several machines" does (``ray start
--head`` with ``{"l4": 1, "l4-0": 1}``, ``ray start --address`` with ``{"p4": 1, "p4-0": 1}``,
token authentication on), and ``ppipe serve --ray-address auto --backend emulated`` with two
models: ``a`` on the head only, ``b`` in two stages (head, then the second node). Under
load on both models it kills every process of the second node, waits, restarts it with the
same ``ray start``, and waits until ``b`` is ready again, without restarting ``ppipe serve``.

Prints the requests sent, answered and by status in each phase (before the kill, during
the loss, while the node returns, after), when ``b`` turned unready, the readiness and the
capacity gauge during the loss, and the recovery time (node back -> ``b`` ready again).

    python scripts/bench_node_loss.py [--rate 10] [--phase-s 3] [--ingress N] [--json-out FILE]

With ``--ingress N``, ``ppipe serve --ingress N`` puts N ingress processes on each node; the
load reaches them on the shared port, and the script also prints when the second node has
its ingresses again after its return (the supervisor finds the node by its address and
resources: it comes back with a new id).

The test with the same scenario (tests/runtime/test_multinode.py) asserts the invariants;
this script is where the times are. Needs only the ``ray`` CLI of this Python's venv; the
nodes' processes are found by their temp dirs and killed at the end (``ray stop`` is not
used: it would stop every Ray instance of the machine).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.runtime.raynodes import LocalRayNodes, Serve, print_node_loss, run_node_loss, write_two_model_plan  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=10.0, help="requests per second to each model")
    ap.add_argument("--phase-s", type=float, default=3.0, help="seconds of load before the kill, after the model turned unready, and after it is back")
    ap.add_argument("--ingress", type=int, default=0, help="ppipe serve --ingress N: N ingress processes on every node")
    ap.add_argument("--json-out", default=None, help="also write the figures (without the per-request answers) as JSON here")
    args = ap.parse_args()
    import ray

    with tempfile.TemporaryDirectory(prefix="node-loss-") as tmp:
        root = Path(tmp)
        with LocalRayNodes(root) as nodes:
            nodes.start_head({"l4": 1, "l4-0": 1})
            r = nodes.start_node("p4", {"p4": 1, "p4-0": 1})
            if r.returncode != 0:
                print(f"ray start of the second node failed: {r.stderr[-2000:]}", file=sys.stderr)
                return 1
            plan, _ = write_two_model_plan(root)
            serve = Serve(nodes, plan, root, extra=("--ingress", str(args.ingress)) if args.ingress else ())
            try:
                serve.wait_ready()
                res = run_node_loss(nodes, serve, "p4", {"p4": 1, "p4-0": 1}, lost_model="b", models=["a", "b"],
                                    rate=args.rate, phase_s=args.phase_s)
                if args.ingress:
                    res["ingresses_back"] = _ingresses_back(nodes, "p4", args.ingress)
            finally:
                serve.stop()
            words = ("vGPU", "server p4", "data path", "Unhandled", "ingress")
            log = [line for line in serve.log().splitlines() if any(w in line for w in words)]
    print(f"Ray {ray.__version__}, token auth on; 2 nodes on 127.0.0.1; ppipe serve --backend emulated; "
          f"{args.rate:g} req/s to each of a (head) and b (head -> second node)")
    print_node_loss(res)
    if args.ingress:
        n, waited = res["ingresses_back"]
        print(f"ingress processes on the second node after its return: {n} of {args.ingress} "
              f"({waited:.1f} s after b was ready again and the last phase of load)")
    print("ppipe serve's log lines about it:")
    for line in log:
        print("  " + line)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({k: v for k, v in res.items() if k != "answers"}, indent=2))
    return 0


def _ingresses_back(nodes, name: str, want: int, timeout_s: float = 120.0) -> tuple[int, float]:
    """Wait until node ``name`` runs ``want`` ingress processes: (how many it runs, seconds waited)."""
    import time

    def count() -> int:
        return len(nodes.pids_named(name, "ppipe-ingress"))

    t0 = time.monotonic()
    while count() < want and time.monotonic() - t0 < timeout_s:
        time.sleep(0.5)
    return count(), time.monotonic() - t0


if __name__ == "__main__":
    sys.exit(main())
