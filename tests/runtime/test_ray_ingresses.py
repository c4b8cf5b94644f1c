"""What an ingress on a Ray node binds (ppipe.runtime.launch.ray_ingresses): pure rules, no Ray."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ppipe.runtime.launch.local_ingresses import IngressStart
from ppipe.runtime.launch.ray_ingresses import RayNode, bind_host, for_node
from ppipe.runtime.launch.shards import ServeSettings


@pytest.mark.parametrize("host, node, binds", [
    ("0.0.0.0", "10.0.0.6", "0.0.0.0"),  # every interface of every node
    ("::", "10.0.0.6", "::"),
    ("127.0.0.1", "10.0.0.6", "127.0.0.1"),  # each node's own loopback
    ("10.0.0.5", "10.0.0.5", "10.0.0.5"),  # the node that has the address
    ("10.0.0.5", "10.0.0.6", "10.0.0.6"),  # another machine's address: this node's own
    ("localhost", "10.0.0.6", "localhost"),  # a name each node resolves
])
def test_bind_host(host, node, binds):
    assert bind_host(host, node) == binds


def _start(host: str, grpc_host: str | None, data_host: str) -> IngressStart:
    settings = ServeSettings(runtime={}, app={}, server={}, workers={},
                             grpc={} if grpc_host is None else {"host": grpc_host, "port": 9001, "token": None})
    return IngressStart(3, "tcp://10.0.0.5:7000", SimpleNamespace(), settings, host, 8000, "http://10.0.0.5:7001", data_host=data_host)


def test_an_ingress_on_another_node_binds_that_node_and_keeps_the_rest():
    s = for_node(_start("10.0.0.5", "10.0.0.5", "10.0.0.5"), "10.0.0.6")
    assert (s.host, s.settings.grpc["host"], s.data_host) == ("10.0.0.6", "10.0.0.6", "10.0.0.6")
    assert (s.index, s.port, s.scheduler_address, s.admin_url) == (3, 8000, "tcp://10.0.0.5:7000", "http://10.0.0.5:7001")


def test_a_server_that_keeps_to_loopback_keeps_its_ingresses_there():
    s = for_node(_start("127.0.0.1", None, "127.0.0.1"), "10.0.0.6")
    assert (s.host, s.settings.grpc, s.data_host) == ("127.0.0.1", {}, "127.0.0.1")


def test_a_node_is_the_same_machine_by_its_address_and_resources():
    a = RayNode("id-1", "10.0.0.6", frozenset({"CPU", "p4", "p4-0"}))
    assert a.machine == RayNode("id-2", "10.0.0.6", frozenset({"CPU", "p4", "p4-0"})).machine
    assert a.machine != RayNode("id-3", "10.0.0.6", frozenset({"CPU", "l4", "l4-0"})).machine
