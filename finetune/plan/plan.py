"""The Plan: every value ft derived from a Config and a Hardware, each with the reason it was chosen."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from finetune.plan.memory import Estimate, GiB

# Fields plan.json keeps in a block of their own, (block, key); every other field is at the top level under its name,
# except STRUCTURED ones, written and read by hand. Top-level names of other kinds (offload as a bool, communication
# in GiB, memory, params) are rounded figures for people.
PLACED = {
    "offload": ("exact", "offload"),
    "device_capacity_bytes": ("exact", "device_capacity_bytes"),
    "device_memory_bytes": ("exact", "device_memory_bytes"),
    "host_capacity_bytes": ("exact", "host_capacity_bytes"),
    "communication": ("exact", "communication"),
    "communication_seconds": ("exact", "communication_seconds"),
    "checkpoint_bytes": ("exact", "checkpoint_bytes"),
    "step_seconds": (None, "step_seconds_estimate"),
    "cpus_per_node": ("cluster", "cpus_per_node"),
    "stop_seconds": ("cluster", "stop_seconds"),
}
STRUCTURED = ("estimate", "decisions")


def _plain(value):
    """A field's value as JSON types."""
    return list(value) if isinstance(value, tuple) else dict(value) if isinstance(value, dict) else value


@dataclass(frozen=True)
class Decision:
    """One choice: its value, why, and whether the user made it (`config`) or ft did (`auto`)."""

    field: str
    value: Any
    reason: str
    source: str = "auto"


def choice(field: str, value, asked, reason: str) -> Decision:
    """`value` with `reason` where ft chose it (`asked` is auto), else as the config set it."""
    if asked != "auto":
        return Decision(field, value, "as set in the config", "config")
    return Decision(field, value, reason)


@dataclass(frozen=True)
class RolloutPlan:
    """Where a sampling method's rollouts run and the step split (plan/rollout.py); what finetune/rollout/ reads."""

    engine: str  # transformers | vllm
    placement: str  # inline (the training model samples) | colocated | server
    server_gpus: int = 0  # GPUs of the pool ft starts, taken from the job's (0: none)
    train_gpus: int = 0  # GPUs that train (0 on CPUs)
    tensor_parallel: int = 1  # GPUs each vLLM engine splits the model over
    memory_share: float = 0.0  # share of each GPU's memory given to vLLM
    kv_cache_bytes: int = 0  # each engine's (or, inline, each rank's) KV cache
    sleep: bool = False  # a colocated engine sleeps during the backward pass
    sync_every: int = 1  # optimizer steps between weight updates of the engine
    asynchronous: bool = False  # the next rollout is generated while the current one trains
    max_staleness: int = 1  # asynchronous: rollouts generated ahead of the one training
    url: str | list[str] | None = None  # the vLLM servers already running (method.rollout.url)
    engines: int = 0  # placement ray: vLLM engines of the pool (data-parallel copies of tensor_parallel GPUs each)
    engine_nodes: int = 0  # placement ray: nodes of their own for the engines, after the trainer's (0: node 0's)
    generation_seconds: float = 0.0  # estimated seconds per optimizer step
    training_seconds: float = 0.0
    sync_seconds: float = 0.0


@dataclass(frozen=True)
class Plan:
    """What a job will run: derived values only; the Config stays as the user wrote it."""

    model: str
    hardware: str
    device: str  # "GPU" or "CPU process": what one rank runs on
    method: str
    precision: str
    adapter: str
    quantization: str
    backend: str
    sharding: str | None
    offload: str  # none | optimizer | all
    micro_batch_size: int
    gradient_accumulation_steps: int
    gradient_checkpointing: bool
    world_size: int
    nodes: int
    processes_per_node: int
    global_batch_size: int  # sequences per optimizer step
    seq_len: int
    lr: float
    attn_implementation: str
    estimate: Estimate
    device_capacity_bytes: int  # usable memory per device (after headroom)
    host_capacity_bytes: int  # usable host RAM per node
    decisions: tuple[Decision, ...]
    launch: tuple[str, ...]
    communication: dict  # bytes each rank sends per optimizer step, by collective (see plan/comm.py)
    communication_seconds: float
    # Values derived once here so that nothing downstream re-derives them from the config or from decision text:
    quant_storage: str | None = (
        None  # 4-bit weights packed in this dtype's container (bf16/fp16/fp32) for sharding; None: uint8
    )
    train_embeddings: bool = False  # tokens were added: embeddings and output head are resized and trained in full
    # DPO/GRPO reference model: none | adapter (base with the adapter off) | copy (frozen copy) | precomputed
    reference: str = "none"
    head: str = "lm"  # what the model ends in: lm (next-token logits) | score (one value per sequence: reward models)
    process_group: bool = False  # the ranks join a process group (several ranks, or FSDP2/DeepSpeed even for one)
    # replica: each rank loads the whole model | meta: FSDP2 builds on meta, shards, then fills from safetensors
    # | host: a 4-bit base quantized in host memory, moved to the GPU layer by layer as FSDP2 shards it
    loading: str = "replica"
    # | partitioned: ZeRO-3 constructs the model partitioned
    # local: unsharded model | gather: whole model gathered for generate() | layerwise: per-layer gathers, synced ranks
    generation: str = "local"
    # Memory savers (each a Decision with its reason):
    pure_bf16: bool = False  # precision bf16-pure: trained weights, gradients and optimizer states in bf16
    compensation: str = "none"  # with pure_bf16: none | stochastic_rounding | kahan
    loss_implementation: str = "plain"  # plain | chunked | liger | cut_cross_entropy
    loss_chunk_tokens: int = 0  # chunked: tokens whose logits exist at once
    checkpoint_layers: int = 0  # decoder layers that recompute their activations (0: none; gradient_checkpointing)
    activation_offload: bool = False  # saved activations moved to host memory until the backward pass
    optimizer_in_backward: bool = False  # each parameter stepped (and its gradient freed) as soon as it is complete
    compile: bool = False  # each decoder layer compiled with torch.compile (plan/compiling.py, finetune/compile.py)
    # Parallelism inside the model (finetune/distributed/mesh.py): ranks are laid out data x context x tensor, tensor
    # innermost (consecutive ranks, one node); data-parallel degree = world_size / (tensor_parallel * context_parallel)
    tensor_parallel: int = 1  # each decoder layer's attention and MLP weights split over this many ranks (DTensor)
    context_parallel: int = 1  # each sequence split over this many ranks (ring attention)
    # each MoE layer's routed experts split over this many data-parallel ranks (all-to-all dispatch, distributed/ep.py)
    expert_parallel: int = 1
    scaling: dict = field(default_factory=dict)  # predicted compute/communication/overlap seconds and efficiency
    step_seconds: dict = field(default_factory=dict)  # estimated seconds per step by cause (plan/cost.py)
    alternatives: tuple = ()  # runners-up: {"setup", "gib", "seconds"} each, fastest first
    rollout: RolloutPlan | None = None  # where a sampling method's rollouts run; None: it samples none ({} in json)
    # On a cluster (plan/stopping.py): CPU cores per node, bytes the busiest node writes per checkpoint, and seconds
    # from a stop signal to a complete checkpoint (the scheduler's warning, torchrun's shutdown timeout)
    cpus_per_node: int = 1
    checkpoint_bytes: int = 0
    stop_seconds: int = 0
    max_steps: int = 0  # optimizer steps of the run when train.max_steps sets them; 0: train.epochs does
    device_memory_bytes: int = 0  # each device's whole memory (device_capacity_bytes: what the planner may fill)
    # How packed rows keep samples apart besides the kernel (plan/attention.py): masks per layer type ({} one causal
    # mask; else layer type -> {"window": n} | {"chunk": n} | {}), seq_idx for state-space/linear-attention kernels
    attention_masks: dict = field(default_factory=dict)
    sample_index: bool = False
    flash_upgrade: bool = False  # flash_attention_2 may replace the planned kernel where flash-attn is installed
    padding_free: bool = False  # unpacked rows: each micro-batch's rows concatenated into one row (plan/attention.py)
    # the model routes tokens to experts (ModelFacts.is_moe): a 4/8-bit base keeps what peft adapts by parameter in
    # 16 bits (models.kept_modules reads the model's structure for it); a dense model's loading reads nothing more
    moe: bool = False
    # the LoRA dropout trained with: adapter.dropout, or 0 where the adapter reaches an MoE model's fused experts
    # (config/moe_checks.py lora_dropout); 0 for full fine-tuning; None in plans written before it was recorded
    lora_dropout: float | None = 0.0
    # on a CPU, that dropout draws only the dropped positions (finetune/dropout.py) instead of torch's per-element draw
    sparse_dropout: bool = False
    # a vision-language model trained through its processor (config/vision_checks.py trains_images): loaded as an
    # image-text-to-text model; what of its vision side trains: none | projector | all
    vision: bool = False
    train_vision: str = "none"
    # its images as planned (plan/explain.py record_vision): per image the image tokens the language model sees and the
    # patches its tower runs over, the largest the processor makes; images in one sequence assumed (0: no images)
    image_tokens: int = 0
    image_patches: int = 0
    images_per_sample: int = 0
    # some training rows may hold no image (ft train sets it from the prepared rows): a micro-batch of them leaves the
    # vision side's trained parameters (a projector, a cross-attention layer's) out of the forward, which DDP must
    # then search for after each forward; where every row holds an image it needs no search
    image_free_rows: bool = True

    def decision(self, field: str) -> Decision:
        return next(d for d in self.decisions if d.field == field)

    @property
    def data_parallel(self) -> int:
        """Ranks that see different data: the world over the tensor- and context-parallel groups."""
        return self.world_size // (self.tensor_parallel * self.context_parallel)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    def to_json(self) -> dict[str, Any]:
        """The Plan as plain JSON types (`ft plan --json`, plan.json in the run folder): each field under its own name
        (or where `PLACED` says), rounded figures for people beside them, and the exact values in `exact`."""
        out = {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name not in (*PLACED, *STRUCTURED)}
        out["rollout"] = asdict(self.rollout) if self.rollout else {}
        e = self.estimate
        out.update(
            offload=self.offload != "none",
            offload_target=self.offload,
            tokens_per_step=self.tokens_per_step,
            params={"total": e.total_params, "trainable": e.trainable_params},
            memory={
                "per_device_gib": round(e.device_bytes / GiB, 2),
                # what torch.cuda.max_memory_allocated / max_memory_reserved should show (no CUDA context, no reserve)
                "per_device_allocated_gib": round(e.allocated_bytes / GiB, 2),
                "per_device_reserved_gib": round(e.reserved_bytes / GiB, 2),
                "device_capacity_gib": round(self.device_capacity_bytes / GiB, 2),
                "device_memory_gib": round(self.device_memory_bytes / GiB, 2),
                "host_gib": round(e.host_bytes / GiB, 2),
                "host_capacity_gib": round(self.host_capacity_bytes / GiB, 2),
                "per_device_breakdown_gib": {k: round(v / GiB, 3) for k, v in e.device.items()},
                "host_breakdown_gib": {k: round(v / GiB, 3) for k, v in e.host.items()},
            },
            decisions=[
                {"field": d.field, "value": d.value, "reason": d.reason, "source": d.source} for d in self.decisions
            ],
            communication={
                "per_rank_gib_per_step": {k: round(v / GiB, 3) for k, v in self.communication.items()},
                "seconds_per_step_estimate": round(self.communication_seconds, 3),
            },
            step_seconds_estimate=dict(self.step_seconds),
            cluster={
                "cpus_per_node": self.cpus_per_node,
                "checkpoint_gib_per_node": round(self.checkpoint_bytes / GiB, 3),
                "stop_seconds": self.stop_seconds,
            },
        )
        exact = {name: _plain(getattr(self, name)) for name, (block, _) in PLACED.items() if block == "exact"}
        estimate = {"device": e.device, "host": e.host, "notes": list(e.notes)}
        out["exact"] = {
            "estimate": {**estimate, "total_params": e.total_params, "trainable_params": e.trainable_params}
        }
        out["exact"].update(exact)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        """The Plan that `to_json` wrote (plan.json in the run folder): what every rank of a job runs. A field with a
        default may be absent (a plan written before the field existed); one without is a KeyError."""
        values = {}
        for f in fields(cls):
            if f.name in STRUCTURED:
                continue
            block, key = PLACED.get(f.name, (None, f.name))
            source = data.get(block, {}) if block else data
            if key in source:
                value = source[key]
                values[f.name] = (
                    tuple(value) if f.type.startswith("tuple") else dict(value) if f.type == "dict" else value
                )
            elif f.default is MISSING and f.default_factory is MISSING:
                raise KeyError(f.name)
        if "flash_upgrade" not in data:  # plans written before it: the kernels that flash-attn could replace
            values["flash_upgrade"] = data["attn_implementation"] in ("sdpa", "sdpa_varlen")
        if "lora_dropout" not in data:  # plans written before it was recorded: the config's dropout applies
            values["lora_dropout"] = None
        values["rollout"] = RolloutPlan(**values["rollout"]) if values.get("rollout") else None
        e = data["exact"]["estimate"]
        return cls(
            **values,
            estimate=Estimate(
                dict(e["device"]), dict(e["host"]), e["total_params"], e["trainable_params"], tuple(e["notes"])
            ),
            decisions=tuple(Decision(d["field"], d["value"], d["reason"], d["source"]) for d in data["decisions"]),
        )
