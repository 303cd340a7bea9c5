"""GRPO with `method.rollout.placement: ray` on a local Ray cluster of two nodes (ray.cluster_utils.Cluster on this
machine), with vLLM's CPU build: ft train pins the trainer's two ranks to node 0 and the vLLM server to node 1, the '7s'
task learns, a server killed mid-run ends the job with a message, after which `ft train --resume` places new actors and
finishes the run, and the first steps equal those of `placement: server` for the same seed. One test (one cluster, one
run): each ft train on two cores costs tens of seconds.

Runs in the environment with vLLM and Ray (scripts/setup-vllm.sh; the main one has neither, and this file skips there):
    OMP_NUM_THREADS=1 /path/to/vllm-env/bin/python -m pytest -q -m vllm tests/test_vllm_ray.py
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray")

from tests.helpers import ft_train  # noqa: E402
from tests.rollout_helpers import rows, sevens_job  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

KILL_HOOK = """
import json, os, signal
from pathlib import Path

def kill_engine(rank, step):
    if rank == 0 and step == int(os.environ["FT_TEST_KILL_AT"]):
        listing = json.loads((Path(os.environ["FT_TEST_RUN"]) / "rollout-engines.json").read_text())
        os.kill(listing["engines"][0]["pid"], signal.SIGKILL)
"""


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes on this machine, two CPUs each: the head and one more. (At this machine's own address: Ray turns
    a cluster address of 127.0.0.1 into it when a driver connects.)"""
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    nodes.add_node(num_cpus=2)
    nodes.wait_for_nodes()
    try:
        yield nodes
    finally:
        nodes.shutdown()


SECRET = "ft-test-secret-7c1e9a2b"


def ray_job(tmp_path, model, steps: int, placement: str = "ray") -> str:
    path = sevens_job(tmp_path, model, steps)
    text = open(path).read().replace("placement: server", f"placement: {placement}")
    open(path, "w").write(text)
    return path


def test_grpo_on_ray_learns_as_a_server_run_and_a_killed_engine_ends_the_job_which_resumes(
    cluster, tmp_path, sft_model
):
    """The sevens task, 30 steps on two Ray nodes (two ranks on one, the vLLM server on the other), the server killed
    before step 25: the job ends naming the server and its log; --resume places new actors and trains from the
    checkpoint of step 20 to the end; the mean reward of the last 10 steps is at least twice that of the first 10.
    The first steps equal those of `placement: server` on one machine for the same seed (the same server, requests
    and seeds): the same completions, rewards and losses."""
    steps, run = 30, tmp_path / "run"  # the last 10 all trained after the resume
    job = ray_job(tmp_path, sft_model, steps)
    hook = tmp_path / "kill.py"
    hook.write_text(KILL_HOOK)
    env = {
        "RAY_ADDRESS": cluster.address,
        "WANDB_API_KEY": SECRET,  # a tracker's key in ft train's environment: the ranks get it, Ray's logs never
        "FT_STEP_HOOK": f"{hook}:kill_engine",
        "FT_TEST_KILL_AT": "25",
        "FT_TEST_RUN": str(run),
    }
    r = ft_train(job, "--hardware", "2x2xcpu", env=env, timeout=900)
    assert r.returncode != 0
    placed = re.search(
        r"Ray placement: node 0 = \S+ \((\w+)\): ranks 0-1; node 1 = \S+ \((\w+)\): vLLM server 0", r.stderr
    )
    assert placed and placed.group(1) != placed.group(2), r.stderr[-3000:]  # two nodes of the cluster
    assert re.search(r"the vLLM rollout server at http://[\d.]+:\d+ \(Ray node [\d.]+\) exited", r.stderr), r.stderr[
        -3000:
    ]
    assert "rollout-engine-0.log" in r.stderr and "--resume" in r.stderr and "Traceback" not in r.stderr
    assert not (run / "rollout-engines.json").exists()
    logs = Path(cluster.head_node.get_logs_dir_path())
    assert any(logs.rglob("runtime_env*.log"))  # where Ray writes each job's runtime environment
    for path in [p for p in logs.rglob("*") if p.is_file()] + [p for p in run.rglob("*") if p.is_file()]:
        assert SECRET.encode() not in path.read_bytes(), path  # secrets go to the actors' calls, not their env
    r = ft_train(job, "--hardware", "2x2xcpu", "--resume", env={"RAY_ADDRESS": cluster.address}, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    by_step = {g["step"]: g for g in rows(run)}
    assert sorted(by_step) == list(range(1, steps + 1))
    reward = [by_step[s]["reward"] for s in range(1, steps + 1)]
    first, last = sum(reward[:10]) / 10, sum(reward[-10:]) / 10
    assert last >= 2 * first, [round(x, 3) for x in reward]
    assert all(by_step[s]["logp_mismatch"] < 1e-3 for s in (1, 21))  # synced before generating, also after resuming
    assert not (run / "rollout-engines.json").exists()
    plan = json.loads((run / "plan.json").read_text())["rollout"]
    assert (plan["placement"], plan["engines"], plan["engine_nodes"]) == ("ray", 1, 1)
    (tmp_path / "server").mkdir()
    served = ray_job(tmp_path / "server", sft_model, 3, placement="server")
    r = ft_train(served, "--hardware", "cpu:2", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    alone = {g["step"]: g for g in rows(tmp_path / "server" / "run")}
    assert sorted(alone) == [1, 2, 3]
    for s in (1, 2, 3):  # the same completions (their rewards and lengths), so the same gradients
        a, b = by_step[s], alone[s]
        assert (a["reward"], a["completion_length"]) == (b["reward"], b["completion_length"]), (s, a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * b["grad_norm"], (s, a, b)
    url = re.findall(r"listening on (http://\S+)", (run / "rollout-engine-0.log").read_text())[-1]
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "/health", timeout=5)  # the resumed run's server was stopped with it
    import ray

    ray.init(address=cluster.address)
    try:  # the placement groups of both runs were removed
        from ray.util.placement_group import placement_group_table

        assert placement_group_table() and all(g["state"] == "REMOVED" for g in placement_group_table().values())
    finally:
        ray.shutdown()
