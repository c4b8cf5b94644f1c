#!/usr/bin/env python
"""A soak of `ppipe serve`: faults together, over time; nothing lost, nothing grows (issue 39).

Serves two built-in models (resnet50, inception_v2: 0.6 MB inputs) as a user does, on three
CPU "GPUs" of this machine (emulated workers, local launcher, ``--token``, ``--grpc-port``,
``--replan auto``), and drives 80 % of what both of its plans can carry (REST binary, REST
JSON and gRPC) while a seeded schedule of faults runs:

* ``kill``: a worker process killed (SIGKILL); the server re-creates it;
* ``apply``: a plan switch (``ppipe apply``) to the other plan (weights 1:1 <-> 3:1);
* ``kill+apply``: a worker killed and a switch asked for at once;
* ``overload``: both models at 3x for a minute (a twelfth of the run when shorter);
* ``mix``: resnet50 at its whole capacity and inception_v2 at half, so that ``--replan
  auto`` may follow (two minutes, a twelfth of a shorter run);

and, all along, hostile requests (bad JSON, shapes, types, tokens, models, binary headers,
REST and gRPC), slow uploads and idle connections. A whole node's loss needs Ray nodes
(``ray start``); one machine has none, so that fault is not run here (it is said).

Every request is recorded with what it got. It prints: sent, answered (exactly once: the
server's count of 200s and of drops per model equals the client's), dropped by reason,
unanswered, 5xx other than explicit 503 drops, on time outside the fault windows (each
window is the fault and its stated allowance, fixed before the run), the time to recover
after each fault (the first second from which five whole seconds are >= 99 % on time),
every process's RSS and open file descriptors after warm-up, in the middle and at the end,
and whether any process is left after SIGTERM. The growth targets compare two idle samples:
the warm-up's last 5 s and the 5 s after the load send nothing, so that neither holds the
requests in flight (their bodies, the load's connections); the samples under load, after
warm-up and 3 s before the load ends, are printed too. Its last line::

    soak: sent N, answered once N, unanswered 0, outside faults A %, rss growth G %

Exit status 0 when nothing was lost (0 unanswered, 0 answered twice, no 5xx but drops,
every hostile request a 4xx, no process left); the on-time and growth targets are
printed against the figures. ``--json-out`` writes the figures for a test.

    python scripts/soak.py --minutes 30
    python scripts/soak.py --minutes 2 --json-out soak.json
    python scripts/soak.py --minutes 30 --heap-stats DIR --sample-every-s 120   # what holds the memory
    python scripts/soak.py --minutes 5 --ingress 2   # the same through two ingress processes
    python scripts/soak.py --minutes 5 --ingress 2 --shards 2   # ... and a scheduler process per model

The frontend's RSS is also given by kind (anonymous, file-backed), and ``--heap-stats``
adds per sample glibc's heap (its size, the free bytes in it) and pymalloc's arenas: after
``malloc_trim`` the free bytes of the heap are not resident, so RSS growth with a steady
heap in use is pages that a live block pins.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

MODELS = ("resnet50", "inception_v2")
TOKEN = "soak-token"
LOAD = 0.8  # of the least each plan carries per model
STREAMS = (("rest-binary", 0.6), ("grpc", 0.25), ("rest-json", 0.15))  # each model's traffic, by share
SEGMENT_S = 5.0  # the load's rates are constant within a segment
WARM_S = 20.0
QUIET_S = 5.0  # the warm-up's last seconds and the seconds after the load: no requests (the idle samples)
ALLOWANCE_S = {"kill": 10.0, "apply": 8.0, "kill+apply": 12.0, "overload": 15.0, "mix": 20.0}
RECOVERED_SHARE, RECOVERED_RUN_S = 0.99, 5
CLUSTER = """version: 1
name: soak-cpus
description: three CPU 'GPUs' of this machine (scripts/soak.py)
bandwidth_efficiency: 1.0
gpu_types:
- {name: cpu, vgpu_levels: [1, 2]}
servers:
- {name: s, gpu_type: cpu, gpus_per_server: 1, count: 3, nic_bandwidth_gbps: 40}
"""


@dataclass
class Fault:
    kind: str
    start_s: float
    end_s: float  # the fault's own end (a kill or a switch: its start)
    done: str = ""  # what happened, filled in when it runs

    @property
    def window(self) -> tuple[float, float]:
        return self.start_s, self.end_s + ALLOWANCE_S[self.kind]


@dataclass
class Figures:
    """What the soak measured, for the printout and ``--json-out``."""

    sent: int = 0
    answered: int = 0
    unanswered: int = 0
    answered_twice: int = 0
    server_5xx: int = 0
    by_outcome: dict = field(default_factory=dict)
    hostile: dict = field(default_factory=dict)
    hostile_not_4xx: int = 0
    slow_and_idle: dict = field(default_factory=dict)
    outside_faults_on_time: float = 0.0
    outside_faults_requests: int = 0
    outside_faults_by_model: dict = field(default_factory=dict)  # model -> its share on time outside the faults
    recoveries: list = field(default_factory=list)
    processes: dict = field(default_factory=dict)
    rss_growth: float = 0.0  # idle after warm-up -> idle after the load
    fd_growth: float = 0.0
    rss_growth_loaded: float = 0.0  # under load: after warm-up -> 3 s before the load ends
    switches: int = 0
    left_after_sigterm: int = 0


# ---- the plans and the server ---------------------------------------------------------------------------
def make_plans(tmp: Path) -> tuple[Path, Path, dict[str, float]]:
    """Plans A (weights 1:1) and B (3:1) on the soak cluster, and each model's soak rate:
    LOAD of the least of its two planned rates (both plans carry the load)."""
    from ppipe.spec.plan import load_plan

    (tmp / "cluster.yaml").write_text(CLUSTER)
    files = []
    for name, weights in (("a", "1,1"), ("b", "3,1")):
        out = tmp / f"plan-{name}.yaml"
        subprocess.run([sys.executable, "-m", "ppipe.cli", "plan", str(tmp / "cluster.yaml"), *MODELS, "--slo-ms", "1500",
                        "--weights", weights, "-o", str(out)], check=True, stdout=subprocess.DEVNULL)
        files.append(out)
    plans = [load_plan(f) for f in files]
    rates = {m: LOAD * min(next(x.throughput_rps for x in p.models if x.name == m) for p in plans) for m in MODELS}
    return files[0], files[1], rates


# `ppipe serve` under tracemalloc (--tracemalloc DIR): a snapshot of the frontend's Python heap
# into DIR at each SIGUSR1 (the soak sends one at each process sample)
_TRACED_SERVE = """
import itertools, pathlib, signal, sys, tracemalloc
out = pathlib.Path(sys.argv.pop(1))
tracemalloc.start(6)
turn = itertools.count()
signal.signal(signal.SIGUSR1, lambda *_: tracemalloc.take_snapshot().dump(str(out / f"snap{next(turn)}.tm")))
sys.argv[0] = "ppipe"
from ppipe.cli import main
main()
"""


# `ppipe serve` with allocator statistics (--heap-stats DIR): at each SIGUSR1, glibc's
# malloc_info (XML per arena: heap size, free bytes) and pymalloc's own statistics into DIR
_HEAP_STATS_SERVE = """
import ctypes, itertools, os, pathlib, signal, sys
out = pathlib.Path(sys.argv.pop(1))
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p
turn = itertools.count()
def dump(*_):
    k = next(turn)
    f = libc.fopen(str(out / f"malloc{k}.xml").encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(f))
    libc.fclose(ctypes.c_void_p(f))
    with open(out / f"pymalloc{k}.txt", "w") as fh:  # it writes to the C stderr: fd 2, for the call
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(fh.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
signal.signal(signal.SIGUSR1, dump)
sys.argv[0] = "ppipe"
from ppipe.cli import main
main()
"""


def start_server(plan: Path, port: int, grpc_port: int, traced: Path | None = None, heap_stats: Path | None = None,
                 ingress: int = 0, shards: int = 1) -> subprocess.Popen:
    from ppipe.runtime.client.httpclient import wait_until_ready

    head = [sys.executable, "-m", "ppipe.cli"]
    if traced:
        head = [sys.executable, "-c", _TRACED_SERVE, str(traced)]
    elif heap_stats:
        head = [sys.executable, "-c", _HEAP_STATS_SERVE, str(heap_stats)]
    proc = subprocess.Popen([*head, "serve", str(plan), "--backend", "emulated", "--token", TOKEN,
                             "--port", str(port), "--grpc-port", str(grpc_port), "--replan", "auto",
                             "--replan-window-s", "30", "--replan-min-interval-s", "30", "--ingress", str(ingress),
                             "--shards", str(shards)],
                            stdout=subprocess.DEVNULL, stderr=open(plan.parent / "serve.log", "w"))
    wait_until_ready(f"http://127.0.0.1:{port}", proc, timeout_s=120)
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the schedule ---------------------------------------------------------------------------------------
def schedule(minutes: float, seed: int) -> list[Fault]:
    """The faults of a ``minutes`` run, in a seeded order, spread evenly after the warm-up
    so that no two windows overlap: a kill every ~4 minutes, a switch every ~5, one kill
    with a switch, one overload and one mix shift (a minute and two, or a twelfth of the run each)."""
    total = minutes * 60.0
    kinds = (["kill"] * max(1, round(minutes / 4)) + ["apply"] * max(1, round(minutes / 5)) + ["kill+apply", "overload", "mix"])
    random.Random(seed).shuffle(kinds)
    length = {"overload": min(60.0, total / 12), "mix": min(120.0, total / 12)}
    busy = sum(length.get(k, 0.0) + ALLOWANCE_S[k] for k in kinds)
    gap = (total - WARM_S - busy) / (len(kinds) + 1)
    if gap < 2.0:
        raise SystemExit(f"--minutes {minutes:g} is too short for its faults (needs >= {(WARM_S + busy + 2 * len(kinds) + 2) / 60:.1f})")
    faults, t = [], WARM_S + gap
    for k in kinds:
        faults.append(Fault(k, t, t + length.get(k, 0.0)))
        t = faults[-1].window[1] + gap
    return faults


def load_factors(faults: list[Fault], t: float) -> dict[str, float]:
    """Each model's rate factor at ``t``: 3 in an overload; 1/LOAD for resnet50 and 0.5 for
    inception_v2 in a mix shift; 1 otherwise."""
    for f in faults:
        if f.start_s <= t < f.end_s and f.kind == "overload":
            return {m: 3.0 for m in MODELS}
        if f.start_s <= t < f.end_s and f.kind == "mix":
            return {"resnet50": 1.0 / LOAD, "inception_v2": 0.5}
    return {m: 1.0 for m in MODELS}


# ---- the load -------------------------------------------------------------------------------------------
def is_unanswered(outcome: str) -> bool:
    """A record with no answer: the client's exception class (``HttpError``, ``TimeoutError``...)."""
    return outcome[:1].isupper() and not outcome.startswith(("HTTP ", "gRPC "))


def is_server_error(outcome: str) -> bool:
    """A 5xx that is not an explicit drop (a drop is recorded by its reason, not its status)."""
    return outcome.startswith("HTTP 5") or outcome in ("gRPC INTERNAL", "gRPC UNKNOWN", "gRPC DATA_LOSS", "gRPC UNAVAILABLE")


async def segment(url: str, grpc: str, t0: float, start_s: float, rates: dict[str, float], seed: int, records: list) -> None:
    """One segment's open-loop load, every model and stream at its rate, from ``t0 + start_s``."""
    from ppipe.runtime.client.bench import run_bench

    await asyncio.sleep(max(0.0, t0 + start_s - time.monotonic()))

    async def one(model: str, stream: str, rate: float, k: int) -> None:
        got: list = []
        await run_bench(url, model, rate, SEGMENT_S, binary=stream != "rest-json", seed=seed * 100 + k, token=TOKEN,
                        grpc=grpc if stream == "grpc" else None, records=got)
        records.extend((start_s + t, model, stream, outcome, ms) for t, outcome, ms in got)

    jobs = [one(m, s, rates[m] * share, k) for k, (m, (s, share)) in enumerate((m, st) for m in MODELS for st in STREAMS)]
    await asyncio.gather(*jobs)


async def drive_load(url: str, grpc: str, t0: float, total_s: float, base: dict[str, float], faults: list[Fault], records: list) -> None:
    segs = []
    for i in range(int(total_s / SEGMENT_S)):
        f = load_factors(faults, i * SEGMENT_S)
        if WARM_S - QUIET_S <= i * SEGMENT_S < WARM_S:
            continue  # quiet: the idle sample after warm-up
        segs.append(segment(url, grpc, t0, i * SEGMENT_S, {m: base[m] * f[m] for m in MODELS}, i, records))
    await asyncio.gather(*segs)


# ---- hostile, slow and idle clients ---------------------------------------------------------------------
def hostile_cases() -> list[tuple[str, dict]]:
    """(name, httpx request kwargs) of requests that must get a 4xx with ``{"error": ...}``."""
    auth = {"authorization": f"Bearer {TOKEN}"}
    good = {"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32"}
    return [
        ("bad JSON", dict(url="/v2/models/resnet50/infer", content=b"{oops", headers=auth)),
        ("wrong shape", dict(url="/v2/models/resnet50/infer", json={"inputs": [{**good, "shape": [1, 3, 8, 8], "data": [0.0] * 192}]}, headers=auth)),
        ("wrong datatype", dict(url="/v2/models/inception_v2/infer", json={"inputs": [{**good, "datatype": "BYTES", "data": ["x"]}]}, headers=auth)),
        ("unknown model", dict(url="/v2/models/nosuch/infer", json={"inputs": []}, headers=auth)),
        ("no token", dict(url="/v2/models/resnet50/infer", json={"inputs": []})),
        ("wrong token", dict(url="/v2/models/resnet50/infer", json={"inputs": []}, headers={"authorization": "Bearer nope"})),
        ("binary header past the body", dict(url="/v2/models/resnet50/infer", content=b'{"inputs": []}',
                                             headers={**auth, "inference-header-content-length": "999"})),
        ("data shorter than its shape", dict(url="/v2/models/inception_v2/infer", json={"inputs": [{**good, "data": [0.0] * 10}]}, headers=auth)),
    ]


async def hostile(url: str, grpc: str, stop: asyncio.Event, seed: int, out: dict) -> None:
    """Until ``stop``: a hostile request every 0.25 s, REST and gRPC; ``out[name][outcome]`` counts."""
    import httpx
    import numpy as np

    from ppipe.runtime.client.bench import GrpcInferClient, encode_grpc_request

    rng, cases = random.Random(seed), hostile_cases()
    bad_grpc = encode_grpc_request("resnet50", {"input": np.zeros((1, 3, 8, 8), np.float32)})
    async with httpx.AsyncClient(base_url=url, timeout=30) as hx:
        gc = GrpcInferClient(grpc, token=TOKEN, timeout_s=30)
        while not stop.is_set():
            if rng.random() < 0.2:
                name, (code, _) = "gRPC wrong shape", await gc.infer(bad_grpc)
                outcome = f"gRPC {code}"
            else:
                name, kw = rng.choice(cases)
                t = time.monotonic()
                try:
                    r = await hx.post(**kw)
                    outcome = f"HTTP {r.status_code}" + ("" if "error" in r.text else " without an error field")
                except httpx.TransportError as exc:  # counted as not refused, with when and what, not a crash of the soak
                    outcome = f"no answer: {type(exc).__name__} after {time.monotonic() - t:.1f} s"
                    print(f"hostile {name!r}: {outcome} (at {time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True)
            out.setdefault(name, {}).setdefault(outcome, 0)
            out[name][outcome] += 1
            await asyncio.sleep(0.25)
        await gc.aclose()


def is_refusal(outcome: str) -> bool:
    return (outcome.startswith("HTTP 4") and "without" not in outcome) or outcome in (
        "gRPC INVALID_ARGUMENT", "gRPC NOT_FOUND", "gRPC UNAUTHENTICATED")


async def slow_upload(host: str, port: int, limit_s: float) -> tuple[str, float]:
    """A body announced as 600 kB and sent at 100 bytes a second: (what the server did, when)."""
    t = time.monotonic()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"POST /v2/models/resnet50/infer HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {TOKEN}\r\n"
                 f"content-length: 600000\r\ncontent-type: application/json\r\n\r\n".encode())
    try:
        while time.monotonic() - t < limit_s:
            writer.write(b" " * 100)
            try:
                line = await asyncio.wait_for(reader.readline(), 1.0)
            except asyncio.TimeoutError:
                continue
            return (line.split(b" ")[1].decode() if line.startswith(b"HTTP/") else "closed"), time.monotonic() - t
        return "still open", time.monotonic() - t
    except ConnectionError:
        return "closed", time.monotonic() - t
    finally:
        writer.close()


async def idle_connection(host: str, port: int, limit_s: float) -> tuple[str, float]:
    """A connection that sends nothing: (what the server did, when)."""
    t = time.monotonic()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        data = await asyncio.wait_for(reader.read(1024), limit_s)
        return ("answered " + data.split(b" ")[1].decode() if data.startswith(b"HTTP/") else "closed"), time.monotonic() - t
    except asyncio.TimeoutError:
        return "still open", time.monotonic() - t
    except ConnectionError:
        return "closed", time.monotonic() - t
    finally:
        writer.close()


async def slow_and_idle(port: int, stop: asyncio.Event, out: dict) -> None:
    """Until ``stop``: every 30 s a slow upload and ten idle connections at once; ``out`` counts
    what the server did within its timeouts (header 10 s, body 30 s, + 5 s)."""
    from ppipe.runtime.cli import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S

    while not stop.is_set():
        got = await asyncio.gather(slow_upload("127.0.0.1", port, DEFAULT_BODY_TIMEOUT_S + 5),
                                   *(idle_connection("127.0.0.1", port, DEFAULT_HEADER_TIMEOUT_S + 5) for _ in range(10)))
        for kind, (what, _s) in zip(["slow upload"] + ["idle"] * 10, got):
            out.setdefault(kind, {}).setdefault(what, 0)
            out[kind][what] += 1
        try:
            await asyncio.wait_for(stop.wait(), 30.0)
        except asyncio.TimeoutError:
            pass


# ---- faults ---------------------------------------------------------------------------------------------
def kill_a_worker(server_pid: int, rng: random.Random) -> str:
    import psutil

    from ppipe.runtime.launch.local import PROCESS_NAME

    workers = sorted((p for p in psutil.Process(server_pid).children(recursive=True) if p.name() == PROCESS_NAME), key=lambda p: p.pid)
    if not workers:
        return "no worker to kill"
    victim = rng.choice(workers)
    victim.kill()
    return f"killed worker pid {victim.pid} of {len(workers)}"


async def apply_plan(url: str, plan: Path) -> str:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "ppipe.cli", "apply", str(plan), "--url", url, "--token", TOKEN,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    last = (out.decode().strip().splitlines() or [""])[-1]
    return f"apply {plan.stem}: exit {proc.returncode}: {last[:120]}"


async def run_faults(url: str, server_pid: int, t0: float, faults: list[Fault], plans: tuple[Path, Path], seed: int) -> None:
    """Each fault at its time (the load's factors carry the overload and the mix themselves)."""
    rng, target = random.Random(seed), 1
    for f in faults:
        await asyncio.sleep(max(0.0, t0 + f.start_s - time.monotonic()))
        done = []
        if "kill" in f.kind:
            done.append(kill_a_worker(server_pid, rng))
        if "apply" in f.kind:
            done.append(await apply_plan(url, plans[target]))
            target = 1 - target
        f.done = "; ".join(done) or f"{f.kind} for {f.end_s - f.start_s:.0f} s"


# ---- processes, metrics -----------------------------------------------------------------------------------
RSS_READS = 5  # reads of each process's RSS per sample ...
RSS_READ_EVERY_S = 0.4  # ... this far apart: the least is what the process keeps


def rss_floors_mib(procs, reads: int = RSS_READS, every_s: float = RSS_READ_EVERY_S) -> dict[int, float]:
    """Per process (by pid), the least of ``reads`` RSS reads ``every_s`` apart (MiB): what
    it keeps between its requests. One read also holds the bodies being parsed at that
    instant (a JSON body of a 0.6 MB tensor is several MB), which moves a busy frontend's
    RSS by up to 10 % from one read to the next; growth is what stays."""
    least: dict[int, float] = {}
    for k in range(reads):
        if k:
            time.sleep(every_s)
        for p in procs:
            try:
                least[p.pid] = min(least.get(p.pid, float("inf")), p.memory_info().rss / 2**20)
            except Exception:  # psutil.NoSuchProcess: gone between two reads
                pass
    return least


def sample_processes(server_pid: int, ports: tuple[int, ...]) -> dict[str, dict]:
    """Per role (the frontend, then its children by process name): count, largest RSS floor
    (MiB, :func:`rss_floors_mib`) and most open fds of one process, less the connections of
    clients to ``ports`` (as many as the load holds open at that moment, not the server's own)."""
    import psutil

    server = psutil.Process(server_pid)
    groups: dict[str, list] = {"frontend": [server]}
    for p in server.children(recursive=True):
        try:
            groups.setdefault(p.name(), []).append(p)
        except psutil.NoSuchProcess:
            pass
    floors = rss_floors_mib([p for procs in groups.values() for p in procs])
    out = {}
    for name, procs in groups.items():
        rss, fds = [], []
        for p in procs:
            if p.pid not in floors:
                continue  # gone before its first read
            try:
                rss.append(floors[p.pid])
                clients = sum(1 for c in p.net_connections("tcp") if c.laddr and c.laddr.port in ports and c.raddr)
                fds.append(p.num_fds() - clients)
            except psutil.NoSuchProcess:
                pass
        if rss:
            out[name] = {"count": len(rss), "max_rss_mib": round(max(rss), 1), "max_fds": max(fds)}
    out["frontend"]["fd_kinds"] = fd_kinds(server)
    out["frontend"]["rss_kinds_mib"] = rss_kinds(server_pid)
    return out


def rss_kinds(pid: int) -> dict[str, float]:
    """The process's resident memory by kind (MiB): anonymous (heaps, buffers), file-backed
    (code and libraries paged in), shared memory; from /proc/PID/smaps_rollup (empty where absent)."""
    kinds = {"Anonymous:": "anon", "Rss:": "rss", "Shmem:": "shmem"}
    out = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(" ")
            if key in kinds:
                out[kinds[key]] = round(int(rest.split()[0]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        return {}
    if "rss" in out and "anon" in out:
        out["file"] = round(out["rss"] - out["anon"] - out.get("shmem", 0.0), 1)
    return out


def fd_kinds(proc) -> dict[str, int]:
    """A process's open fds by kind (socket by its TCP state and local port role, pipe,
    anon_inode:..., file)."""
    import os

    kinds: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{proc.pid}/fd"):
        try:
            link = os.readlink(f"/proc/{proc.pid}/fd/{fd}")
        except OSError:
            continue
        kind = link.split(":")[0] if link.startswith(("socket:", "pipe:")) else (link if link.startswith("anon_inode") else "file")
        kinds[kind] = kinds.get(kind, 0) + 1
    for c in proc.net_connections("all"):
        key = f"{'tcp' if c.type == socket.SOCK_STREAM else 'udp'} {c.status.lower()}" if c.family != socket.AF_UNIX else "unix"
        kinds[key] = kinds.get(key, 0) + 1
    return kinds


def server_counts(url: str) -> tuple[dict, dict]:
    """The server's ``ppipe_requests_total`` 200s and ``ppipe_drops_total`` per model."""
    import httpx

    ok: dict[str, float] = {}
    drops: dict[str, float] = {}
    metrics = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {TOKEN}"}, timeout=10)
    for line in metrics.text.splitlines():
        if line.startswith("ppipe_requests_total{") and 'code="200"' in line:
            m = line.split('model="')[1].split('"')[0]
            ok[m] = ok.get(m, 0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("ppipe_drops_total{"):
            m = line.split('model="')[1].split('"')[0]
            drops[m] = drops.get(m, 0) + float(line.rsplit(" ", 1)[1])
    return ok, drops


def stop_and_count_leftovers(proc: subprocess.Popen) -> int:
    """SIGTERM the server, wait for it, and count its processes still running after that."""
    import psutil

    family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    time.sleep(1.0)
    return sum(1 for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE)


# ---- the figures ----------------------------------------------------------------------------------------
def on_time(rec, slo_ms: float) -> bool:
    return rec[3] == "200" and rec[4] <= slo_ms


def recovery_s(records: list, f: Fault, slo_ms: float, total_s: float) -> float | None:
    """Seconds from the fault's end to the first whole second from which RECOVERED_RUN_S
    seconds in a row each have >= RECOVERED_SHARE of the requests sent in them on time."""
    bins: dict[int, list[bool]] = {}
    for r in records:
        if r[0] >= f.end_s:
            bins.setdefault(int(r[0]), []).append(on_time(r, slo_ms))
    good = lambda b: not bins.get(b) or sum(bins[b]) >= RECOVERED_SHARE * len(bins[b])  # noqa: E731
    first = int(f.end_s) + (f.end_s > int(f.end_s))
    for b in range(first, int(total_s) - RECOVERED_RUN_S + 1):
        if all(good(b + i) for i in range(RECOVERED_RUN_S)):
            return b - f.end_s
    return None


def growth(first: dict, last: dict, key: str) -> float:
    shared = [g for g in first if g in last and first[g][key] > 0]
    return max((last[g][key] / first[g][key] - 1.0 for g in shared), default=0.0)


def figures(records: list, hostile_out: dict, idle_out: dict, faults: list[Fault], slo_ms: float, total_s: float,
            counts: tuple[dict, dict], samples: dict, switches: int, left: int) -> Figures:
    fig = Figures(sent=len(records), hostile=hostile_out, slow_and_idle=idle_out, processes=samples, switches=switches,
                  left_after_sigterm=left)
    for r in records:
        fig.by_outcome[r[3]] = fig.by_outcome.get(r[3], 0) + 1
    fig.unanswered = sum(is_unanswered(r[3]) for r in records)
    fig.answered = fig.sent - fig.unanswered
    fig.server_5xx = sum(is_server_error(r[3]) for r in records)
    fig.hostile_not_4xx = sum(n for outs in hostile_out.values() for o, n in outs.items() if not is_refusal(o))
    fig.answered_twice = answered_twice(records, *counts)
    outside = [r for r in records if r[0] >= WARM_S and not any(a <= r[0] < b for a, b in (f.window for f in faults))]
    fig.outside_faults_requests = len(outside)
    fig.outside_faults_on_time = sum(on_time(r, slo_ms) for r in outside) / max(1, len(outside))
    for m in sorted({r[1] for r in outside}):
        mine = [r for r in outside if r[1] == m]
        fig.outside_faults_by_model[m] = sum(on_time(r, slo_ms) for r in mine) / len(mine)
    for f in faults:
        rec = recovery_s(records, f, slo_ms, total_s)
        fig.recoveries.append({**asdict(f), "recovered_s": rec, "allowance_s": ALLOWANCE_S[f.kind],
                               "within": rec is not None and rec <= ALLOWANCE_S[f.kind]})
    fig.rss_growth = growth(samples["after warm-up, idle"], samples["end, idle"], "max_rss_mib")
    fig.fd_growth = growth(samples["after warm-up, idle"], samples["end, idle"], "max_fds")
    fig.rss_growth_loaded = growth(samples["after warm-up, loaded"], samples["end, loaded"], "max_rss_mib")
    return fig


def answered_twice(records: list, server_ok: dict, server_drops: dict) -> int:
    """Answers the server counted beyond the client's (per model, 200s and drops): a request
    answered twice shows there; fewer on the server's side is printed as a mismatch."""
    extra = 0
    for m in MODELS:
        ok = sum(r[1] == m and r[3] == "200" for r in records)
        drops = sum(r[1] == m and not is_unanswered(r[3]) and not r[3].startswith(("HTTP", "gRPC")) and r[3] != "200" for r in records)
        for what, client, server in (("200s", ok, server_ok.get(m, 0)), ("drops", drops, server_drops.get(m, 0))):
            if server != client:
                print(f"   {m}: the server counted {server:.0f} {what}, the client {client}")
            extra += max(0, int(server) - client)
    return extra


# ---- the run --------------------------------------------------------------------------------------------
async def soak(url: str, grpc: str, port: int, server_pid: int, minutes: float, seed: int, plans, base, faults, traced: bool = False,
               samples_every_s: float | None = None):
    """The load, the faults, the hostile clients and the process samples (each with a heap
    snapshot of the frontend where it is ``traced``), together."""
    ports = (port, int(grpc.rsplit(":", 1)[1]))
    total = minutes * 60.0
    t0 = time.monotonic() + 1.0
    records: list = []
    hostile_out: dict = {}
    idle_out: dict = {}
    samples: dict = {}
    stop = asyncio.Event()

    async def sample(name: str, at_s: float) -> None:
        await asyncio.sleep(max(0.0, t0 + at_s - time.monotonic()))
        samples[name] = await asyncio.to_thread(sample_processes, server_pid, ports)
        if traced:
            os.kill(server_pid, signal.SIGUSR1)

    times = [] if not samples_every_s else [WARM_S + k * samples_every_s for k in range(1, int((total - 3.0 - WARM_S) / samples_every_s) + 1)]
    every = [sample(f"at {t:.0f} s", t) for t in times if t < total - 3.0]

    async def load_then_stop() -> None:
        await drive_load(url, grpc, t0, total, base, faults, records)
        stop.set()
        await sample("end, idle", time.monotonic() - t0 + QUIET_S)

    await asyncio.gather(load_then_stop(), run_faults(url, server_pid, t0, faults, plans, seed), hostile(url, grpc, stop, seed, hostile_out),
                         slow_and_idle(port, stop, idle_out), sample("after warm-up, idle", WARM_S - 2.0),
                         sample("after warm-up, loaded", WARM_S + 3.0), sample("middle", total / 2),
                         sample("end, loaded", total - 3.0), *every)
    return records, hostile_out, idle_out, samples


def print_report(fig: Figures, faults: list[Fault], base: dict, minutes: float) -> None:
    print(f"\nload: {', '.join(f'{m} {r:.1f} req/s' for m, r in base.items())} ({LOAD:.0%} of what both plans carry), "
          f"streams {', '.join(f'{s} {share:.0%}' for s, share in STREAMS)}; {minutes:g} min")
    print("faults (window = the fault and its allowance; recovered: the first of 5 s in a row >= 99 % on time):")
    for r in fig.recoveries:
        rec = "never" if r["recovered_s"] is None else f"{r['recovered_s']:.0f} s"
        print(f"   {r['start_s']:7.1f} s {r['kind']:<10} {r['done']}: recovered after {rec} (allowed {r['allowance_s']:.0f} s)")
    print("   a whole node lost: not run (one machine, the local launcher: no Ray nodes)")
    print(f"plan switches seen by the server: {fig.switches}")
    print(f"sent {fig.sent}, answered {fig.answered}, unanswered {fig.unanswered}, answered twice {fig.answered_twice}, "
          f"5xx other than drops {fig.server_5xx}")
    print(f"by outcome: {dict(sorted(fig.by_outcome.items(), key=lambda kv: -kv[1]))}")
    print(f"hostile: {fig.hostile} (not a 4xx: {fig.hostile_not_4xx})")
    print(f"slow uploads and idle connections: {fig.slow_and_idle}")
    print(f"on time outside the fault windows: {100 * fig.outside_faults_on_time:.2f} % of {fig.outside_faults_requests} (target >= 99 %); "
          + ", ".join(f"{m} {100 * v:.2f} %" for m, v in fig.outside_faults_by_model.items()))
    print(f"processes (count, largest RSS MiB: the least of {RSS_READS} reads in {(RSS_READS - 1) * RSS_READ_EVERY_S:g} s, "
          "most fds of one process less its clients' connections):")
    for when, groups in fig.processes.items():
        print(f"   {when:<14} " + "; ".join(f"{g} {v['count']}x {v['max_rss_mib']:.0f} MiB {v['max_fds']} fds" for g, v in groups.items()))
        print(f"   {'':<14} the frontend's fds: {groups['frontend']['fd_kinds']}; its RSS by kind (MiB): "
              f"{groups['frontend'].get('rss_kinds_mib', {})}")
    print(f"growth from after warm-up to the end, both idle: RSS {100 * fig.rss_growth:+.1f} %, fds {100 * fig.fd_growth:+.1f} % "
          "(target within 10 %)")
    print(f"growth under load (after warm-up -> 3 s before the load ends; holds what is in flight then): RSS {100 * fig.rss_growth_loaded:+.1f} %")
    print(f"processes left after SIGTERM: {fig.left_after_sigterm}")


def print_allocator_stats(folder: Path) -> None:
    """Per sample of --heap-stats, in order: glibc's heap (all arenas: its size, the free
    bytes in it, the mmapped blocks) and pymalloc's arenas (allocated, and the bytes in
    free pools and blocks), in MiB."""
    import re
    import xml.etree.ElementTree as ET

    print("frontend allocators per sample (MiB): glibc heap / free in it / mmapped; pymalloc arenas / free in them")
    for xml_file in sorted(folder.glob("malloc*.xml"), key=lambda f: int(f.stem[6:])):
        k = int(xml_file.stem[6:])
        root = ET.parse(xml_file).getroot()
        total = {t.get("type"): int(t.get("size", 0)) for t in root.findall("total")}
        system = {t.get("type"): int(t.get("size", 0)) for t in root.findall("system")}
        free = total.get("fast", 0) + total.get("rest", 0)
        py = (folder / f"pymalloc{k}.txt").read_text() if (folder / f"pymalloc{k}.txt").exists() else ""
        arenas = re.search(r"# arenas allocated current\s*=\s*([\d,]+)", py)
        py_free = sum(int(x.replace(",", "")) for x in re.findall(r"(?:# bytes in available blocks|unused pools \* \d+ bytes)\s*=\s*([\d,]+)", py))
        n_arenas = int(arenas.group(1).replace(",", "")) if arenas else 0
        print(f"   sample {k}: glibc {system.get('current', 0) / 2**20:.1f} / {free / 2**20:.1f} / {total.get('mmap', 0) / 2**20:.1f}; "
              f"pymalloc {n_arenas} arenas / {py_free / 2**20:.1f}")


def print_heap_growth(folder: Path, top: int = 15) -> None:
    """The frontend's Python heap: what grew most from the first snapshot (after warm-up) to the last (the end)."""
    import tracemalloc

    snaps = sorted(folder.glob("snap*.tm"), key=lambda f: int(f.stem[4:]))
    if len(snaps) < 2:
        print(f"heap: {len(snaps)} snapshot(s) in {folder}, need two")
        return
    first, last = (tracemalloc.Snapshot.load(str(f)) for f in (snaps[0], snaps[-1]))
    total = lambda s: sum(t.size for t in s.traces) / 2**20  # noqa: E731
    print(f"frontend Python heap (tracemalloc): {total(first):.1f} MiB after warm-up, {total(last):.1f} MiB at the end; grew most:")
    for stat in last.compare_to(first, "lineno")[:top]:
        print(f"   {stat.size_diff / 2**20:+8.2f} MiB {stat.count_diff:+8d} blocks  {stat.traceback[0]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--heap-stats", type=Path, default=None, metavar="DIR",
                    help="at each sample, the server writes glibc's malloc_info and pymalloc's statistics into DIR "
                    "(a diagnosis of what holds the frontend's memory)")
    ap.add_argument("--sample-every-s", type=float, default=None, help="also sample the processes every this many seconds")
    ap.add_argument("--ingress", type=int, default=0, metavar="N",
                    help="serve with N ingress processes (`ppipe serve --ingress N`): the clients, plan switches and "
                    "hostile requests reach them, and the server's process only schedules")
    ap.add_argument("--shards", type=int, default=1, metavar="K",
                    help="K frontend shards (`ppipe serve --shards K`); with --ingress, K scheduler processes")
    ap.add_argument("--tracemalloc", type=Path, default=None, metavar="DIR",
                    help="run the server under tracemalloc (slower: a diagnosis, not the targets' run), a snapshot of its "
                    "Python heap into DIR at each sample, and print what grew most from after warm-up to the end")
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    import httpx

    from hostspeed import host_line
    from ppipe.spec.plan import load_plan

    print(host_line())
    faults = schedule(args.minutes, args.seed)
    with tempfile.TemporaryDirectory() as d:
        plan_a, plan_b, base = make_plans(Path(d))
        slo_ms = min(m.slo_ms for m in load_plan(plan_a).models)
        port, grpc_port = free_port(), free_port()
        url, grpc = f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"
        for folder in (args.tracemalloc, args.heap_stats):
            if folder:
                folder.mkdir(parents=True, exist_ok=True)
        proc = start_server(plan_a, port, grpc_port, args.tracemalloc, args.heap_stats, args.ingress, args.shards)
        try:
            records, hostile_out, idle_out, samples = asyncio.run(
                soak(url, grpc, port, proc.pid, args.minutes, args.seed, (plan_a, plan_b), base, faults,
                     bool(args.tracemalloc or args.heap_stats), args.sample_every_s))
            if args.tracemalloc or args.heap_stats:
                time.sleep(10.0)  # the last snapshot is written
            counts = server_counts(url)
            status = httpx.get(url + "/v2/admin/plan", headers={"authorization": f"Bearer {TOKEN}"}, timeout=10).json()
        finally:
            left = stop_and_count_leftovers(proc)
    fig = figures(records, hostile_out, idle_out, faults, slo_ms, args.minutes * 60.0, counts, samples,
                  len(status.get("switches", [])), left)
    print_report(fig, faults, base, args.minutes)
    if args.tracemalloc:
        print_heap_growth(args.tracemalloc)
    if args.heap_stats:
        print_allocator_stats(args.heap_stats)
    if args.json_out:
        args.json_out.write_text(json.dumps(asdict(fig), indent=1))
    print(f"soak: sent {fig.sent}, answered once {fig.answered - fig.answered_twice}, unanswered {fig.unanswered}, "
          f"outside faults {100 * fig.outside_faults_on_time:.2f} %, rss growth {100 * fig.rss_growth:.1f} %")
    lost = fig.unanswered or fig.answered_twice or fig.server_5xx or fig.hostile_not_4xx or fig.left_after_sigterm
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
