"""The planner places GRPO's rollout engine (plan/rollout.py), table-driven on described hardware: the engine, colocated
or a pool of GPUs, tensor parallelism, the memory share, the trainer's world size, refusals, plan.json, the report."""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest

from finetune.catalog import lookup
from finetune.errors import ConfigError, PlanError
from finetune.hardware import parse
from finetune.plan import rollout as placement
from finetune.plan.cost import generation_seconds
from finetune.plan.memory import ROLLOUT, ROLLOUT_HOST, GiB, Setup, estimate
from finetune.plan.plan import Plan, RolloutPlan
from finetune.plan.search import device_capacity
from finetune.report import print_plan, rollout_line
from tests.helpers import MINIMAL
from tests.rollout_helpers import LLAMA8B, make

LLAMA70B, QWEN = "meta-llama/Llama-3.3-70B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct"


@pytest.fixture
def vllm(monkeypatch):
    """Plans as where vLLM is installed (the test environment has none)."""
    monkeypatch.setattr(placement, "vllm_installed", lambda: True)


def decision(p: Plan, field: str):
    return p.decision(field)


# ---------------------------------------------------------------- the engine
def test_a_method_that_samples_nothing_has_no_rollout():
    assert make("8xH100-80GB", text=MINIMAL).rollout is None


@pytest.mark.parametrize("hardware", ["1xH100-80GB", "cpu"])
def test_transformers_samples_inline_where_vllm_is_not_used(monkeypatch, hardware):
    monkeypatch.setattr(placement, "vllm_installed", lambda: False)
    model = "ft-tiny" if hardware == "cpu" else LLAMA8B
    p = make(hardware, model, ["data.seq_len=256", "method.max_new_tokens=64"])
    r = p.rollout
    assert isinstance(r, RolloutPlan)
    assert (r.engine, r.placement, r.server_gpus, r.tensor_parallel, r.memory_share, r.sleep) == (
        "transformers",
        "inline",
        0,
        1,
        0.0,
        False,
    )
    assert r.train_gpus == (0 if hardware == "cpu" else p.world_size)
    assert r.sync_seconds == 0 and r.generation_seconds > 0 and r.training_seconds > 0
    # the KV cache of each rank's share: 2 × layers × kv_dim × 2 bytes (bf16) or 4 (fp32) × 256 tokens × 32 sequences
    m = lookup(model)
    assert r.kv_cache_bytes == 2 * m.num_layers * m.kv_dim * (4 if hardware == "cpu" else 2) * 256 * 32
    assert ROLLOUT not in p.estimate.device
    reason = decision(p, "engine").reason
    assert ("no GPU" in reason) if hardware == "cpu" else ("not installed" in reason)


def test_auto_engine_is_vllm_on_gpus_where_it_is_installed(vllm):
    p = make("8xH100-80GB", QWEN, ["method.max_new_tokens=128"])
    assert p.rollout.engine == "vllm" and decision(p, "engine").source == "auto"
    dora = make("8xH100-80GB", QWEN, ["method.max_new_tokens=128", "adapter.dora=true"])
    assert dora.rollout.engine == "transformers" and "DoRA" in decision(dora, "engine").reason


def test_the_trainer_generates_only_inline():
    """The GRPO KV cache term is the training model's own: with vLLM sampling, the trainer holds none."""
    long = ["data.seq_len=4096", "method.max_new_tokens=3072", "train.global_batch_size=256"]
    long += ["train.micro_batch_size=1", "train.gradient_checkpointing=true"]  # training's peak below the rollout's
    inline = make("8xH100-80GB", overrides=long)
    assert inline.rollout.engine == "transformers" and "generation (KV cache)" in inline.estimate.device
    vllm = make("8xH100-80GB", overrides=[*long, "method.engine=vllm"])
    assert vllm.rollout.engine == "vllm" and "generation (KV cache)" not in vllm.estimate.device


# ---------------------------------------------------------------- placement on GPUs
def test_a_small_model_with_short_generation_is_colocated(vllm):
    p = make("8xH100-80GB", QWEN, ["method.max_new_tokens=128"])
    r = p.rollout
    assert (r.placement, r.server_gpus, r.train_gpus, p.world_size, r.tensor_parallel) == (
        "colocated",
        0,
        8,
        8,
        1,
    )
    total = parse("8xH100-80GB").device_memory_bytes
    assert 0 < r.memory_share <= 0.9 and p.estimate.device[ROLLOUT] == int(r.memory_share * total)
    assert p.estimate.device_bytes <= p.device_capacity_bytes  # the engine's share fits next to the trainer
    # one rollout's KV cache per engine: 64 sequences over 8 engines, each of seq_len tokens
    m = lookup(QWEN)
    assert r.kv_cache_bytes == 2 * m.num_layers * m.kv_dim * 2 * 2048 * 4
    assert (
        decision(p, "rollout.placement").source == "auto"
        and "a pool of 4 GPUs" in decision(p, "rollout.placement").reason
    )


def test_asynchronous_long_generation_takes_a_pool_and_the_trainer_the_rest(vllm):
    p = make("8xH100-80GB", overrides=["method.rollout.asynchronous=true", "method.max_new_tokens=1536"])
    r = p.rollout
    assert r.placement == "server" and r.server_gpus == 4 and r.sleep is False
    assert p.world_size == r.train_gpus == 8 - r.server_gpus and p.processes_per_node == 4
    assert "--nproc-per-node=4" in p.launch  # torchrun starts the trainer's ranks only
    assert "rollout pool's 4" in decision(p, "world_size").reason
    # the step is max(generation, training) + sync: generation dominates, so the pool's step is its generation
    assert r.generation_seconds > r.training_seconds
    assert "max(generation, training)" in decision(p, "rollout.placement").reason
    assert ROLLOUT not in p.estimate.device  # the pool's GPUs hold the engine, not the trainer's


def test_across_nodes_the_pool_is_whole_nodes(vllm):
    p = make("2x8xH100-80GB", overrides=["method.rollout.asynchronous=true"])
    r = p.rollout
    assert (r.placement, r.server_gpus, r.train_gpus, p.nodes, p.world_size) == ("server", 8, 8, 1, 8)


def test_a_pinned_share_colocated_cannot_take_moves_the_engine_to_a_pool(vllm):
    """0.95 of an H100 leaves too little for even a sharded trainer; a pool GPU holds only the engine."""
    p = make("8xH100-80GB", overrides=["method.rollout.memory_share=0.95"])
    r = p.rollout
    assert r.placement == "server" and r.memory_share == 0.95 and r.server_gpus in (1, 2, 4)
    assert p.world_size == 8 - r.server_gpus
    assert "colocated does not fit" in decision(p, "rollout.placement").reason


def test_tensor_parallel_grows_until_the_weights_fit_a_share(vllm):
    p = make("8xH100-80GB", LLAMA70B)
    r = p.rollout
    assert r.engine == "vllm" and r.tensor_parallel == 4  # 131 GiB of bf16 weights: 66 at TP 2 is too many
    m, total = lookup(LLAMA70B), parse("8xH100-80GB").device_memory_bytes
    assert 2 * m.num_params / 4 < r.memory_share * total < 2 * m.num_params / 2
    assert decision(p, "rollout.tensor_parallel").source == "auto"


def test_the_engine_sleeps_when_awake_it_would_crowd_the_trainer(vllm):
    p = make("1xH100-80GB", overrides=["data.seq_len=4096", "method.max_new_tokens=2048", "train.global_batch_size=80"])
    r = p.rollout
    assert r.placement == "colocated" and r.sleep is True
    # asleep during the backward pass: the rollout phase (resident state + the engine's share) is the peak, and the
    # engine's weights wait in host RAM
    assert p.estimate.device[ROLLOUT] == int(r.memory_share * parse("1xH100-80GB").device_memory_bytes)
    assert "activations" not in p.estimate.device and p.estimate.device_bytes <= p.device_capacity_bytes
    assert p.estimate.host[ROLLOUT_HOST] == 2 * lookup(LLAMA8B).num_params
    resident = p.estimate.device_bytes - p.estimate.device[ROLLOUT]
    share = (device_capacity(parse("1xH100-80GB")) - resident) / parse("1xH100-80GB").device_memory_bytes
    assert r.memory_share == pytest.approx(math.floor(share * 100) / 100, abs=0.011)
    assert "sleeps" in decision(p, "rollout.memory_share").reason


def test_an_external_server_keeps_every_gpu_for_the_trainer(vllm):
    p = make("8xH100-80GB", overrides=["method.rollout.url=http://node7:8420"])
    r = p.rollout
    assert (r.placement, r.server_gpus, r.train_gpus, r.url) == ("server", 0, 8, "http://node7:8420")
    assert decision(p, "rollout.placement").source == "config"


# ---------------------------------------------------------------- CPU
def test_vllm_on_cpu_is_colocated_with_its_kv_cache_in_gib():
    p = make("cpu", "ft-tiny", ["method.engine=vllm", "data.seq_len=64", "method.max_new_tokens=8"])
    r = p.rollout
    assert (r.placement, r.server_gpus, r.train_gpus, r.tensor_parallel, r.memory_share) == (
        "colocated",
        0,
        0,
        1,
        0.0,
    )
    assert r.kv_cache_bytes == GiB and r.sleep is False
    weights = 4 * lookup("ft-tiny").num_params  # fp32 on CPU
    assert p.estimate.device[ROLLOUT] == weights + GiB
    bigger = make("cpu", "ft-tiny", ["method.engine=vllm", "method.rollout.kv_cache_gib=2", "data.seq_len=64"])
    assert bigger.rollout.kv_cache_bytes == 2 * GiB
    server = make("cpu:2", "ft-tiny", ["method.engine=vllm", "method.rollout.placement=server", "data.seq_len=64"])
    assert server.rollout.placement == "server" and server.rollout.server_gpus == 0 and server.world_size == 2
    assert ROLLOUT not in server.estimate.device


def test_vllm_on_cpu_refuses_linear_attention_layers_outside_bf16():
    """vLLM's CPU kernel for gated delta-net layers (Qwen3.5, Qwen3-Next) takes bf16 only and asserts it at the
    engine's first step: a CPU plan that would generate in fp32 is refused, naming both ways out; in bf16 the
    refusal goes (this 27B model then does not fit this machine's memory, a different refusal)."""
    on_cpu = ["method.engine=vllm", "data.seq_len=64", "method.max_new_tokens=8"]
    with pytest.raises(PlanError) as refused:
        make("cpu", "Qwen/Qwen3.5-27B", on_cpu)
    assert "method.engine: vllm" in str(refused.value) and "bf16 only" in str(refused.value)
    assert "train.precision: bf16" in str(refused.value) and "method.engine: transformers" in str(refused.value)
    with pytest.raises(PlanError) as other:
        make("cpu", "Qwen/Qwen3.5-27B", [*on_cpu, "train.precision=bf16"])
    assert "gated delta-net" not in str(other.value)
    assert make("cpu", "ft-tiny", on_cpu).rollout.engine == "vllm"  # fp32 where every layer is attention


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "hardware,model,overrides,needle",
    [
        ("1xH100-80GB", LLAMA8B, ["method.rollout.placement=server"], "method.rollout.placement: server"),
        (
            "8xH100-80GB",
            LLAMA8B,
            ["method.rollout.placement=colocated", "method.rollout.memory_share=0.95"],
            "method.rollout.memory_share: 0.95",
        ),
        ("8xH100-80GB", LLAMA8B, ["method.rollout.tensor_parallel=3"], "method.rollout.tensor_parallel: 3"),
        ("8xH100-80GB", LLAMA8B, ["method.rollout.tensor_parallel=16"], "method.rollout.tensor_parallel: 16"),
        ("2x8xH100-80GB", LLAMA8B, ["method.rollout.gpus=4"], "method.rollout.gpus: 4"),
        ("8xH100-80GB", LLAMA8B, ["method.rollout.gpus=8"], "method.rollout.gpus: 8"),
        ("1xA10G-24GB", LLAMA8B, ["method.engine=vllm"], "method.engine: vllm"),
        ("cpu", "ft-tiny", ["method.engine=vllm", "method.rollout.tensor_parallel=2"], "tensor_parallel: 2"),
    ],
)
def test_impossible_placements_are_refused_naming_the_key(vllm, hardware, model, overrides, needle):
    with pytest.raises(PlanError) as e:
        make(hardware, model, overrides)
    assert needle in str(e.value) and ("set " in str(e.value) or "auto" in str(e.value))


def test_an_engine_that_does_not_fit_falls_back_to_transformers_unless_pinned(vllm):
    p = make("1xA10G-24GB")
    assert p.rollout.engine == "transformers" and "vLLM does not fit" in decision(p, "engine").reason


def test_asynchronous_rollouts_need_vllm(monkeypatch):
    monkeypatch.setattr(placement, "vllm_installed", lambda: False)
    with pytest.raises(PlanError, match="method.rollout.asynchronous"):
        make("8xH100-80GB", overrides=["method.rollout.asynchronous=true"])


# ---------------------------------------------------------------- cost and memory models
def test_generation_time_is_memory_bound_per_token():
    m, h100, h200 = lookup(LLAMA8B), parse("1xH100-80GB"), parse("1xH200")
    w = 2 * m.num_params
    one = generation_seconds(m, h100, "bf16", w, 256, 512, 8)
    assert generation_seconds(m, h100, "bf16", w, 256, 1024, 8) == pytest.approx(2 * one, rel=0.15)
    assert generation_seconds(m, h100, "bf16", w, 256, 512, 8, tensor_parallel=2) == pytest.approx(one / 2, rel=0.01)
    assert generation_seconds(m, h200, "bf16", w, 256, 512, 8) == pytest.approx(one * 3.35 / 4.8, rel=0.01)
    # 512 steps each reading the weights at 60% of 3.35 TB/s, at least
    assert one > 512 * w / (3.35e12 * 0.6)


def test_a_sleeping_engine_counts_against_resident_state_and_an_awake_one_adds():
    m = lookup(LLAMA8B)
    base = dict(adapter="lora", quantization="none", precision="bf16", optimizer="adamw_torch", seq_len=2048)
    plain = estimate(m, Setup(**base, micro_batch_size=1, gradient_checkpointing=False))
    small = estimate(
        m, Setup(**base, micro_batch_size=1, gradient_checkpointing=False, rollout_bytes=GiB, rollout_sleeps=True)
    )
    assert ROLLOUT not in small.device and small.device_bytes == plain.device_bytes  # training is the peak
    big = estimate(
        m,
        Setup(**base, micro_batch_size=1, gradient_checkpointing=False, rollout_bytes=40 * GiB, rollout_sleeps=True),
    )
    assert big.device[ROLLOUT] == 40 * GiB and "activations" not in big.device
    awake = estimate(m, Setup(**base, micro_batch_size=1, gradient_checkpointing=False, rollout_bytes=GiB))
    assert awake.device[ROLLOUT] == GiB and awake.device_bytes == plain.device_bytes + GiB


# ---------------------------------------------------------------- plan.json and the report
def test_plan_json_round_trip_keeps_the_rollout(vllm):
    p = make("8xH100-80GB", overrides=["method.rollout.asynchronous=true"])
    j = p.to_json()
    assert j["rollout"] == asdict(p.rollout)  # the same keys and values as the dataclass
    assert Plan.from_json(j) == p
    old = {k: v for k, v in j.items() if k != "rollout"}  # a plan written before rollouts were placed
    assert Plan.from_json(old).rollout is None and Plan.from_json({**j, "rollout": {}}).rollout is None
    assert make("8xH100-80GB", text=MINIMAL).to_json()["rollout"] == {}


def test_ft_plan_shows_the_placement_and_its_reasons(vllm, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    p = make("8xH100-80GB", overrides=["method.rollout.asynchronous=true"])
    line = rollout_line(p)
    assert "vLLM on a pool of 4 GPUs (the trainer on 4), tensor parallel 1, memory share 0.9" in line
    assert "max(generation" in line and "asynchronous" in line
    print_plan(p)
    out = " ".join(capsys.readouterr().out.split())  # the console wraps lines at its width, whatever COLUMNS says
    assert " ".join(line.split()) in out and "rollout.placement" in out and "rollout.tensor_parallel" in out
    colocated = make("8xH100-80GB", QWEN, ["method.max_new_tokens=128"])
    assert rollout_line(colocated).startswith("Rollouts: vLLM colocated in each training GPU, tensor parallel 1")


def test_the_plan_states_how_many_rollouts_are_generated_ahead(vllm):
    one = make("8xH100-80GB", overrides=["method.rollout.asynchronous=true"])
    three = make("8xH100-80GB", overrides=["method.rollout.asynchronous=true", "method.rollout.max_staleness=3"])
    assert one.rollout.max_staleness == 1 and three.rollout.max_staleness == 3
    assert "(asynchronous: one rollout generated ahead, one rollout off-policy)" in rollout_line(one)
    assert "(asynchronous: up to 3 rollouts generated ahead, up to 3 rollouts off-policy)" in rollout_line(three)
    assert Plan.from_json(three.to_json()).rollout.max_staleness == 3
    with pytest.raises(ConfigError, match="method.rollout.max_staleness"):
        make("8xH100-80GB", overrides=["method.rollout.max_staleness=3"])  # without asynchronous: refused
