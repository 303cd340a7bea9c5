"""The planner, table-driven on described hardware: every choice, the batch arithmetic, and the errors."""

from __future__ import annotations

import pytest

from finetune.catalog import lookup
from finetune.config import loads
from finetune.errors import PlanError
from finetune.hardware import parse
from finetune.plan import plan
from finetune.plan.memory import GiB
from tests.helpers import MINIMAL

AUTO = MINIMAL.replace(
    "adapter: {type: lora, r: 16, alpha: 32, target_modules: all-linear}", "adapter: {type: auto}"
).replace("  lr: 2.0e-4\n", "")


def make(overrides=(), text=AUTO, model="meta-llama/Llama-3.1-8B", hardware="1xH100-80GB"):
    cfg = loads(text, overrides=[f"model.name={model}", *overrides], environ={})
    return plan(cfg, parse(hardware), lookup(model))


# (model, hardware, overrides) -> expected plan fields
CASES = [
    # one GPU: the adapter follows the memory
    (
        "meta-llama/Llama-3.1-8B",
        "1xH100-80GB",
        [],
        dict(
            adapter="lora",
            quantization="none",
            backend="single",
            sharding=None,
            precision="bf16",
            gradient_checkpointing=False,
        ),
    ),
    (
        "meta-llama/Llama-3.1-8B",
        "1xA10G-24GB",
        [],
        dict(adapter="lora", quantization="none", backend="single"),
    ),
    ("meta-llama/Llama-3.1-8B", "1xT4-16GB", [], dict(adapter="qlora", precision="fp16")),
    ("meta-llama/Llama-3.1-8B", "cpu", ["data.seq_len=256"], dict(precision="fp32", backend="single")),
    (
        "meta-llama/Llama-3.3-70B-Instruct",
        "1xH100-80GB",
        [],
        dict(adapter="qlora", backend="single", gradient_checkpointing=True),
    ),
    # several GPUs: DDP when a replica fits, FSDP when it does not
    ("meta-llama/Llama-3.1-8B", "8xH100-80GB", [], dict(adapter="lora", backend="ddp", sharding=None, world_size=8)),
    (
        "meta-llama/Llama-3.3-70B-Instruct",
        "8xH100-80GB",
        [],
        dict(adapter="lora", backend="fsdp", sharding="full_shard", offload="none"),
    ),
    ("meta-llama/Llama-3.3-70B-Instruct", "2xA6000-48GB", [], dict(adapter="qlora", backend="fsdp", world_size=2)),
    (
        "meta-llama/Llama-3.3-70B-Instruct",
        "2x8xA100-40GB",
        [],
        dict(backend="fsdp", sharding="hybrid_shard", nodes=2, world_size=16),
    ),
    (
        "meta-llama/Llama-3.1-8B",
        "8xH100-80GB",
        ["adapter.type=full"],
        dict(adapter="full", backend="fsdp", sharding="shard_grad_op"),
    ),
    (
        "meta-llama/Llama-3.1-8B",
        "8xA100-40GB",
        ["adapter.type=full", "data.seq_len=4096", "train.global_batch_size=64"],
        dict(adapter="full", backend="fsdp", sharding="full_shard", offload="none"),
    ),
    (
        "meta-llama/Llama-3.1-8B",
        "2xA100-40GB",
        ["adapter.type=full"],
        dict(adapter="full", backend="fsdp", sharding="full_shard", offload="all"),
    ),
    # across nodes the communication estimate picks the sharding: hybrid_shard keeps all-gathers inside each node
    (
        "meta-llama/Llama-3.1-8B",
        "2x8xH100-80GB",
        ["adapter.type=full"],
        dict(backend="fsdp", sharding="hybrid_shard", nodes=2),
    ),
    # explicit choices are kept
    (
        "meta-llama/Llama-3.1-8B",
        "8xH100-80GB",
        ["distributed.backend=deepspeed"],
        dict(backend="deepspeed", sharding="zero1"),
    ),
    # full fine-tuning: ZeRO-2 and ZeRO-3 both reduce gradients every micro-batch, and ZeRO-2's all-gather of the
    # updated parameters after the optimizer step is exposed, where ZeRO-3's gathers hide behind the layers' compute
    (
        "meta-llama/Llama-3.1-8B",
        "8xH100-80GB",
        ["adapter.type=full", "distributed.backend=deepspeed"],
        dict(backend="deepspeed", sharding="zero3"),
    ),
    (
        "meta-llama/Llama-3.1-8B",
        "8xH100-80GB",
        ["distributed.backend=fsdp", "distributed.sharding=full_shard"],
        dict(backend="fsdp", sharding="full_shard"),
    ),
    (
        "meta-llama/Llama-3.1-8B",
        "8xH100-80GB",
        ["adapter.type=qlora"],
        dict(adapter="qlora", quantization="nf4", backend="ddp"),
    ),
    ("meta-llama/Llama-3.1-8B", "8xH100-80GB", ["distributed.backend=single"], dict(backend="single", world_size=1)),
    ("meta-llama/Llama-3.1-8B", "8xH100-80GB", ["distributed.processes_per_node=4"], dict(world_size=4)),
    (
        "meta-llama/Llama-3.1-8B",
        "1xH100-80GB",
        ["train.micro_batch_size=4", "train.gradient_checkpointing=true"],
        dict(micro_batch_size=4, gradient_checkpointing=True),
    ),
    ("meta-llama/Llama-3.1-8B", "1xH100-80GB", ["train.precision=fp32"], dict(precision="fp32")),
    ("meta-llama/Llama-3.1-8B", "1xH100-80GB", ["quantization.type=int8"], dict(adapter="lora", quantization="int8")),
]


@pytest.mark.parametrize(
    "model, hardware, overrides, expected",
    CASES,
    ids=[f"{c[0].split('/')[-1]}-{c[1]}-{'-'.join(c[2]) or 'auto'}" for c in CASES],
)
def test_plan_choices(model, hardware, overrides, expected):
    p = make(overrides, model=model, hardware=hardware)
    got = {k: getattr(p, k) for k in expected}
    assert got == expected, [f"{d.field}={d.value}: {d.reason}" for d in p.decisions]
    assert p.estimate.device_bytes <= p.device_capacity_bytes
    assert all(d.reason for d in p.decisions)


@pytest.mark.parametrize(
    "hardware, world",
    [
        ("1xH100-80GB", 1),
        ("2xH100-80GB", 2),
        ("4xH100-80GB", 4),
        ("8xH100-80GB", 8),
        ("2x8xH100-80GB", 16),
        ("4x8xH100-80GB", 32),
    ],
)
@pytest.mark.parametrize("global_batch", [32, 64, 96])
def test_global_batch_is_what_the_user_asked_at_every_world_size(hardware, world, global_batch):
    p = make([f"train.global_batch_size={global_batch}"], hardware=hardware)
    assert p.world_size == world
    assert p.micro_batch_size * p.gradient_accumulation_steps * p.world_size == global_batch == p.global_batch_size


def test_batch_in_tokens_is_rounded_to_whole_sequences_per_rank():
    p = make(
        ["train.global_batch_tokens=1000000", "data.seq_len=4096"],
        text=AUTO.replace("  global_batch_size: 32\n", ""),
        hardware="8xH100-80GB",
    )
    assert p.global_batch_size == 248 and p.global_batch_size % 8 == 0  # 1e6/4096 = 244.1 -> 31 per rank
    assert p.micro_batch_size * p.gradient_accumulation_steps * 8 == 248
    assert "rounded to a multiple of world size 8" in p.decision("global_batch_size").reason


def test_lr_auto_depends_on_adapter_and_method():
    assert make().lr == 2e-4
    assert make(["adapter.type=full"], hardware="8xH100-80GB").lr == 2e-5
    assert make(["train.lr=3e-4"]).lr == 3e-4


@pytest.mark.parametrize(
    "overrides, hardware, needle",
    [
        (["train.precision=bf16"], "1xT4-16GB", "bf16 is not supported by T4"),
        (["train.precision=fp16"], "cpu", "fp16 is not supported for training on CPU"),
        (
            ["distributed.sharding=hybrid_shard", "distributed.backend=fsdp"],
            "8xH100-80GB",
            "hybrid_shard shards inside a node",
        ),
        (["distributed.backend=fsdp", "distributed.offload=all"], "cpu:2", "has no GPU"),
        (["distributed.processes_per_node=16"], "8xH100-80GB", "more than the 8 GPUs per node"),
        (["distributed.nodes=4"], "8xH100-80GB", "more nodes than the hardware has"),
        (["train.global_batch_size=30"], "8xH100-80GB", "set it to 24 or 32"),
        (["train.micro_batch_size=3"], "8xH100-80GB", "does not divide the 4 sequences"),
    ],
)
def test_explicit_but_impossible_choices_explain_the_fix(overrides, hardware, needle):
    with pytest.raises(PlanError, match=needle):
        make(overrides, hardware=hardware)


def test_no_fit_gives_estimate_and_options_that_really_fit():
    overrides = ["adapter.type=full", "distributed.offload=none", "train.precision=bf16"]
    with pytest.raises(PlanError) as info:
        make(overrides, hardware="1xH100-80GB")
    msg = str(info.value)
    assert "does not fit: needs" in msg and "GiB per GPU" in msg and "usable of" in msg
    assert "changes that fit this hardware" in msg
    for option in ("`train.precision: bf16-pure`", "`adapter.type: lora`", "`adapter.type: qlora`", "offload: auto"):
        assert option in msg
    # the options are real: applying each one plans on the same hardware
    assert make(overrides + ["adapter.type=lora"], hardware="1xH100-80GB").adapter == "lora"
    assert make(overrides + ["train.precision=bf16-pure"], hardware="1xH100-80GB").pure_bf16
    assert make(overrides + ["distributed.offload=auto"], hardware="1xH100-80GB").offload == "all"


def test_no_fit_advice_never_quotes_an_error_from_other_hardware():
    """Advice re-plans on this hardware; a micro-batch that would not divide the batch on 4 GPUs is not the user's
    problem on 2."""
    overrides = [
        "adapter.type=qlora",
        "train.micro_batch_size=10",
        "train.global_batch_size=20",
        "data.seq_len=8192",
        "train.gradient_checkpointing=false",
    ]
    with pytest.raises(PlanError) as info:
        make(overrides, model="meta-llama/Llama-3.3-70B-Instruct", hardware="2xRTX3090-24GB")
    msg = str(info.value)
    assert "4 ranks" not in msg and "does not divide" not in msg
    assert "2 × RTX3090" not in msg.split("does not fit")[0]  # the message is about this model on this hardware


def test_bf16_pure_only_when_mixed_precision_does_not_fit():
    small = make(["adapter.type=full"], model="meta-llama/Llama-3.2-1B", hardware="1xH100-80GB")
    assert not small.pure_bf16 and small.decision("precision").value == "bf16"
    big = make(["adapter.type=full", "distributed.offload=none"], hardware="1xH100-80GB")
    assert big.pure_bf16 and big.compensation == "stochastic_rounding"
    reason = big.decision("precision").reason
    assert big.decision("precision").value == "bf16-pure" and "mixed precision does not fit" in reason


def test_no_fit_on_cpu_suggests_qlora():
    with pytest.raises(
        PlanError, match=r"per process .* changes that fit this hardware: `adapter.type: qlora` \(est\. [0-9.]+ GiB\)"
    ):
        make(["adapter.type=lora"], hardware="cpu,host=24GB")


def test_plan_is_pure_and_never_probes(monkeypatch):
    import finetune.hardware as hardware

    monkeypatch.setattr(hardware, "probe", lambda: pytest.fail("plan() probed the machine"))
    a, b = make(hardware="8xH100-80GB"), make(hardware="8xH100-80GB")
    assert a == b


def test_decisions_say_who_chose():
    p = make(["train.micro_batch_size=2"])
    assert p.decision("micro_batch_size").source == "config"
    assert p.decision("adapter").source == "auto" and "LoRA fits" in p.decision("adapter").reason


def test_plan_json_has_the_contract_keys():
    j = make(hardware="2x8xA100-40GB", model="meta-llama/Llama-3.3-70B-Instruct").to_json()
    for key in (
        "precision",
        "adapter",
        "quantization",
        "backend",
        "sharding",
        "offload",
        "micro_batch_size",
        "gradient_accumulation_steps",
        "gradient_checkpointing",
        "world_size",
        "memory",
        "decisions",
        "launch",
    ):
        assert key in j
    assert isinstance(j["offload"], bool) and j["sharding"] == "hybrid_shard"
    assert set(j["memory"]) >= {"per_device_gib", "host_gib"} and j["memory"]["per_device_gib"] > 1
    assert j["decisions"][0].keys() >= {"field", "value", "reason"}
    assert j["launch"][0] == "torchrun" and "--nnodes=2" in j["launch"] and "--nproc-per-node=8" in j["launch"]


def test_method_enters_the_estimate():
    dpo = (
        AUTO.replace("method: {name: sft}", "method: {name: dpo}")
        .replace("format: chat", "format: preference")
        .replace("  packing: true\n", "")
    )
    sft_full = make(
        ["adapter.type=full", "train.micro_batch_size=1", "train.gradient_checkpointing=true"], hardware="8xH100-80GB"
    )
    dpo_full = make(
        ["adapter.type=full", "train.micro_batch_size=1", "train.gradient_checkpointing=true"],
        text=dpo,
        hardware="8xH100-80GB",
    )
    assert "reference model" in dpo_full.estimate.device and "reference model" not in sft_full.estimate.device
    assert dpo_full.estimate.device["activations"] == pytest.approx(
        2 * sft_full.estimate.device["activations"], rel=0.01
    )
    dpo_lora = make(["train.micro_batch_size=1"], text=dpo)
    assert "reference model" not in dpo_lora.estimate.device  # the base with the adapter disabled


def test_estimate_shrinks_with_more_shards():
    small = make(
        [
            "adapter.type=full",
            "distributed.backend=fsdp",
            "distributed.sharding=full_shard",
            "train.micro_batch_size=1",
        ],
        hardware="8xH100-80GB",
    )
    big = make(
        [
            "adapter.type=full",
            "distributed.backend=fsdp",
            "distributed.sharding=full_shard",
            "train.micro_batch_size=1",
            "distributed.tensor_parallel=1",  # across 4 nodes auto would split each layer inside a node
        ],
        hardware="4x8xH100-80GB",
    )
    assert big.estimate.device["optimizer"] == pytest.approx(small.estimate.device["optimizer"] / 4)
    assert big.estimate.device_bytes < small.estimate.device_bytes
    assert small.estimate.device_bytes / GiB < 80


def test_added_tokens_grow_and_train_the_embeddings():
    plain = make()
    grown = make(["data.add_special_tokens=[<tool>, </tool>]"])
    assert grown.decision("embeddings").value == "+2 tokens"
    # embed_tokens and lm_head (untied)
    assert grown.estimate.trainable_params == plain.estimate.trainable_params + 2 * 128256 * 4096
    with pytest.raises(StopIteration):
        plain.decision("embeddings")


def test_communication_estimate_by_backend():
    from finetune.plan.comm import step_traffic

    n, t = 8_030_261_248, 41_943_040
    ddp = step_traffic("ddp", None, 1, 8, t, n, 2, 4, adapter="lora")
    assert ddp == {"all-reduce gradients": pytest.approx(2 * 7 / 8 * 4 * t)}
    full = step_traffic("fsdp", "full_shard", 1, 8, n, n, 2, 4, adapter="full")
    grad_op = step_traffic("fsdp", "shard_grad_op", 1, 8, n, n, 2, 4, adapter="full")
    assert (
        full["all-gather parameters"]
        == pytest.approx(2 * grad_op["all-gather parameters"])
        == pytest.approx(2 * 4 * 7 / 8 * 2 * n)
    )
    hybrid = step_traffic("fsdp", "hybrid_shard", 2, 8, n, n, 2, 4, adapter="full")
    assert "all-reduce gradient shards across nodes" in hybrid
    assert step_traffic("single", None, 1, 1, t, n, 2, 4, adapter="lora") == {}
    p = make(["adapter.type=full"], hardware="2x8xH100-80GB")
    j = p.to_json()["communication"]
    assert j["seconds_per_step_estimate"] > 0 and j["per_rank_gib_per_step"]


def test_across_nodes_the_chosen_sharding_has_the_least_estimated_communication():
    chosen = make(["adapter.type=full"], model="meta-llama/Llama-3.1-8B", hardware="2x8xH100-80GB")
    for sharding in ("shard_grad_op", "full_shard"):
        other = make(
            ["adapter.type=full", "distributed.backend=fsdp", f"distributed.sharding={sharding}"],
            model="meta-llama/Llama-3.1-8B",
            hardware="2x8xH100-80GB",
        )
        assert chosen.communication_seconds < other.communication_seconds, sharding


def test_a_quantized_base_beats_streaming_the_base_from_host_ram():
    """8B with an adapter on a 16 GB T4: QLoRA on the device, not a 16-bit base streamed over PCIe every micro-batch;
    the reasons agree with each other."""
    p = make(hardware="1xT4-16GB")
    assert (p.adapter, p.quantization, p.offload) == ("qlora", "nf4", "none")
    assert "does not fit" in p.decision("adapter").reason and "a full replica does not fit" not in str(p.decisions)
    slower = [a for a in p.alternatives if "offload all" in a["setup"]]
    assert slower and all(a["seconds"] > sum(p.step_seconds.values()) for a in slower)


def test_candidates_are_ordered_by_estimated_step_time():
    p = make(hardware="2x8xA100-40GB", overrides=["adapter.type=full", "distributed.backend=deepspeed"])
    chosen = sum(p.step_seconds.values())
    times = [a["seconds"] for a in p.alternatives]
    assert p.alternatives and times == sorted(times) and chosen <= times[0]
    assert p.step_seconds["compute"] > 0 and "communication" in p.step_seconds


def test_savers_are_explained_and_pinned_values_are_kept():
    p = make(
        ["train.loss_implementation=chunked", "train.checkpoint_layers=8", "train.activation_offload=false"],
        hardware="1xH100-80GB",
    )
    assert (p.loss_implementation, p.checkpoint_layers, p.gradient_checkpointing) == ("chunked", 8, True)
    assert p.loss_chunk_tokens > 0 and not p.activation_offload
    assert p.decision("loss_implementation").source == "config"
    auto = make(
        ["data.seq_len=16384", "train.micro_batch_size=4", "train.global_batch_size=32"], hardware="1xH100-80GB"
    )
    for field in ("loss_implementation", "gradient_checkpointing", "activation_offload"):
        d = auto.decision(field)
        assert d.source == "auto" and d.reason
    assert auto.loss_implementation == "chunked" and "without it" in auto.decision("loss_implementation").reason


def test_the_plain_loss_logits_are_sized_by_the_prepared_rows_trained_share_where_each_micro_batch_is_one_row():
    """Where each SFT micro-batch is one row of packed samples, the plain loss asks the model for the trained
    positions' logits only (methods/head.py), so they are sized by the largest share of a prepared row's positions
    trained; before the data is read every position is counted, and the plan says so. A sharded head runs them as well
    (the model's own head call). Unpacked rows, packed rows apart by masks and other methods keep every position."""

    def both(overrides, model="meta-llama/Llama-3.1-8B", hardware="1xH100-80GB", text=MINIMAL):
        config = loads(
            text, overrides=[f"model.name={model}", "train.loss_implementation=plain", *overrides], environ={}
        )
        return [plan(config, parse(hardware), lookup(model), trained_share=s) for s in (None, 0.25)]

    def logits(p):
        return p.estimate.device["logits and loss"]

    fixed = ["train.micro_batch_size=2", "train.gradient_checkpointing=true", "train.compile=false"]
    before, after = both(fixed)
    assert logits(after) == pytest.approx(0.25 * logits(before), rel=1e-6)
    assert "sized for every position of a row (ft train sizes" in before.decision("loss_implementation").reason
    assert "sized for 25.0% of a row's positions" in after.decision("loss_implementation").reason
    ddp = both([*fixed, "train.global_batch_size=16"], hardware="8xH100-80GB")  # each rank its own rows
    assert ddp[0].backend == "ddp" and logits(ddp[1]) == pytest.approx(0.25 * logits(ddp[0]), rel=1e-6)
    sharded = both(
        [*fixed, "distributed.backend=fsdp"], model="meta-llama/Llama-3.3-70B-Instruct", hardware="8xH100-80GB"
    )
    assert sharded[0].backend == "fsdp" and logits(sharded[1]) == pytest.approx(0.25 * logits(sharded[0]), rel=1e-6)

    unpacked = both([*fixed, "data.packing=false"])  # padded or padding-free rows: the head on every position
    assert logits(unpacked[0]) == logits(unpacked[1])
    assert "trained positions" not in unpacked[1].decision("loss_implementation").reason
    padded = both([*fixed, "model.attn_implementation=sdpa"])  # packed rows of seq_len apart by 4-D masks
    assert padded[1].attn_implementation == "sdpa" and logits(padded[0]) == logits(padded[1])  # several rows a batch
    assert "trained positions" not in padded[1].decision("loss_implementation").reason
    preference = (
        MINIMAL.replace("format: chat", "format: preference")
        .replace("{name: sft}", "{name: dpo}")
        .replace("packing: true", "packing: false")
    )
    dpo = both(fixed, text=preference)
    assert logits(dpo[0]) == logits(dpo[1]) and "trained positions" not in dpo[1].decision("loss_implementation").reason


def test_optimizer_in_backward_needs_one_process_and_no_clipping():
    with pytest.raises(PlanError, match="optimizer_in_backward: true needs one process"):
        make(["train.optimizer_in_backward=true", "train.max_grad_norm=0"], hardware="8xH100-80GB")
    p = make(
        [
            "train.optimizer_in_backward=true",
            "train.max_grad_norm=0",
            "train.micro_batch_size=auto",
            "train.global_batch_size=2",
        ],
        hardware="1xH100-80GB",
    )
    assert p.optimizer_in_backward and p.gradient_accumulation_steps == 1


def test_config_checks_for_memory_savers():
    from finetune.errors import ConfigError

    overrides = [
        "train.compensation=kahan",
        "train.optimizer_in_backward=true",
        "train.gradient_checkpointing=false",
        "train.checkpoint_layers=4",
    ]
    with pytest.raises(ConfigError) as info:
        loads(AUTO, overrides=overrides, environ={})
    msg = str(info.value)
    for key in ("train.compensation", "train.max_grad_norm", "train.checkpoint_layers"):
        assert key in msg


def test_a_4bit_base_that_does_not_fit_whole_on_each_gpu_is_loaded_through_host_memory():
    """70B QLoRA on two 24 GB cards (the FSDP-QLoRA showcase): the quantized model (~36 GiB) cannot be loaded whole on
    each GPU, so each rank quantizes it in host RAM and FSDP2 moves it to the GPU layer by layer."""
    from finetune.plan.memory import LOADING

    p = make(["adapter.type=qlora"], model="meta-llama/Llama-3.3-70B-Instruct", hardware="2xRTX3090-24GB")
    assert (p.backend, p.loading) == ("fsdp", "host")
    assert p.estimate.device[LOADING] < p.device_capacity_bytes < 30 * 2**30
    assert p.estimate.host[LOADING] > 2 * 30 * 2**30  # two processes, each with the whole 4-bit model
    assert "host RAM" in p.decision("loading").reason
    # where the whole 4-bit model fits on each GPU, it is loaded there as before
    assert make(["adapter.type=qlora", "distributed.backend=fsdp"], hardware="2xH100-80GB").loading == "replica"


def test_host_loading_gives_the_gpu_nothing_until_fsdp_moves_it():
    """models.device_map, what load_model passes from_pretrained: `host` loading quantizes in host RAM even where a GPU
    is present (given no device_map, bitsandbytes would pick the current GPU); `replica` loads onto this rank's GPU,
    `partitioned` (ZeRO-3) passes none."""
    import dataclasses

    import torch

    from finetune.models import device_map

    p = make(["adapter.type=qlora"], model="meta-llama/Llama-3.3-70B-Instruct", hardware="2xRTX3090-24GB")
    gpu = torch.device("cuda", 1)
    assert p.loading == "host" and device_map(p, gpu) == {"": "cpu"} and device_map(p, None) == {"": "cpu"}
    assert device_map(dataclasses.replace(p, loading="replica"), gpu) == {"": 1}
    assert device_map(dataclasses.replace(p, loading="replica"), None) is None
    assert device_map(dataclasses.replace(p, loading="partitioned"), gpu) is None


# ---------------------------------------------------------------- headroom
def _fit(share: float, seconds: float):
    """A fit filling `share` of the usable memory of one H100, with a step of `seconds`."""
    from finetune.plan.candidates import Candidate
    from finetune.plan.memory import Estimate
    from finetune.plan.search import Fit, Savers, device_capacity

    used = int(share * device_capacity(parse("1xH100-80GB")))
    return Fit(
        Candidate("lora", "none", "single", None, "none"),
        1,
        Savers(),
        Estimate({"weights": used}, {}, 1, 1),
        {"compute": seconds},
    )


@pytest.mark.parametrize(
    "ranked, chosen",
    [
        ([(1.0, 10.0), (0.8, 10.5)], 1),  # filling the memory buys 5%: the room is worth more
        ([(1.0, 10.0), (0.8, 12.0)], 0),  # it buys 20%: it pays
        ([(0.95, 10.0), (0.99, 10.2)], 0),  # nothing leaves room: the fastest
        ([(0.5, 10.0), (0.4, 10.2)], 0),  # the fastest leaves room already
    ],
)
def test_a_setup_that_fills_the_memory_is_chosen_only_where_it_pays(ranked, chosen):
    from finetune.plan.search import prefer_room

    fits = [_fit(*r) for r in ranked]
    got = prefer_room(fits, parse("1xH100-80GB"))
    assert got.estimate == fits[chosen].estimate
    assert (got.fuller is fits[0]) == (chosen != 0)


def test_a_full_fine_tune_leaves_room_where_filling_the_memory_barely_pays():
    """8B in full on 8 x H100 under FSDP full_shard: micro-batches of 4 with no saver fill nearly all the usable
    memory for a step under 2% faster than one that leaves room; the plan leaves room and says what it gave up."""
    import re

    from finetune.plan.search import FILLING_PAYS, ROOMY

    pins = ["adapter.type=full", "distributed.backend=fsdp", "distributed.sharding=full_shard"]
    p = make(pins, hardware="8xH100-80GB")
    assert p.estimate.device_bytes <= ROOMY * p.device_capacity_bytes
    why = p.decision("memory_headroom").reason
    assert re.search(r"would fill (9\d|100)%", why) and f"only when over {FILLING_PAYS:.0%} faster" in why
    assert "with room to spare" in p.decision("micro_batch_size").reason
