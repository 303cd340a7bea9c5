"""The planner's tensor- and context-parallel degrees and its predicted scaling, table-driven on described hardware."""

from __future__ import annotations

import re

import pytest

from finetune.catalog import lookup
from finetune.config import load, loads
from finetune.errors import PlanError
from finetune.hardware import parse
from finetune.plan import plan
from finetune.plan.comm import CONTEXT_PARALLEL, TENSOR_PARALLEL, Links
from finetune.plan.plan import Plan
from finetune.plan.scaling import predict
from finetune.report import print_plan
from finetune.workflow import compile_plan
from tests.helpers import MINIMAL, REPO

L70 = "meta-llama/Llama-3.3-70B-Instruct"
L8 = "meta-llama/Llama-3.1-8B"
EXAMPLES = REPO / "examples" / "yaml"
LONG = ["data.seq_len=131072", "data.packing=false", "train.global_batch_size=8"]
FULL = MINIMAL.replace("adapter: {type: lora, r: 16, alpha: 32, target_modules: all-linear}", "adapter: {type: full}")


def make(model, hardware, overrides=(), text=MINIMAL, speeds=None):
    cfg = loads(text, overrides=[f"model.name={model}", *overrides], environ={})
    return plan(cfg, parse(hardware), lookup(model), speeds=speeds)


def refusal(model, hardware, overrides, text=MINIMAL) -> str:
    with pytest.raises(PlanError) as e:
        make(model, hardware, overrides, text)
    return str(e.value)


# (model, hardware, overrides, text) -> (tensor_parallel, context_parallel); None: any degree above 1
CHOICES = [
    # FSDP of a big model across nodes: each layer split inside a node, so that each rank gathers 1/tp of it
    (L70, "2x8xH100-80GB", ["distributed.sharding=full_shard", "distributed.backend=fsdp"], MINIMAL, (None, 1)),
    (L8, "4x8xH100-80GB", ["distributed.sharding=full_shard"], FULL, (None, 1)),
    # ... but not at a pinned micro-batch of 1: a split halves what each micro-batch gathers and reduces and doubles
    # each rank's micro-batches (a full fine-tune reduces gradients after every one), so no split pays
    (L8, "4x8xH100-80GB", ["distributed.sharding=full_shard", "train.micro_batch_size=1"], FULL, (1, 1)),
    # one node, a model whose replica fits: no split pays
    (L8, "8xH100-80GB", [], MINIMAL, (1, 1)),
    (L8, "8xH100-80GB", [], FULL, (1, 1)),
    # across nodes with hybrid_shard available, FSDP's all-gathers already stay in a node
    (L70, "2x8xH100-80GB", [], MINIMAL, (1, 1)),
    # one 128k-token sequence of a 70B model: its activations only fit split over the ranks of a node
    (L70, "8xH100-80GB", LONG, MINIMAL, (1, None)),
    # CPU-only hardware: auto never splits
    ("ft-tiny", "cpu:2", ["data.seq_len=256", "train.global_batch_size=2"], MINIMAL, (1, 1)),
    ("ft-tiny", "cpu:4", ["data.seq_len=32768", "data.packing=false", "train.global_batch_size=4"], MINIMAL, (1, 1)),
]


@pytest.mark.parametrize("model, hardware, overrides, text, expected", CHOICES)
def test_degrees_chosen_inside_a_node_where_they_pay(model, hardware, overrides, text, expected):
    p = make(model, hardware, overrides, text)
    for got, want in zip((p.tensor_parallel, p.context_parallel), expected):
        assert got > 1 if want is None else got == want
    inner = p.tensor_parallel * p.context_parallel
    assert p.processes_per_node % inner == 0  # never across nodes: a tp x cp group is ranks of one node
    assert p.data_parallel * inner == p.world_size
    assert p.global_batch_size == p.micro_batch_size * p.gradient_accumulation_steps * p.data_parallel
    assert p.decision("tensor_parallel").reason and p.decision("context_parallel").reason
    if inner > 1:
        assert p.backend == "fsdp" and p.sharding in ("full_shard", "shard_grad_op") and p.quantization == "none"
    if hardware.startswith("cpu"):
        assert "CPU" in p.decision("tensor_parallel").reason


def test_a_split_reports_why_and_moves_traffic_onto_intra_node_links():
    tp = make(L70, "2x8xH100-80GB", ["distributed.sharding=full_shard", "distributed.backend=fsdp"])
    reason = tp.decision("tensor_parallel").reason
    assert f"split over {tp.tensor_parallel} GPUs of a node" in reason
    assert re.search(r"est\. [\d.]+ s/step against [\d.]+ without", reason) or "nothing fits without" in reason
    rows = tp.scaling["collectives"]
    assert rows[TENSOR_PARALLEL]["link"] == "intra-node" and rows["all-gather parameters"]["link"] == "inter-node"
    plain = make(
        L70,
        "2x8xH100-80GB",
        ["distributed.sharding=full_shard", "distributed.backend=fsdp", "distributed.tensor_parallel=1"],
    )
    assert TENSOR_PARALLEL not in plain.communication
    assert tp.communication_seconds < plain.communication_seconds
    assert sum(tp.step_seconds.values()) < sum(plain.step_seconds.values())


def test_long_sequences_split_activations_over_a_ring():
    p = make(L70, "8xH100-80GB", LONG)
    assert p.seq_len % (2 * p.context_parallel) == 0
    assert CONTEXT_PARALLEL in p.communication and p.scaling["collectives"][CONTEXT_PARALLEL]["link"] == "intra-node"
    pinned = make(L70, "8xH100-80GB", [*LONG, f"train.micro_batch_size={p.micro_batch_size}"])
    one = replace_cp(pinned, 1)
    assert one is None or one.estimate.device["activations"] > p.estimate.device["activations"]
    short = make(L70, "8xH100-80GB", ["data.packing=false"])
    assert short.context_parallel == 1 and "16384" in short.decision("context_parallel").reason


def test_a_split_that_alone_fits_says_so():
    p = make(L70, "8xH100-80GB", ["data.seq_len=196608", "data.packing=false", "train.global_batch_size=8"])
    assert p.context_parallel > 1 and "nothing fits without it" in p.decision("context_parallel").reason
    with pytest.raises(PlanError, match="does not fit"):
        make(
            L70,
            "8xH100-80GB",
            [
                "data.seq_len=196608",
                "data.packing=false",
                "train.global_batch_size=8",
                "distributed.context_parallel=1",
            ],
        )


def replace_cp(p: Plan, cp: int) -> Plan | None:
    """The same plan with context_parallel pinned (None when it does not fit)."""
    try:
        return make(
            L70,
            "8xH100-80GB",
            [
                *LONG,
                f"distributed.context_parallel={cp}",
                "distributed.tensor_parallel=1",
                f"train.micro_batch_size={p.micro_batch_size}",
            ],
        )
    except PlanError:
        return None


# (model, hardware, overrides, text) -> what the error must name
REFUSALS = [
    (L8, "8xH100-80GB", ["distributed.tensor_parallel=3"], MINIMAL, ["attention heads (32)", "KV heads (8)"]),
    (L8, "8xH100-80GB", ["distributed.tensor_parallel=2", "adapter.dora=true"], MINIMAL, ["DoRA"]),
    (
        "ft-tiny",
        "cpu:2",
        ["distributed.context_parallel=2", "data.packing=false", "data.seq_len=64", "train.global_batch_size=2"],
        MINIMAL,
        ["CPU", "CUDA"],
    ),
    (L8, "2x8xH100-80GB", ["distributed.tensor_parallel=16"], MINIMAL, ["spans nodes", "inside a node"]),
    (L8, "8xH100-80GB", ["distributed.tensor_parallel=2", "distributed.backend=deepspeed"], MINIMAL, ["FSDP2 only"]),
    (L8, "8xH100-80GB", ["distributed.tensor_parallel=2", "distributed.backend=ddp"], MINIMAL, ["backend ddp"]),
    (L8, "8xH100-80GB", ["distributed.tensor_parallel=2", "adapter.type=qlora"], MINIMAL, ["4/8-bit base"]),
    (
        L8,
        "8xH100-80GB",
        ["distributed.context_parallel=4", "data.seq_len=1020", "data.packing=false"],
        MINIMAL,
        ["2 x 4", "set data.seq_len: 1024"],
    ),
    (L8, "8xH100-80GB", ["distributed.context_parallel=2"], MINIMAL, ["packing"]),
    (
        L8,
        "8xH100-80GB",
        ["distributed.context_parallel=2", "data.packing=false", "model.attn_implementation=eager"],
        MINIMAL,
        ["ring attention wraps sdpa"],
    ),
]


@pytest.mark.parametrize("model, hardware, overrides, text, needles", REFUSALS)
def test_explicit_degrees_that_break_a_rule_are_refused_by_name(model, hardware, overrides, text, needles):
    message = refusal(model, hardware, overrides, text)
    key = overrides[0].split("=")[0]
    assert f"{key}: " in message
    assert all(re.search(r"\b(set|use|choose)\b", line) for line in message.splitlines())  # each with its fix
    for needle in needles:
        assert needle in message


def test_every_problem_is_reported_together():
    message = refusal(L8, "8xH100-80GB", ["distributed.tensor_parallel=3", "distributed.context_parallel=3"])
    assert "distributed.tensor_parallel: 3" in message and "distributed.context_parallel: 3" in message
    assert "attention heads (32)" in message and "packing" in message and "seq_len" in message


def test_context_parallelism_refuses_other_methods():
    config = load(EXAMPLES / "qwen2.5-7b-dpo.yaml", ["distributed.context_parallel=2", "data.packing=false"])
    with pytest.raises(PlanError, match=r"distributed.context_parallel: 2: method dpo: .*SFT only"):
        plan(config, parse("8xH100-80GB"), lookup(config.model.name))


def test_the_global_batch_is_split_over_the_data_parallel_ranks():
    p = make(L8, "8xH100-80GB", ["distributed.tensor_parallel=2", "train.global_batch_size=4"], FULL)
    assert (p.tensor_parallel, p.data_parallel, p.global_batch_size) == (2, 4, 4)
    assert p.micro_batch_size * p.gradient_accumulation_steps * 4 == 4
    assert "4 data-parallel ranks" in p.decision("gradient_accumulation_steps").reason
    with pytest.raises(PlanError, match="over 4 data-parallel ranks"):
        make(L8, "8xH100-80GB", ["distributed.tensor_parallel=2", "train.global_batch_size=6"], FULL)
    again = Plan.from_json(p.to_json())
    assert (again.tensor_parallel, again.context_parallel, again.scaling) == (2, 1, p.scaling)


def test_a_split_divides_the_layers_state_and_activations():
    pins = ["distributed.backend=fsdp", "distributed.sharding=full_shard", "train.micro_batch_size=1"]
    one = make(L8, "8xH100-80GB", [*pins, "distributed.tensor_parallel=1"], FULL)
    two = make(L8, "8xH100-80GB", [*pins, "distributed.tensor_parallel=2"], FULL)
    one_d, two_d = one.estimate.device, two.estimate.device
    # tp halves each decoder layer in flight; the embeddings and the head are FSDP2 units there (each gathered whole
    # while it runs, beside a layer), where the 1-D mesh walks them by vocabulary rows (distributed/vocab.py)
    facts, bf16 = lookup(L8), 2
    layers = 2 * facts.layer_params * bf16
    assert two_d["gathered layers"] - bf16 * facts.lm_head_params <= layers / 2 < one_d["gathered layers"]
    assert two_d["activations"] == pytest.approx(one_d["activations"] / 2, rel=0.01)
    # the FSDP group halves, the layers halve: optimizer state per rank grows only by the embeddings' share
    assert one_d["optimizer"] < two_d["optimizer"] < 1.2 * one_d["optimizer"]


# ---------------------------------------------------------------- predicted scaling
GPU_EXAMPLES = [
    "llama3.1-8b-full-8xh100.yaml",
    "llama3.1-8b-lora-24gb.yaml",
    "llama3.3-70b-qlora-2gpu.yaml",
    "mistral-7b-zero3-2x8xa100.yaml",
    "qwen2.5-7b-dpo.yaml",
    "qwen2.5-7b-grpo-vllm-2x8xh100.yaml",
    "qwen2.5-7b-qlora.yaml",
    "qwen2.5-1.5b-grpo.yaml",
]


@pytest.mark.parametrize("name", GPU_EXAMPLES)
def test_examples_scale_to_one_8_gpu_node(name):
    s = compile_plan(EXAMPLES / name, hardware="8xH100-80GB").scaling
    assert s["step_seconds"] == pytest.approx(s["compute_seconds"] + s["exposed_seconds"], abs=1e-5)
    assert s["exposed_seconds"] + s["overlapped_seconds"] == pytest.approx(s["communication_seconds"], abs=1e-5)
    assert 0.85 <= s["efficiency"] <= 1


def test_scaling_is_in_the_json_and_the_table(capsys):
    p = compile_plan(EXAMPLES / "llama3.1-8b-full-8xh100.yaml", hardware="8xH100-80GB")
    data = p.to_json()["scaling"]
    assert {"compute_seconds", "communication_seconds", "overlapped_seconds", "efficiency"} <= set(data)
    print_plan(p)
    out = " ".join(capsys.readouterr().out.split())
    assert f"Predicted scaling: {data['efficiency']:.0%} of one device's speed" in out
    assert f"communication {data['communication_seconds']:.3g} s" in out
    single = make(L8, "1xH100-80GB")
    assert single.scaling == {}


# backend, sharding, adapter -> gradient reductions per step of k micro-batches (distributed/engine.py: FSDP2 syncs
# every micro-batch of a full fine-tune; DDP uses no_sync; deepspeed 0.19 with ft's unmanaged accumulation reduces
# ZeRO-2/3 partitions in every backward and ZeRO-1 in step())
REDUCTIONS = [
    ("fsdp", "full_shard", "full", "k"),
    ("fsdp", "shard_grad_op", "full", "k"),
    ("fsdp", "hybrid_shard", "full", "k"),
    ("fsdp", "full_shard", "lora", 1),
    ("deepspeed", "zero3", "full", "k"),
    ("deepspeed", "zero3", "lora", "k"),
    ("deepspeed", "zero2", "full", "k"),
    ("deepspeed", "zero1", "full", 1),
    ("ddp", None, "full", 1),
]


@pytest.mark.parametrize("backend, sharding, adapter, reductions", REDUCTIONS)
def test_gradients_are_counted_as_often_as_the_engine_reduces_them(backend, sharding, adapter, reductions):
    from finetune.plan.comm import step_traffic

    n, t = 8_030_261_248, 41_943_040
    trained = n if adapter == "full" else t
    one, four = (step_traffic(backend, sharding, 2, 8, trained, n, 2, k, adapter=adapter) for k in (1, 4))
    grads = next(name for name in one if "gradient" in name)
    assert four[grads] == pytest.approx((4 if reductions == "k" else 1) * one[grads])
    if sharding == "hybrid_shard":  # the across-nodes all-reduce of each node's shard too
        cross = "all-reduce gradient shards across nodes"
        assert four[cross] == pytest.approx(4 * one[cross])


def test_zero_1_and_2_gather_only_the_parameters_they_update():
    """After the optimizer step each rank gathers the trained parameters the others updated: an adapter's, not the
    frozen base."""
    from finetune.plan.comm import step_traffic

    n, t = 8_030_261_248, 41_943_040
    lora = step_traffic("deepspeed", "zero1", 1, 8, t, n, 2, 4, adapter="lora", grad_bytes=2)
    full = step_traffic("deepspeed", "zero1", 1, 8, n, n, 2, 4, adapter="full", grad_bytes=2)
    assert lora["all-gather updated parameters"] == pytest.approx(7 / 8 * 2 * t)
    assert full["all-gather updated parameters"] == pytest.approx(7 / 8 * 2 * n)


def test_a_full_fine_tune_counts_a_reduce_scatter_per_micro_batch():
    """8 x H100, Llama 3.1 8B in full under FSDP2: the plan's traffic is one reduce-scatter of the fp32 gradients per
    micro-batch, and its one step time is the work plus the communication that does not hide behind it."""
    p = make(L8, "8xH100-80GB", ["distributed.backend=fsdp"], FULL)
    k, n = p.gradient_accumulation_steps, p.estimate.trainable_params
    assert k > 1
    assert p.communication["reduce-scatter gradients"] == pytest.approx(k * 7 / 8 * 4 * n)
    s = p.scaling
    assert sum(p.step_seconds.values()) == pytest.approx(s["step_seconds"], abs=1e-4)
    assert p.step_seconds.get("communication", 0) == pytest.approx(s["exposed_seconds"], abs=1e-5)


BANDWIDTHS = [(25e9, 3e9), (50e9, 6e9), (100e9, 12.5e9), (400e9, 50e9), (900e9, 200e9)]
PINNED = [
    (L70, "2x8xH100-80GB", ["distributed.backend=fsdp", "distributed.sharding=full_shard"], MINIMAL),
    (L8, "2x8xH100-80GB", ["distributed.backend=fsdp", "distributed.sharding=hybrid_shard"], FULL),
    (L8, "8xH100-80GB", ["distributed.tensor_parallel=4"], FULL),
    (L70, "8xH100-80GB", [*LONG, "distributed.context_parallel=8"], MINIMAL),
]


@pytest.mark.parametrize("model, hardware, overrides, text", PINNED)
def test_efficiency_is_monotone_in_link_bandwidth(model, hardware, overrides, text):
    first = make(model, hardware, overrides, text)
    pins = [
        f"distributed.tensor_parallel={first.tensor_parallel}",
        f"distributed.context_parallel={first.context_parallel}",
        f"train.micro_batch_size={first.micro_batch_size}",
    ]
    seen = [make(model, hardware, [*overrides, *pins], text, speeds=Links(*bw)).scaling for bw in BANDWIDTHS]
    efficiency = [s["efficiency"] for s in seen]
    exposed = [s["exposed_seconds"] for s in seen]
    assert efficiency == sorted(efficiency) and exposed == sorted(exposed, reverse=True)
    assert efficiency[0] < efficiency[-1]  # slow links cost something
    assert [s["link_gb_per_s"]["intra_node"] for s in seen] == [bw[0] / 1e9 for bw in BANDWIDTHS]


# (traffic, compute seconds) -> exposed seconds: at 100 GB/s, 1e9 bytes take 0.01 s
PREDICT = [
    ({"all-gather parameters": 1e9}, 10.0, 0.001),  # prefetched: all but the first of 10 layers' gathers hide
    ({TENSOR_PARALLEL: 1e9}, 10.0, 0.01),  # between the matmuls that need them: exposed
    ({"all-gather updated parameters": 1e9}, 10.0, 0.01),  # ZeRO-1/2 after the optimizer step: exposed
    ({"all-gather parameters": 1e12}, 1.0, 9.0),  # 10 s of gathers behind 1 s of compute
    ({"reduce-scatter gradients": 1e11}, 4.0, 0.1 + 0.9 - 0.9),  # 1 s, 0.9 of it behind 2 s of backward
]


@pytest.mark.parametrize("traffic, compute, exposed", PREDICT)
def test_predict_hides_what_overlaps(traffic, compute, exposed):
    common = dict(nodes=1, sharding="full_shard", per_node=8, tp=1, cp=1, layers=10, micro_batches=1)
    s = predict({"compute": compute}, traffic, backward_share=0.5, attention_share=0.1, **common)
    assert s["communication_seconds"] == pytest.approx(sum(traffic.values()) / 100e9)
    assert s["exposed_seconds"] == pytest.approx(exposed, rel=1e-3)
    assert s["efficiency"] == pytest.approx(compute / (compute + exposed), rel=1e-3)
    slower = predict(
        {"compute": compute}, traffic, speeds=Links(10e9, 1e9), backward_share=0.5, attention_share=0.1, **common
    )
    assert slower["exposed_seconds"] > s["exposed_seconds"] and slower["efficiency"] < s["efficiency"]


def test_plans_stay_pure_and_reproducible():
    args = (L70, "2x8xH100-80GB", ["distributed.sharding=full_shard", "distributed.backend=fsdp"])
    assert make(*args).to_json() == make(*args).to_json()
