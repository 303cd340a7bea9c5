"""Setup: one candidate training setup, everything the memory estimate (plan/memory.py) and its transient terms
(plan/transients.py) depend on."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Setup:
    """One candidate training setup: what the estimate depends on."""

    adapter: str  # full | lora | qlora
    quantization: str  # none | nf4 | int8
    precision: str  # bf16 | fp16 | fp32
    optimizer: str
    micro_batch_size: int
    seq_len: int
    gradient_checkpointing: bool
    sharding: str | None = None  # None | zero1 | zero2 | zero3 | full_shard | shard_grad_op | hybrid_shard
    shard_size: int = 1
    offload: str = "none"  # none | optimizer | all
    lora_r: int = 16
    lora_targets: str | tuple[str, ...] = "all-linear"
    lora_dropout: float = 0.05
    dora: bool = False
    modules_to_save: tuple[str, ...] = ()
    double_quant: bool = True
    attention: str = "sdpa"
    sequences_per_row: int = 1  # sequences one row puts through the model (DPO: chosen + rejected, 2)
    reference_copy: bool = False  # a frozen full copy of the model as reference
    generation_tokens: int = 0  # methods that sample (GRPO): prompt + completion tokens per generated sequence
    generation_batch: int = 0  # sequences generated at once per rank
    accelerator: bool = True  # False on CPU: no CUDA context
    loading: str = "replica"  # replica | meta | partitioned: how a rank creates its model (plan.loading)
    accumulation: int = 1  # micro-batches per optimizer step on each rank
    rollout_bytes: int = 0  # a colocated rollout engine's device memory while awake (topology.EngineShare)
    rollout_sleeps: bool = False  # it sleeps during the backward pass: it only shares the device with resident state
    rollout_host_bytes: int = 0  # per process: its weights in host RAM while asleep
    reward_models: tuple = ()  # GRPO rewards by trained reward models: (ModelFacts, batch_size) of each
    head: str = "lm"  # lm: next-token logits | score: one value per sequence (reward-model training)
    vision_frozen: int = 0  # a vision-language model's parameters that stay frozen under full fine-tuning
    vision_trained: int = 0  # its vision parameters trained in full next to an adapter (model.train_vision)
    # its images (plan/vision.py): positions the tower runs over per sequence (images per sample × patches per image),
    # the positions one of its attentions spans (an image or a tile), and whether the tower trains (train_vision all)
    vision_patches: int = 0
    vision_span: int = 0
    tower_trains: bool = False
    # memory savers (plan.py): bf16 master weights/gradients/moments, chunked or fused loss, selective checkpointing,
    # activations in host memory, optimizer step in backward
    pure_bf16: bool = False
    compensation: str = "none"
    loss: str = "plain"  # plain | chunked | fused
    trained_share: float = 1.0  # the plain loss's positions with logits: the trained ones only (methods/head.py)
    loss_chunk_tokens: int = 0
    checkpoint_layers: int | None = None  # None: all layers when gradient_checkpointing, else none
    activation_offload: bool = False
    optimizer_in_backward: bool = False
    # parallelism inside the model (plan/parallel.py): decoder layers split over tensor_parallel ranks (sequence
    # parallel norms), each sequence over context_parallel ranks; shard_size then counts the FSDP group (dp x cp)
    tensor_parallel: int = 1
    context_parallel: int = 1
    expert_parallel: int = 1  # routed experts split over this many data-parallel ranks (plan/expert_parallel.py)
    # FSDP: untied embeddings and output head are units of their own (ft's FSDP2, distributed/fsdp.py ends); False:
    # in the root unit, as FSDP1's wrapping of decoder layers leaves them (published runs, tests/calibration.py)
    fsdp_end_units: bool = True
    # what other libraries do differently, for published runs (tests/calibration.py); ft's own runs keep the defaults:
    # whose NF4: bitsandbytes (ft) keeps the quantization state beside each parameter, whole on every rank; torchao's
    # NF4Tensor (torchtune) carries it inside the tensor, sharded and gathered with the weights
    nf4_library: str = "bitsandbytes"
    # the plain loss's copies of the logits (plan/transients.py): none (ft's, methods/head.py); shifted (transformers
    # <= 4.44: an fp32 upcast in the model and a shifted fp32 copy for the loss); kept (shifted, and the training loop
    # keeps the model's output, its fp32 logits with it, through the backward pass)
    loss_copies: str = "none"
