"""plan(config, hardware, model) -> Plan: a pure function; every `auto` becomes a Decision with a reason.

Order of choices: where a sampling method's rollouts run (plan/rollout.py: the engine, a GPU pool taken from the
trainer, the memory a colocated engine takes on each GPU) -> topology (nodes, processes) -> precision -> global batch
(plan/topology.py) -> the setup to run
(plan/search.py): every candidate the config allows (adapter and quantization, backend, sharding, host offload:
plan/candidates.py) with every combination of memory savers it allows (plan/savers.py), each at the largest
micro-batch that fits (plan/memory.py); the least estimated step time wins (plan/cost.py), within the least
compromising adapter and quantization unless another is much faster. Pure bf16 only when mixed precision does not
fit. Explicit choices are kept and checked. When nothing fits, PlanError gives the estimate and the concrete changes
that would fit this hardware (see `finetune.plan.advice`).
"""

from __future__ import annotations

from dataclasses import replace

from finetune.catalog import ModelFacts
from finetune.config.moe_checks import lora_dropout, moe_notes, moe_problems
from finetune.config.schema import Config
from finetune.config.vision_checks import geometry, train_vision, trains_images, vision_problems
from finetune.config.vision_checks import images_per_sample as images_per_sample_of
from finetune.errors import ConfigError
from finetune.hardware import Hardware
from finetune.model_class import for_facts
from finetune.plan import expert_parallel
from finetune.plan.advice import no_fit_error
from finetune.plan.attention import choose_attention, varlen_fast
from finetune.plan.candidates import Candidate, data_parallel, loading, sharded_params
from finetune.plan.comm import Links, collective_seconds, links
from finetune.plan.compiling import choose_compile
from finetune.plan.explain import alternatives, record_headroom, record_parallel, record_savers, record_vision
from finetune.plan.launch import launch_command, needs_launcher
from finetune.plan.memory import LOADING, GiB
from finetune.plan.parallel import asked
from finetune.plan.parallel import check as check_parallel
from finetune.plan.plan import Decision, Plan, choice
from finetune.plan.pricing import traffic
from finetune.plan.rollout import choose_rollout
from finetune.plan.savers import chunk_tokens
from finetune.plan.search import Fit, compensation, device_capacity, host_capacity, search, setup
from finetune.plan.stopping import checkpoint_bytes_per_node, stop_seconds
from finetune.plan.topology import Topology, choose_global_batch, choose_precision, choose_topology


def plan(
    config: Config,
    hardware: Hardware,
    model: ModelFacts,
    config_path: str = "config.yaml",
    new_tokens: int = 0,
    speeds: Links | None = None,
    images_per_sample: int | None = None,
    trained_share: float | None = None,
) -> Plan:
    """Compile `config` for `hardware`; raise PlanError when it cannot run there.

    new_tokens: tokens the data pipeline adds beyond data.add_special_tokens (a built-in template's
    markers missing from the vocabulary); the embeddings grow and are trained.
    speeds: link speeds inside and between nodes (default: what the hardware knows, else plan/comm.py's).
    images_per_sample: the most images any prepared row holds (ft train, once the data is prepared), where
    data.image.per_sample does not say.
    trained_share: the largest share of a prepared row's positions that are trained (ft train, once the data is
    prepared): the plain loss's logits are sized by it where it runs the head on those only; unknown, every position.
    """
    speeds = speeds or links(hardware)
    config, images_why = with_images(config, images_per_sample)
    # what peft, the loss and the data pipeline cannot do on this model, with the key and fix
    problems = moe_problems(config, model) + vision_problems(config, model)
    if problems:
        raise ConfigError(config_path, problems)
    if new_tokens or config.data.add_special_tokens:
        config = _train_embeddings(config)
    decisions: list[Decision] = []
    placed = choose_rollout(config, hardware, model)
    if placed is None:
        topo = choose_topology(config, hardware, decisions)
    else:
        topo = choose_topology(config, hardware, decisions, placed.rollout.server_gpus, placed.share)
        decisions.extend(placed.decisions)
    precision = choose_precision(config, hardware, decisions)
    d = config.distributed
    check_parallel(config, hardware, topo, model)  # explicit degrees' refusals before the batch arithmetic uses them
    fixed = (asked(d.tensor_parallel) or 1) * (asked(d.context_parallel) or 1)  # auto degrees divide world / fixed
    batch = choose_global_batch(config, topo, decisions, topo.world // fixed if fixed > 1 else None)
    # the attention, before the search, whose estimates count it (search.setup: estimated_kernel); recorded below
    attention_decisions: list[Decision] = []
    attn = choose_attention(
        config,
        hardware,
        for_facts(model),
        asked(d.context_parallel) or 1,
        attention_decisions,
        trains_images(config, model),
        varlen_fast(hardware, precision),
    )
    if one_row_batches(config, attn):  # the loss's logits: of the trained positions (every one until data is read)
        config = config.model_copy(update={"data": config.data.with_trained_share(trained_share or 1.0)})
    outcome = search(expert_parallel.confined(config, topo, model), hardware, model, topo, precision, batch, speeds)
    fit = outcome.chosen
    if fit is None:
        raise no_fit_error(config, hardware, model, topo, precision, batch)
    _record_fit(config, fit, topo, batch, precision, decisions, outcome.why, outcome.others)
    record_parallel(config, hardware, fit, outcome.others, model, topo, decisions)
    record_savers(config, fit, model, hardware, topo, precision, batch, decisions, speeds)
    record_headroom(fit, hardware, model, decisions)
    c = fit.candidate
    s = setup(config, hardware, topo, precision, batch, c, fit.micro_batch_size, fit.savers, model)
    fit, ep = expert_parallel.apply(config, hardware, topo, model, fit, s, speeds, decisions)
    compiled = choose_compile(config, hardware, c.backend, c.quantization, fit.step_seconds, decisions, c.cp, ep)
    if compiled and attn.padding_free:  # compiled layers: padded rows, whose shapes do not change inside a batch
        attention_decisions = []
        attn = choose_attention(config, hardware, for_facts(model), c.cp, attention_decisions, padding_free=False)
    if new_tokens or config.data.add_special_tokens:
        n = new_tokens + len(config.data.add_special_tokens)
        decisions.append(
            Decision(
                "embeddings",
                f"+{n} tokens",
                "new tokens need trained embedding rows: the input embeddings and output head are resized and "
                "trained in full next to the adapter",
            )
        )
    decisions.extend(Decision(*note) for note in moe_notes(config, model, c.adapter, c.quantization))
    vision, (trained_vision, why) = trains_images(config, model), train_vision(config, c.adapter)
    if vision:
        decisions.append(Decision("model.train_vision", trained_vision, why))
        record_vision(config, model, fit.estimate, images_why, trained_vision, decisions)
    shapes = geometry(config, model)
    lr = choose_lr(config, fit.candidate.adapter, decisions)
    decisions.extend(attention_decisions)
    dropout = lora_dropout(config.adapter, model, c.adapter)
    sparse = sparse_dropout(hardware, dropout, compiled, decisions)
    s = replace(s, expert_parallel=ep)
    accumulation = s.accumulation
    step = traffic(fit, topo, model, s)
    written = checkpoint_bytes_per_node(
        fit.estimate, c.adapter, c.sharding is not None, sharded_params(c), topo.processes_per_node
    )
    process_group = needs_launcher(c.backend, topo.world)  # decided once: the ranks read plan.process_group
    made = Plan(
        model=model.name,
        hardware=hardware.describe(),
        device="CPU process" if hardware.is_cpu else "GPU",
        method=config.method.name,
        precision=precision,
        adapter=c.adapter,
        quantization=c.quantization,
        backend=c.backend,
        sharding=c.sharding,
        offload=c.offload,
        micro_batch_size=fit.micro_batch_size,
        gradient_accumulation_steps=accumulation,
        gradient_checkpointing=fit.checkpointing,
        world_size=topo.world,
        nodes=topo.nodes,
        processes_per_node=topo.processes_per_node,
        global_batch_size=batch,
        seq_len=config.data.seq_len,
        lr=lr,
        attn_implementation=attn.kernel,
        attention_masks=attn.masks,
        sample_index=attn.sample_index,
        flash_upgrade=attn.flash_upgrade,
        padding_free=attn.padding_free,
        moe=model.is_moe,
        vision=vision,
        train_vision=trained_vision if vision else "none",
        image_tokens=shapes.tokens if shapes else 0,
        image_patches=shapes.patches if shapes else 0,
        images_per_sample=images_per_sample_of(config) if shapes else 0,
        lora_dropout=dropout,
        sparse_dropout=sparse,
        estimate=fit.estimate,
        device_capacity_bytes=device_capacity(hardware),
        host_capacity_bytes=host_capacity(hardware),
        decisions=tuple(decisions),
        launch=(),  # below: built from the finished plan
        communication=step,
        communication_seconds=sum(
            collective_seconds(step, topo.nodes, c.sharding, topo.processes_per_node, c.tp * c.cp, speeds).values()
        ),
        quant_storage=precision if c.quantization == "nf4" and sharded_params(c) else None,
        train_embeddings=bool(new_tokens or config.data.add_special_tokens),
        reference=config.method.reference_kind(c.adapter),
        head=config.method.head,
        process_group=process_group,
        loading=loading(c),
        generation=generation(fit, model, hardware, precision),
        pure_bf16=fit.savers.pure_bf16,
        compensation=compensation(config) if fit.savers.pure_bf16 else "none",
        loss_implementation=fit.savers.loss,
        loss_chunk_tokens=chunk_tokens(model) if fit.savers.loss == "chunked" else 0,
        checkpoint_layers=fit.savers.checkpoint_layers,
        activation_offload=fit.savers.activation_offload,
        optimizer_in_backward=fit.savers.optimizer_in_backward,
        compile=compiled,
        tensor_parallel=c.tp,
        context_parallel=c.cp,
        expert_parallel=ep,
        scaling=fit.scaling,
        step_seconds={k: round(v, 6) for k, v in fit.seconds.items()},
        alternatives=alternatives(fit, outcome.others, model),
        rollout=placed.to_plan(hardware, topo, fit) if placed else None,
        cpus_per_node=hardware.cpu_cores,
        checkpoint_bytes=written,
        stop_seconds=stop_seconds(fit.step_seconds, written),
        max_steps=config.train.max_steps or 0,
        device_memory_bytes=hardware.device_memory_bytes,
    )
    shown = launch_command(made, config.output.dir, master_addr=hardware.launch.master_addr)  # the portable form
    return replace(made, launch=tuple(shown))


def generation(fit: Fit, m: ModelFacts, hw: Hardware, precision: str) -> str:
    """How a model with sharded parameters samples (GRPO rollouts, evaluation): gather it whole for the call where the
    whole model fits next to the training state, else gather layer by layer with the ranks kept in step
    (synced_gpus)."""
    c = fit.candidate
    if not sharded_params(c):
        return "local"
    whole = m.num_params * (0.6 if c.quantization == "nf4" else {"fp32": 4}.get(precision, 2))
    return "gather" if fit.estimate.device_bytes + whole <= device_capacity(hw) else "layerwise"


# ---------------------------------------------------------------- recording the choices
def _record_fit(
    config: Config,
    fit: Fit,
    topo: Topology,
    batch: int,
    precision: str,
    out: list[Decision],
    why: str = "",
    others: tuple[Fit, ...] = (),
) -> None:
    c, a, q, d, t = fit.candidate, config.adapter, config.quantization, config.distributed, config.train
    gib = f"{fit.estimate.device_bytes / GiB:.1f} GiB per device"
    trains = f"trains {fit.estimate.trainable_params:,} of {fit.estimate.total_params:,} parameters"
    adapters = {
        "lora": f"LoRA fits ({gib}): {trains}, base kept in full precision",
        "qlora": f"LoRA on a 16-bit base does not fit; QLoRA's 4-bit base does ({gib})",
    }
    out.append(choice("adapter", c.adapter, a.type, why or adapters.get(c.adapter, "")))
    quantizations = {
        "nf4": "QLoRA: 4-bit NormalFloat base" + (" with double quantization" if q.double_quant else ""),
        "none": "the base fits unquantized" + (" (streamed from host RAM)" if c.offload == "all" else ""),
    }
    out.append(choice("quantization", c.quantization, q.type, quantizations.get(c.quantization, "")))
    out.append(choice("backend", c.backend, d.backend, _backend_reason(c, topo)))
    out.append(choice("sharding", c.sharding, d.sharding, _sharding_reason(c, topo)))
    out.append(choice("offload", c.offload, d.offload, _offload_reason(c, others)))
    dp = data_parallel(topo.world, c)
    per_rank = batch // dp
    ranks = f"{dp} ranks" if dp == topo.world else f"{dp} data-parallel ranks ({topo.world} / (tp {c.tp} × cp {c.cp}))"
    rank = "rank" if dp == topo.world else "data-parallel rank"
    room = " with room to spare (see memory_headroom)" if fit.fuller else ""
    reason = f"largest divisor of the {per_rank} sequences per {rank} that fits{room} ({gib})"
    out.append(choice("micro_batch_size", fit.micro_batch_size, t.micro_batch_size, reason))
    out.append(
        Decision(
            "gradient_accumulation_steps",
            per_rank // fit.micro_batch_size,
            f"{batch} global = {fit.micro_batch_size} micro × {per_rank // fit.micro_batch_size} accumulation × "
            f"{ranks}",
        )
    )
    if c.host_load:
        whole = fit.estimate.host.get(LOADING, 0) / max(1, topo.processes_per_node) / GiB
        out.append(
            Decision(
                "loading",
                "host",
                f"the 4-bit model does not fit whole on each GPU while it loads; each rank quantizes it in host RAM "
                f"(about {whole:.1f} GiB per process) and FSDP2 moves it to the GPU one layer at a time as it "
                "shards it",
            )
        )
    if c.quantization == "nf4" and (c.backend == "fsdp" or c.sharding == "zero3"):
        out.append(
            Decision(
                "quant_storage",
                precision,
                f"{'FSDP' if c.backend == 'fsdp' else 'ZeRO-3'} shards flat tensors of one dtype: the 4-bit "
                "weights are stored in the compute dtype's container",
            )
        )


def _offload_reason(c: Candidate, others: tuple[Fit, ...]) -> str:
    if c.offload == "none":
        return "everything fits in device memory"
    if any(o.candidate.offload == "none" for o in others):
        return (
            f"{c.offload} moved to host RAM (PCIe traffic each step): the fastest setup that fits, though some keep "
            "everything on the device (ft plan --explain-candidates lists them)"
        )
    return f"only fits with {c.offload} moved to host RAM (slower: PCIe traffic each step)"


def _backend_reason(c: Candidate, topo: Topology) -> str:
    if c.backend == "single":
        return "one device: no distributed backend needed"
    if c.backend == "ddp":
        return f"a full replica fits on each of the {topo.world} devices: DDP only all-reduces gradients"
    if c.backend == "fsdp" and c.tp * c.cp > 1:
        return "tensor and context parallelism compose with FSDP2 only: it shards the rest over the data-parallel ranks"
    if c.backend == "fsdp":
        return "a full replica does not fit per device; FSDP2 shards it" + (
            " and offloads to host RAM" if c.offload != "none" else ""
        )
    return "DeepSpeed ZeRO shards training state across ranks"


def _sharding_reason(c: Candidate, topo: Topology) -> str:
    return {
        None: "no sharding: each rank holds the whole model",
        "shard_grad_op": "gradients and optimizer states sharded, parameters kept between forward and backward: less "
        "communication than full_shard",
        "hybrid_shard": f"sharded inside each node ({topo.processes_per_node} GPUs), "
        f"replicated across the {topo.nodes} nodes: "
        "all-gathers stay on the fast intra-node links",
        "full_shard": _one_rank(c)
        if topo.world == 1
        else f"parameters, gradients and optimizer states sharded over all {topo.world} ranks"
        if c.tp == 1
        else f"parameters, gradients and optimizer states sharded over the {topo.world // c.tp} ranks that hold "
        "the same tensor-parallel slice",
        "zero1": "optimizer states sharded",
        "zero2": "gradients and optimizer states sharded",
        "zero3": "parameters, gradients and optimizer states sharded",
    }[c.sharding]


def _one_rank(c: Candidate) -> str:
    if c.offload == "all":
        return (
            "one GPU: FSDP2 keeps parameters, gradients and optimizer states in host RAM and brings each layer to the "
            "GPU when it runs"
        )
    return "one rank: FSDP2 has nothing to shard over (each unit is whole on it)"


def choose_lr(config: Config, adapter: str, out: list[Decision]) -> float:
    if config.train.lr != "auto":
        out.append(Decision("lr", config.train.lr, "as set in the config", "config"))
        return config.train.lr
    lr, why = config.method.default_lr(full=adapter == "full")
    out.append(Decision("lr", lr, why))
    return lr


def sparse_dropout(hw: Hardware, dropout: float, compiled: bool, out: list[Decision]) -> bool:
    """Whether LoRA dropout draws only the dropped positions (finetune/dropout.py): on a CPU, where torch's dropout
    draws a random number for every element; not in compiled layers (its drop count varies with each draw)."""
    if not hw.is_cpu or dropout <= 0 or compiled:
        return False
    out.append(
        Decision(
            "adapter.dropout",
            f"{dropout:g}, sparse draws",
            "on a CPU, torch's dropout draws a random number for every element of each adapter's input, which costs "
            "more than the adapter's own products; ft draws only the dropped positions (geometric gaps between them: "
            "the same distribution, each element dropped with the same probability)",
        )
    )
    return True


def _train_embeddings(config: Config) -> Config:
    """The config as planned when tokens are added: embeddings and head trained next to an adapter."""
    a = config.adapter
    modules = list(dict.fromkeys([*a.modules_to_save, "embed_tokens", "lm_head"]))
    return config.model_copy(update={"adapter": a.model_copy(update={"modules_to_save": modules})})


def with_images(config: Config, prepared: int | None) -> tuple[Config, str]:
    """The config as planned for its images per sample (data.image.per_sample: as set, else the prepared rows' most),
    and where that number comes from."""
    image = config.data.image
    if image.per_sample is not None:
        return config, "as set in data.image.per_sample"
    if prepared:
        data = config.data.model_copy(update={"image": image.model_copy(update={"per_sample": prepared})})
        return config.model_copy(update={"data": data}), "the most images any prepared row holds"
    return config, (
        "assumed: the data is not prepared yet (ft train plans for the most images any prepared row holds; "
        "data.image.per_sample sets it)"
    )


# the kernels whose packed rows the collator concatenates into one (data/collate.py VARLEN_IMPLS, which imports torch)
VARLEN_KERNELS = ("flash_attention_2", "sdpa_varlen")


def one_row_batches(config: Config, attn) -> bool:
    """Whether every micro-batch is one row whose trained positions the plain loss asks the model for (methods/head.py,
    methods/sft.py): packed rows, concatenated for a varlen kernel. Unpacked rows, padded or padding-free, keep the head
    over every position."""
    return config.data.packing and attn.kernel in VARLEN_KERNELS
