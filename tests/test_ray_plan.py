"""`method.rollout.placement: ray` as planned (plan/rollout.py) and laid out on a cluster (rollout/ray_layout.py),
without Ray: which nodes train and which generate, the engines and their tensor parallelism, what `ft plan` prints, the
placement group's bundles and the cluster's nodes they are pinned to, and the refusals. The runs on a Ray cluster are
in tests/test_vllm_ray.py (the vLLM environment)."""

from __future__ import annotations

import pytest

from finetune.config import loads
from finetune.errors import ConfigError, FtError, PlanError
from finetune.plan import rollout as placement
from finetune.plan.plan import Plan
from finetune.report import print_plan, rollout_line
from finetune.rollout.ray_layout import Bundle, Node, assign, bundles
from tests.rollout_helpers import FULL, GRPO, make

QWEN7B = "Qwen/Qwen2.5-7B-Instruct"
RAY = ["method.rollout.placement=ray"]
TINY = ["method.engine=vllm", "data.seq_len=64", "method.max_new_tokens=8", *RAY]


@pytest.fixture
def installed(monkeypatch):
    """Plans as where vLLM and Ray are installed (the main test environment has neither)."""
    monkeypatch.setattr(placement, "vllm_installed", lambda: True)
    monkeypatch.setattr(placement, "ray_installed", lambda: True)


def test_a_7b_on_two_nodes_trains_on_one_and_generates_on_the_other(installed, capsys, monkeypatch):
    p = make("2x8xH100-80GB", QWEN7B, RAY, text=FULL)
    r = p.rollout
    assert (r.placement, r.server_gpus, r.train_gpus, r.engines, r.tensor_parallel, r.engine_nodes) == (
        "ray",
        8,
        8,
        8,
        1,
        1,
    )
    assert (p.nodes, p.processes_per_node, p.world_size) == (1, 8, 8)
    assert r.memory_share == 0.9 and r.kv_cache_bytes > 0
    assert p.decision("rollout.nodes").value == "node 0 train, node 1 generate"
    assert p.decision("rollout.placement").source == "config"
    line = rollout_line(p)
    assert "the trainer's 8 ranks (8 per node) on node 0; one vLLM server on node 1 (8 GPUs), 8 engines" in line
    assert Plan.from_json(p.to_json()) == p
    monkeypatch.setenv("COLUMNS", "400")
    print_plan(p)
    out = " ".join(capsys.readouterr().out.split())
    assert "rollout.nodes" in out and "starts each rank as a Ray actor running python -m finetune.rank" in out
    assert "torchrun" not in out


def test_on_one_node_the_engines_take_some_of_its_gpus(installed):
    p = make("8xH100-80GB", QWEN7B, RAY, text=FULL)
    r = p.rollout
    assert r.engine_nodes == 0 and r.server_gpus + p.world_size == 8 and r.engines == r.server_gpus // r.tensor_parallel
    assert p.decision("rollout.nodes").value.startswith("node 0: GPUs 0-")


def test_a_70b_engine_takes_tensor_parallel_gpus_within_a_node(installed):
    p = make("4x8xH100-80GB", "meta-llama/Llama-3.3-70B-Instruct", RAY)
    r = p.rollout
    assert r.tensor_parallel > 1 and r.engines * r.tensor_parallel == r.server_gpus
    assert r.server_gpus % 8 == 0 and r.engine_nodes == r.server_gpus // 8 and p.nodes + r.engine_nodes == 4


def test_on_cpu_nodes_the_engine_gets_a_node_of_its_own(installed):
    two = make("2x1xcpu", "ft-tiny", TINY)
    assert (two.rollout.placement, two.rollout.engine_nodes, two.rollout.engines, two.nodes, two.world_size) == (
        "ray",
        1,
        1,
        1,
        1,
    )
    assert "node 1" in two.decision("rollout.placement").reason
    four = make("2x2xcpu", "ft-tiny", TINY)  # two processes on node 0, its second node the server's
    assert (four.world_size, four.rollout.engine_nodes) == (2, 1)
    assert four.decision("world_size").reason == "1 node × 2 processes (the 4 processes less the rollout pool's 2)"
    one = make("cpu:2", "ft-tiny", TINY)
    assert (one.rollout.engine_nodes, one.world_size) == (0, 2)
    assert "one vLLM server on node 0" in rollout_line(one)


def test_the_bundles_follow_the_plan_and_are_pinned_to_nodes_with_room(installed):
    p = make("2x8xH100-80GB", QWEN7B, RAY, text=FULL)
    layout = bundles(p)
    assert layout[:8] == [Bundle(0, "rank", i, 1) for i in range(8)] and layout[8:] == [Bundle(1, "engine", 0, 8)]
    head, small, big = (
        Node("a" * 8, "10.0.0.1", 64, 8),
        Node("b" * 8, "10.0.0.2", 64, 4),
        Node("c" * 8, "10.0.0.3", 64, 8),
    )
    assert assign(layout, [head, small, big], "head:6379") == {0: head, 1: big}
    with pytest.raises(FtError, match=r"(?s)method.rollout.placement: ray.*node 1 needs 1 CPUs and 8 GPUs.*add nodes"):
        assign(layout, [head, small], "head:6379")
    cpu = make("2x1xcpu", "ft-tiny", TINY)
    assert bundles(cpu) == [Bundle(0, "rank", 0, 0), Bundle(1, "engine", 0, 0)]
    assert Bundle(1, "engine", 0, 8).resources() == {"CPU": 1.0, "GPU": 8.0}


def test_ray_missing_or_the_wrong_engine_is_refused_naming_the_key(monkeypatch):
    monkeypatch.setattr(placement, "vllm_installed", lambda: True)
    monkeypatch.setattr(placement, "ray_installed", lambda: False)
    with pytest.raises(PlanError, match=r"(?s)method.rollout.placement: ray.*pip install 'finetune\[ray\]'"):
        make("2x8xH100-80GB", QWEN7B, RAY, text=FULL)
    with pytest.raises(ConfigError, match=r"method.engine: vllm"):
        loads(GRPO, overrides=[*RAY, "method.engine=transformers"], environ={})
    with pytest.raises(ConfigError, match=r"remove method.rollout.url"):
        loads(GRPO, overrides=[*RAY, "method.rollout.url=http://node7:8420"], environ={})
    monkeypatch.setattr(placement, "ray_installed", lambda: True)
    with pytest.raises(PlanError, match=r"placement: ray needs GPUs of its own"):
        make("1xH100-80GB", QWEN7B, RAY, text=FULL)
    with pytest.raises(PlanError, match=r"placement: ray runs vLLM's servers.*method.engine: vllm"):
        make("cpu", "ft-tiny", [*RAY, "data.seq_len=64"])  # auto chooses transformers on CPU


def test_ft_validate_refuses_ray_where_it_is_not_installed(tmp_path, monkeypatch):
    from finetune.workflow import check_job

    monkeypatch.setattr(placement, "ray_installed", lambda: False)
    job = tmp_path / "job.yaml"
    job.write_text(GRPO)
    with pytest.raises(FtError, match=r"pip install 'finetune\[ray\]'"):
        check_job(job, [*RAY, "method.engine=vllm"])
    monkeypatch.setattr(placement, "ray_installed", lambda: True)
    with pytest.raises(FtError, match=r"data/train.jsonl"):  # on to the next check: the data path
        check_job(job, [*RAY, "method.engine=vllm"])


def test_a_cluster_address_nothing_answers_at_is_refused_before_ray_waits_on_it():
    """Ray's driver retries an unreachable cluster without end: ft train checks the address first."""
    import socket

    from finetune.rollout.ray_run import reachable

    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]  # bound, not listening: a connection is refused
        with pytest.raises(
            FtError, match=rf"(?s)placement: ray: nothing answers at .*127.0.0.2:{port}.*ray start --head"
        ):
            reachable(f"127.0.0.2:{port}")
        s.listen()
        reachable(f"127.0.0.2:{port}")  # a cluster that answers: on to ray.init
    reachable("auto")  # left to Ray


def test_ft_launch_refuses_a_job_that_runs_on_ray(installed):
    """ft launch --slurm/--k8s start ft train on every node through torchrun; a Ray job runs ft train once."""
    from finetune.workflow import refuse_ray

    with pytest.raises(FtError, match=r"(?s)placement: ray: ft launch --slurm.*ray start"):
        refuse_ray(make("2x8xH100-80GB", QWEN7B, RAY, text=FULL), "--slurm")
    refuse_ray(make("2x8xH100-80GB", QWEN7B, ["method.rollout.placement=server"], text=FULL), "--slurm")


def test_each_rank_sees_its_nodes_gpus_with_its_own_at_local_rank_and_joins_rank_0(installed, tmp_path):
    """Across two training nodes (a 70B on 4 x 8 GPUs): whatever GPU ids Ray gives the rank actors, each rank's
    device LOCAL_RANK is its own GPU, it sees exactly its node's ranks' GPUs, and the group meets at rank 0's node."""
    from finetune.rollout.ray_layout import rank_environment

    p = make("4x8xH100-80GB", "meta-llama/Llama-3.3-70B-Instruct", RAY)
    ranks = [b for b in bundles(p) if b.role == "rank"]
    assert p.nodes == 2 and len(ranks) == 16
    places = [
        {"address": f"10.0.0.{b.node + 1}", "port": 29400 + b.index, "gpus": [str(7 - b.index % 8)]} for b in ranks
    ]
    for b in ranks:
        env = rank_environment(p, b, places, tmp_path)
        visible = env["CUDA_VISIBLE_DEVICES"].split(",")
        assert visible[int(env["LOCAL_RANK"])] == places[b.index]["gpus"][0]
        assert sorted(visible) == sorted(pl["gpus"][0] for pl, r in zip(places, ranks) if r.node == b.node)
        assert (env["RANK"], env["WORLD_SIZE"], env["NODE_RANK"]) == (str(b.index), "16", str(b.node))
        assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["FT_ROLLOUT_NCCL_ADDR"]) == (
            "10.0.0.1",
            "29400",
            "10.0.0.1",
        )


def test_secrets_reach_the_actors_as_call_arguments_and_never_the_runtime_environment(monkeypatch):
    """Ray's runtime-env agent writes a job's runtime environment into its log: ft train's secret-named variables and
    the rollout token go to the actors' calls instead (rollout/ray_actors.py sets them in its processes' env)."""
    from finetune.rollout.factory import TOKEN_ENV
    from finetune.rollout.ray_layout import actor_env

    monkeypatch.setenv("HF_HOME", "/models")
    monkeypatch.setenv("HF_TOKEN", "hf_abc")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("FT_STEP_HOOK", "hook.py:f")
    monkeypatch.setenv("UNRELATED_PASSWORD", "x")  # not forwarded at all
    public, secrets = actor_env("t0ken")
    assert public["HF_HOME"] == "/models" and public["FT_STEP_HOOK"] == "hook.py:f"
    assert secrets == {"HF_TOKEN": "hf_abc", "WANDB_API_KEY": "0" * 40, TOKEN_ENV: "t0ken"}
    assert not set(public) & set(secrets) and "UNRELATED_PASSWORD" not in public
