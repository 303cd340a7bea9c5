"""The environment ft gives the ranks of a cluster job: gloo's network interface on more than one node
(launch/netif.py), and NCCL's error handling left at torch's own default, 3, in every launcher."""

from __future__ import annotations

import io
import socket

import pytest

from finetune.distributed.runtime import nccl_environment
from finetune.launch import k8s, netif, slurm
from finetune.workflow import compile_plan
from tests.helpers import REPO

JOB = str(REPO / "examples/yaml/llama3.1-8b-full-8xh100.yaml")
VARIABLE = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


# ---------------------------------------------------------------- gloo's interface
def test_the_route_to_a_loopback_master_leaves_from_lo():
    assert netif.interface_of("127.0.0.1") == "lo"
    assert netif.choose("127.0.0.1", {}) == ("lo", "127.0.0.1, the route to MASTER_ADDR '127.0.0.1'")


def test_one_node_is_left_alone_and_several_say_which_interface():
    out = io.StringIO()
    assert netif.gloo_environment("127.0.0.1", 1, out) == {} and out.getvalue() == ""
    assert netif.gloo_environment("127.0.0.1", 2, out) == {"GLOO_SOCKET_IFNAME": "lo"}
    assert "gloo (ft's own collectives between nodes) uses lo: 127.0.0.1, the route to MASTER_ADDR" in out.getvalue()


def test_the_users_choice_wins_and_nccls_serves_gloo_too(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    out = io.StringIO()
    assert netif.gloo_environment("127.0.0.1", 2, out) == {}  # already in the ranks' environment
    assert "uses eth7: GLOO_SOCKET_IFNAME, as set" in out.getvalue()
    assert netif.choose("127.0.0.1", {"NCCL_SOCKET_IFNAME": "=lo"})[0] == "lo"
    assert (
        netif.choose("127.0.0.1", {"NCCL_SOCKET_IFNAME": "l"})[0] == "lo"
    )  # a prefix, as NCCL reads it: gloo gets the exact name
    name, why = netif.choose("127.0.0.1", {"NCCL_SOCKET_IFNAME": "ft-no-such-if"})
    assert name == "lo" and why.startswith("NCCL_SOCKET_IFNAME=ft-no-such-if names no interface of this node")


@pytest.mark.parametrize(
    "spec,names,routed,chosen",
    [
        ("eth", ["lo", "eth0", "eth1"], "eth1", "eth1"),  # the routed one where NCCL's list admits it
        ("ib,eth", ["lo", "eth0", "ib0"], None, "eth0"),  # else the first it admits, in the node's order
        ("=eth", ["lo", "eth0"], "eth0", None),  # `=`: exact names only
        ("^lo,docker", ["lo", "docker0", "eth0"], "docker0", "eth0"),  # `^`: all but these
        ("^eth", ["lo", "eth0"], None, None),  # never loopback from an exclusion list
    ],
)
def test_nccl_socket_ifname_syntax_selects_one_interface(spec, names, routed, chosen):
    assert netif.from_nccl(spec, names, routed) == chosen


def test_a_master_named_by_this_hosts_loopback_name_takes_the_default_route():
    """Node 0 under Slurm: MASTER_ADDR is its own hostname, which a stock /etc/hosts maps to 127.0.1.1 there; the
    other nodes reach it on another address, so gloo must not bind loopback."""
    if not netif.route_source("localhost").startswith("127."):
        pytest.skip("localhost does not resolve to loopback here")
    name, why = netif.choose("localhost", {})
    assert name == netif.default_route_interface() and why.startswith("MASTER_ADDR 'localhost' is this host")
    if name is not None:
        assert name != "lo" and name in [n for _, n in socket.if_nameindex()]


# ---------------------------------------------------------------- NCCL's error handling
def test_every_launcher_gives_the_ranks_torchs_default_error_handling(tmp_path, monkeypatch):
    monkeypatch.delenv(VARIABLE, raising=False)
    plan = compile_plan(JOB, (), "2x8xH100")
    script = slurm.sbatch_script(JOB, plan, str(tmp_path / "run"), "ft-job")
    assert f'export {VARIABLE}="${{{VARIABLE}:-3}}"' in script and f"{VARIABLE}:-1" not in script
    env = {e["name"]: e["value"] for e in k8s.pod_env(plan, "jobset", "ft-job")}
    assert env[VARIABLE] == "3"
    assert nccl_environment(tmp_path)[VARIABLE] == "3"  # ft train's launcher, before torchrun (whose default is 1)
    monkeypatch.setenv(VARIABLE, "1")
    assert nccl_environment(tmp_path)[VARIABLE] == "1"  # the user's value wins
