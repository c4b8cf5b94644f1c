"""Property tests: random small worlds and traces keep the scheduler's invariants."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppipe.dataplane import Request, build_scheduler
from ppipe.dataplane.testing import ManualClock, ToyModel, ToyPartition, ToyPipeline, replay, toy_cluster, toy_plan, toy_profile


@st.composite
def worlds(draw):
    n_servers = draw(st.integers(2, 4))
    gpus = draw(st.integers(1, 2))
    cluster = toy_cluster([("s", "A", gpus, n_servers, draw(st.sampled_from([2.0, 8.0, 40.0])))])
    slots = [(f"s-{i}", g, 0) for i in range(n_servers) for g in range(gpus)]
    lat = [draw(st.floats(50.0, 2000.0)) for _ in range(3)]
    prof = toy_profile("m", {"A": lat}, out_bytes=[draw(st.integers(10, 200_000)) for _ in range(3)], batches=(1, 2, 4))
    cut = draw(st.integers(0, 2))
    k = draw(st.integers(1, len(slots) - 1)) if cut < 2 else len(slots)
    if cut < 2:
        parts = [ToyPartition(0, cut, "A", 1, slots[:k]), ToyPartition(cut + 1, 2, "A", 1, slots[k:])]
    else:
        parts = [ToyPartition(0, 2, "A", 1, slots)]
    slo_ms = sum(lat) * draw(st.floats(1.5, 6.0)) / 1000.0 + 1.0
    plan = toy_plan(cluster, [ToyModel("m", slo_ms, [ToyPipeline(draw(st.sampled_from([1, 2, 4])), parts)])])
    gaps = draw(st.lists(st.floats(0.0, 3000.0), min_size=5, max_size=60))
    return cluster, prof, plan, slo_ms, gaps


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds(), st.sampled_from(["reservation", "reactive", "reactive-pool"]), st.floats(0.0, 0.5))
def test_random_worlds_keep_the_invariants(world, policy, jitter):
    cluster, prof, plan, slo_ms, gaps = world
    clock = ManualClock()
    s = build_scheduler(plan, {"m": prof}, cluster, clock, policy=policy)
    t, reqs = 0.0, []
    for i, g in enumerate(gaps):
        t += g
        reqs.append(Request(i, "m", t, t + slo_ms * 1000.0))
    log, outcome = replay(s, clock, reqs, jitter=jitter, seed=1)
    assert len(outcome) == len(reqs)  # every request dispatched or dropped
    stats = s.stats()
    assert stats["queued"] == {"m": 0} and stats["inflight"] == 0
    if policy == "reservation":
        # the plan of every dispatch meets its requests' deadlines
        assert all(o[1] <= o[2] + 1e-6 for o in outcome.values() if o[0] == "dispatched")
    for tab in s.topology.all_tables():
        tab.check()
