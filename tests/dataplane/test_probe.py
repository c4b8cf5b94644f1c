"""probe() and reserve(): Algorithm 2 and the paper's Fig. 5 example."""

from ppipe.dataplane import Reservation
from ppipe.dataplane.testing import ManualClock, ToyModel, ToyPartition, ToyPipeline, toy_cluster, toy_plan, toy_profile
from ppipe.dataplane import build_scheduler

from ppipe.dataplane.testing import FIG5_NODES, fig5_world


def _pipe(sched):
    return sched.topology.pipelines["m"][0]


def test_fig5a_probe_picks_the_node_that_finishes_first_and_returns_its_resources(fig5):
    sched, clock = fig5()
    node3 = sched.topology.vgpus[FIG5_NODES[2]]
    node3.table.add(0.0, 1000.0, "other work")  # node 3's GPU is busy: via it, the batch ends later (t5)
    r = sched.probe(_pipe(sched), 1)
    assert r.path == [FIG5_NODES[0], FIG5_NODES[1]]
    # node 1's GPU during t1, node 1's uplink + node 2's downlink during t2, node 2's GPU during t3
    assert r.reservations() == [
        Reservation("vgpu:n-0/gpu0/s0", 0.0, 100.0),
        Reservation("up:n-0", 100.0, 10.0),
        Reservation("down:n-1", 100.0, 10.0),
        Reservation("vgpu:n-1/gpu0/s0", 110.0, 200.0),
    ]
    assert r.finish == 310.0 and r.wait == 0.0
    assert sched.stats()["probes"] == 1
    # probe() is stateless: nothing was reserved
    assert len(sched.topology.vgpus[FIG5_NODES[0]].table) == 0


def test_fig5b_reserve_updates_availability_and_the_next_probe_sees_it(fig5):
    sched, clock = fig5()
    sched.topology.vgpus[FIG5_NODES[2]].table.add(0.0, 1000.0, "other work")
    r = sched.probe(_pipe(sched), 1)
    sched.reserve(r, batch_id=7)
    tabs = {name: sched.topology.table(name) for name in ("vgpu:n-0/gpu0/s0", "up:n-0", "down:n-1", "vgpu:n-1/gpu0/s0")}
    assert [(s, e) for s, e, _ in tabs["up:n-0"].intervals()] == [(100.0, 110.0)]
    assert [(s, e) for s, e, _ in tabs["down:n-1"].intervals()] == [(100.0, 110.0)]
    assert tabs["vgpu:n-1/gpu0/s0"].intervals()[0][2] == (7, 1, "i")
    r2 = sched.probe(_pipe(sched), 1)
    # node 1 free at 100; transfer 200..210; node 2 busy until 310 -> 310..510 (waits 100)
    assert r2.path == [FIG5_NODES[0], FIG5_NODES[1]]
    assert r2.finish == 510.0
    assert r2.wait == 100.0 + 100.0  # 100 on node 1's GPU, 100 on node 2's


def test_transfer_needs_uplink_and_downlink_free_at_once(fig5):
    sched, clock = fig5()
    topo = sched.topology
    topo.table("up:n-0").add(100.0, 5.0, "x")  # sender uplink busy 100..105
    topo.table("down:n-1").add(108.0, 10.0, "y")  # node 2 downlink busy 108..118
    topo.table("down:n-2").add(100.0, 50.0, "z")  # node 3 downlink busy 100..150
    r = sched.probe(_pipe(sched), 1)
    h = r.hops[1]
    # up free from 105, but 105..115 collides with down:n-1 at 108 -> both free from 118
    assert h.vgpu.id == FIG5_NODES[1]
    assert h.transfer_start == 118.0 and h.start == 128.0 and r.finish == 328.0


def test_transfer_time_scales_with_batch_and_slowest_nic():
    cluster = toy_cluster([("fast", "A", 1, 1, 16.0), ("slow", "A", 1, 1, 4.0)])
    prof = toy_profile("m", {"A": [100.0, 100.0]}, out_bytes=[10_000, 10])
    plan = toy_plan(cluster, [ToyModel("m", 10.0, [ToyPipeline(2, [ToyPartition(0, 0, "A", 1, [("fast-0", 0, 0)]), ToyPartition(1, 1, "A", 1, [("slow-0", 0, 0)])])])])
    s = build_scheduler(plan, {"m": prof}, cluster, ManualClock())
    r = s.probe(s.topology.pipelines["m"][0], 2)
    assert r.hops[1].transfer_us == 2 * 10_000 * 8 / 4e9 * 1e6  # min(16, 4) Gbit/s


def test_same_server_transfer_uses_no_nic_and_takes_no_time_by_default():
    cluster = toy_cluster([("s", "A", 2, 1, 8.0)])
    prof = toy_profile("m", {"A": [100.0, 100.0]}, out_bytes=[10_000, 10])
    plan = toy_plan(cluster, [ToyModel("m", 10.0, [ToyPipeline(1, [ToyPartition(0, 0, "A", 1, [("s-0", 0, 0)]), ToyPartition(1, 1, "A", 1, [("s-0", 1, 0)])])])])
    s = build_scheduler(plan, {"m": prof}, cluster, ManualClock())
    r = s.probe(s.topology.pipelines["m"][0], 1)
    assert r.hops[1].transfer_us == 0.0 and not r.hops[1].uses_nic
    assert [x.resource for x in r.reservations()] == ["vgpu:s-0/gpu0/s0", "vgpu:s-0/gpu1/s0"]
    s2 = build_scheduler(plan, {"m": prof}, cluster, ManualClock(), local_transfer_gbps=80.0)
    r2 = s2.probe(s2.topology.pipelines["m"][0], 1)
    assert r2.hops[1].transfer_us == 1.0 and not r2.hops[1].uses_nic


def test_probe_fills_a_gap_on_the_gpu():
    sched, clock = fig5_world()
    n2 = sched.topology.vgpus[FIG5_NODES[1]]
    n3 = sched.topology.vgpus[FIG5_NODES[2]]
    n2.table.add(0.0, 100.0, "a")
    n2.table.add(400.0, 100.0, "b")  # gap 100..400 on node 2 holds the 200 us stage
    n3.table.add(0.0, 5000.0, "c")
    r = sched.probe(_pipe(sched), 1)
    assert r.hops[1].vgpu is n2 and r.hops[1].start == 110.0


def test_ties_go_to_the_lower_vgpu_id(fig5):
    sched, clock = fig5()
    r = sched.probe(_pipe(sched), 1)
    assert r.path == [FIG5_NODES[0], FIG5_NODES[1]]  # nodes 2 and 3 finish at the same time


def _two_sender_world(out_bytes: int = 10_000, **options):
    """Pool 0 on servers a-0 and b-0 (one vGPU each, equally fast), pool 1 on c-0."""
    cluster = toy_cluster([("a", "A", 1, 1, 8.0), ("b", "A", 1, 1, 8.0), ("c", "A", 1, 1, 8.0)])
    prof = toy_profile("m", {"A": [100.0, 100.0]}, out_bytes=[out_bytes, 10])
    parts = [ToyPartition(0, 0, "A", 1, [("a-0", 0, 0), ("b-0", 0, 0)]), ToyPartition(1, 1, "A", 1, [("c-0", 0, 0)])]
    plan = toy_plan(cluster, [ToyModel("m", 10.0, [ToyPipeline(1, parts)])])
    return build_scheduler(plan, {"m": prof}, cluster, ManualClock(), **options)


def test_lookahead_sends_work_to_the_server_whose_uplink_is_free():
    # a-0's GPU is free but its uplink is busy for a long time (other models' transfers):
    # the paper's greedy still picks a-0 (same finish, lower id) and the batch then waits
    # at the NIC; the look-ahead picks b-0, whose output can leave at once.
    for lookahead, first in ((False, "a-0/gpu0/s0"), (True, "b-0/gpu0/s0")):
        s = _two_sender_world(probe_lookahead=lookahead)
        s.topology.table("up:a-0").add(50.0, 5000.0, "other")
        r = s.probe(_pipe(s), 1)
        assert r.path[0] == first
    assert r.finish == 100.0 + 10.0 + 100.0  # no waiting at all on b-0's path


def test_lookahead_spreads_back_to_back_batches_over_servers():
    # Feature maps take longer to send (1000 us) than to compute (100 us). Batch 0 runs on
    # a-0; at t=200 both GPUs are idle and a-0's past interval is pruned (as a feedback
    # report does), so the greedy sees two equal candidates and takes a-0 again (lower id),
    # although a-0's uplink carries batch 0 until 1100. The look-ahead takes b-0.
    for lookahead, servers in ((False, ["a-0", "a-0"]), (True, ["a-0", "b-0"])):
        s = _two_sender_world(probe_lookahead=lookahead, out_bytes=1_000_000)
        got = []
        for bid, t in enumerate((0.0, 200.0)):
            s.clock.advance_to(t)
            for g in s.topology.vgpus.values():
                g.table.prune(t)
            r = s.probe(_pipe(s), 1)
            s.reserve(r, bid)
            got.append(r.hops[0].vgpu.server)
        assert got == servers


def test_equal_finish_goes_to_the_longest_idle_vgpu_not_the_lowest_id():
    # Both vGPUs can next run at 500..600 (in a gap), but a-0 has work reserved until 800
    # and b-0 only until 700: b-0 (idle sooner) seeds the scan and a-0 does not beat it.
    cluster = toy_cluster([("a", "A", 1, 1, 8.0), ("b", "A", 1, 1, 8.0)])
    prof = toy_profile("m", {"A": [100.0]}, out_bytes=[10])
    plan = toy_plan(cluster, [ToyModel("m", 10.0, [ToyPipeline(1, [ToyPartition(0, 0, "A", 1, [("a-0", 0, 0), ("b-0", 0, 0)])])])])
    s = build_scheduler(plan, {"m": prof}, cluster, ManualClock())
    a, b = s.topology.vgpus["a-0/gpu0/s0"], s.topology.vgpus["b-0/gpu0/s0"]
    for g, late in ((a, 700.0), (b, 650.0)):
        g.table.add(0.0, 500.0, "x")
        g.table.add(late, 100.0 if g is a else 50.0, "y")
        g.pool.touch(g)
    r = s.probe(_pipe(s), 1)
    assert r.finish == 600.0 and r.path == ["b-0/gpu0/s0"]
