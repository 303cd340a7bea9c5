"""Peak memory per device (and host RAM per node) for one training setup, as a breakdown.

All figures are bytes. Notation: N total parameters, T trainable parameters, h hidden size, I MLP size,
q = heads*head_dim, kv = kv_heads*head_dim, L layers, V vocab, t tokens per micro-batch
(micro_batch * seq_len * sequences per row: 2 for DPO's chosen+rejected), a = bytes of the compute dtype (2 for
bf16/fp16, 4 for fp32), S = ranks one shard group spans.

weights        frozen base: N*a; nf4: 0.5 B per nn.Linear parameter + constants
               (blocks of 64: fp32 absmax = 4/64 B; with double quantization 1/64 + 4/(64*256) B),
               the rest (embeddings, head, norms, and MoE experts: bitsandbytes quantizes nn.Linear only, and
               transformers stores experts as fused 3-D parameters) in a; int8: 1 B + a 4-byte scale per output row.
               Full fine-tuning keeps fp32 master weights: 4*N. N counts every expert (all are held, whichever a
               token picks); checkpoints published quantized (gpt-oss's MXFP4 experts) are dequantized on load: a.
compute copy   full fine-tuning in bf16/fp16: autocast keeps a half-precision copy of each weight it
               casts for the whole step: a*N (replicated unless the parameters are sharded).
adapter        LoRA: r*(in+out) per targeted linear, + out per module with DoRA, + modules_to_save;
               stored in fp32: 4*T.
gradients      4*T (fp32, like the trained weights; 2*T with pure bf16); with the optimizer step in backward
               only the largest parameter's gradient at once. DeepSpeed bf16/fp16: half-precision gradients
               (whole under ZeRO-1, a reduce bucket under ZeRO-2/3) and an fp32 gradient partition. DDP: the
               gradients are views of its all-reduce buckets (distributed/ddp.py), nothing beyond them.
master weights DeepSpeed bf16/fp16: fp32 copies of the trained parameters, partitioned from ZeRO-1 on; the
               parameters themselves are half precision (`weights`).
optimizer      AdamW: 8*T (two fp32 moments; 4*T in bf16 with pure bf16, +2*T for its Kahan buffer); 8-bit
               AdamW: 2*T. Paged variants keep their states in CUDA unified memory, which pages out to host RAM
               under pressure: counted in host RAM, with their paging traffic in the step time.
activations    saved for backward, per token and layer (elements), averaged over the layers' kinds: attention
               4h + 3q + 3kv (q doubled where it also computes an output gate; MLA: kv = heads*v_head_dim plus the
               two latents; gated DeltaNet: q = k = the key width, kv = the value width, plus the gate), MLP
               (gated: 4I; plain: 2I; MoE: 4*I_moe*k for the k experts a token visits, its k dispatched copies in
               and out 2*k*h, router logits and probabilities in fp32 2E*4/a, a shared expert 4*I_shared) + LoRA
               inputs after dropout; times a*t*L. Eager attention adds heads*seq*(2a+4) per token per layer (scores,
               probabilities in fp32); flex_attention its block masks, one per attention layer type, 4 int32
               index tensors of (seq/128)^2 per row. The kernel is the one the planner chooses for the model
               class (plan/attention.py), not only the one the config names. With k of L layers checkpointed:
               a*h*t for each of the k (its input), full activations for the other L-k, plus one layer's
               recomputed activations. With activation offload only two layers' stored tensors are on the device
               (in flight); the rest wait in pinned host memory. A quantized base adds its largest linear
               dequantized to a for the matmul, one at a time. (plan/transients.py computes these and the logits.)
vision         A vision-language model's tower over one micro-batch's images: P = micro_batch * sequences per
activations    row * images per sample * patches per image (the largest image the processor makes:
               catalog_vision.py; images per sample: config/vision_checks.py), h_v, I_v, L_v the tower's width, MLP
               size and layers. Per patch and layer attention 10*h_v (4h + 3q + 3kv, its heads spanning h_v) and
               MLP 2*I_v (3*I_v with quick_gelu, whose ops save a third tensor; gated 4*I_v), times a*P; eager
               attention adds heads*span^2*(2a+4) per image or tile (span: its patches). The tower trained
               (model.train_vision all): all L_v layers' (with checkpointing each layer's input a*P*h_v and one
               layer recomputed); frozen (none, projector): nothing saved for backward, one layer's working set in
               flight. Both add the tower's output for the projector, a*P*h_v; a cross-attention tower (Llama 3.2
               Vision) also a*P*(h + 2*kv*C): the projected tiles and the keys and values of C cross layers.
logits         t*V*(a + 8): the logits, their fp32 upcast and the fp32 gradient of the loss (t*V*8 when the
               logits are fp32 already: the upcast is the same tensor); of the trained positions only, t*s*V*(a + 8),
               where the plain loss of SFT gets one packed row a micro-batch (planner.one_row_batches): s the
               largest share of a prepared row's positions trained (1 before the data is prepared); chunked: one chunk
               of that plus the final hidden states; a fused kernel: the hidden states and their gradient.
               A reward model's score head (plan.head score): the final hidden states and their gradient, t*h*(a+4).
               Published runs on transformers <= 4.44 (Setup.loss_copies): t*V*12 (fp32 upcast, shifted copy,
               log_softmax), t*V*16 where the loop keeps the model's fp32 logits through the backward pass.
reference      DPO/GRPO with a frozen copy as reference: the base weights again.
reward model   GRPO rewards by trained reward models: each whole on every rank in a (never sharded), its parameters
               from its config.json (the language model without its head, plus a one-output score).
reward scoring Its forward pass under inference mode on batch_size sequences of seq_len tokens: per token the
               residual stream and its norm, attention projections and the MLP's intermediates,
               a*(2h + 2q + 2kv + 3I) (2I for a plain MLP). A phase of its own, after the rollout, before training.
generation     GRPO rollouts by the training model (transformers): KV cache 2*L*kv*a*(prompt+completion)
               per sequence for the whole per-rank batch (sliding layers: their window; MLA: its compressed
               latent and rotary key, kv_lora_rank + qk_rope_head_dim per layer; linear attention: a fixed
               state), plus fp32 logits of the last position. Rollout and backward do not overlap, so the peak
               counts the larger of the two phases.
rollout engine A colocated vLLM engine's memory share (plan/rollout.py). Asleep during the backward pass (GPUs,
               sleep level 1: weights to host RAM) it shares the device with the resident state only (the
               larger phase counts); awake all along (CPU, asynchronous rollouts, or where that is faster)
               it is added. No allocator reserve on it (vLLM allocates its KV cache as one block).
overhead       GPU: 1 GiB CUDA context and library workspaces (outside torch's allocator), plus 5% that the
               caching allocator reserves beyond what tensors use: max_memory_allocated ~ the rest,
               max_memory_reserved ~ all but the context (Estimate.allocated_bytes / reserved_bytes).
unsharded      FSDP with an adapter and gradient accumulation: gradient sync is off until the last
gradients      micro-batch, and FSDP2 keeps each trained parameter's whole gradient in fp32 until
               then: 4*T. (Full fine-tuning syncs every micro-batch instead: 4*N would not fit.)
loading        What a rank holds while its model is created, before gradients and optimizer states
               exist: with `replica` loading the whole model (weights, adapter, a reference copy) in
               its load dtype; with `meta` (FSDP2), `partitioned` (ZeRO-3) or `host` (a 4-bit base
               quantized in host RAM, then moved to the GPU layer by layer as FSDP2 shards it) loading
               its shard of them plus the largest tensor or layer in flight. `host` loading holds the
               whole quantized model in each process's host RAM meanwhile (the host's own loading term).
               The device peak is the larger of this and the training peak (the sum of the other
               terms); the breakdown shows it under its own key, not added to the others.

Sharding divides by S: ZeRO-1 the optimizer; ZeRO-2 and FSDP shard_grad_op also the gradients
(shard_grad_op keeps unsharded half-precision parameters between forward and backward); ZeRO-3 and
FSDP full/hybrid shard also the weights, plus two gathered layers (the one in use and the prefetched
one); FSDP's embeddings and head (the head under the plain loss) stay sharded by vocabulary rows, walked half a
layer at a time, or, where that cannot apply, are gathered only while they run; its root unit (final norm, a tied
table the chunked loss runs) for the whole step (gathered_bytes); with `all`
offloaded each layer's shard is staged on the device before its all-gather. Offloading moves optimizer
states (`optimizer`) or weights, gradients and optimizer states (`all`) into host RAM, which is checked per
node with ~2.5 GiB per process for the runtime. ZeRO-1/2 shard the fp32 master weights with the optimizer
states; the half-precision parameters stay whole on every rank.

Tensor parallelism over tp ranks (plan/parallel.py) divides each decoder layer's share of the state (weights,
adapter, gradients, optimizer states, gathered layers) by tp, and with sequence-parallel norms its activations too;
embeddings, output head and final norm stay whole on each tp rank. Context parallelism over cp ranks divides the
tokens each rank holds: activations and logits / cp. S is then the FSDP group (dp x cp ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from finetune.catalog import ModelFacts
from finetune.catalog_layers import LINEAR_ATTENTION
from finetune.plan.setup import Setup

# activations and logits are computed in plan/transients.py; imported here for the estimate and its callers
from finetune.plan.transients import (  # noqa: F401
    DTYPE_BYTES,
    activation_bytes,
    checkpointed_layers,
    logits_bytes,
    offloaded_activation_bytes,
    pinned_bytes,
    stored_activation_bytes,
    targeted_linears,
    tokens_per_micro_batch,
    transient_bytes,
    vision_activation_bytes,
)

GiB = 1024**3
OPTIMIZER_BYTES = {
    "adamw_torch": 8,
    "adamw_torch_fused": 8,
    "paged_adamw_32bit": 8,
    "adamw_8bit": 2,
    "paged_adamw_8bit": 2,
}
PAGED = ("paged_adamw_8bit", "paged_adamw_32bit")  # bitsandbytes: states in CUDA unified memory
CUDA_CONTEXT = 1 * GiB
FRAGMENTATION = 0.05
PROCESS_HOST_RAM = int(2.5 * GiB)
SHARD_PARAMS = {"zero3", "full_shard", "hybrid_shard"}
SHARD_GRADS = SHARD_PARAMS | {"zero2", "shard_grad_op"}
SHARD_OPTIMIZER = SHARD_GRADS | {"zero1"}
FSDP = {"full_shard", "shard_grad_op", "hybrid_shard"}
LOADING = "while loading (peak; not added)"  # the breakdown key of the load-time peak
RESERVE = "allocator reserve (fragmentation)"  # reserved by torch's caching allocator beyond what tensors use
PINNED_ACTIVATIONS = "offloaded activations (pinned)"  # the host key of activation offloading
ROLLOUT = "rollout engine (vLLM)"  # a colocated rollout engine's memory share (plan/rollout.py)
ROLLOUT_HOST = "rollout engine weights (asleep)"  # its weights in host RAM while it sleeps
REWARD_MODEL = "reward model"  # GRPO: trained reward models, whole on every rank
SCORING = "reward scoring"  # their forward pass: a phase of its own
VISION = "vision activations"  # a vision-language model's tower on the micro-batch's images
TRANSIENT = (
    "activations",
    VISION,
    "logits and loss",
    "generation (KV cache)",
    SCORING,
)  # freed between the steps' phases
CONTEXT = "CUDA context"  # driver, kernels and library workspaces: outside torch's allocator
QUANT_STATE = "4-bit quantization state (whole)"  # bitsandbytes' constants: never sharded (see _shard_and_offload)
DS_BUCKET_BYTES = 2 * 500_000_000  # DeepSpeed's default reduce bucket: 5e8 half-precision elements


@dataclass(frozen=True)
class Estimate:
    """Bytes per device and per node's host RAM, by component."""

    device: dict[str, int]
    host: dict[str, int]
    total_params: int
    trainable_params: int
    notes: tuple[str, ...] = field(default=())

    @property
    def device_bytes(self) -> int:
        """The peak per device: the larger of training (the sum of the terms) and loading (its own term)."""
        return max(sum(v for k, v in self.device.items() if k != LOADING), self.device.get(LOADING, 0))

    @property
    def reserved_bytes(self) -> int:
        """What torch's allocator reserves at the peak (torch.cuda.max_memory_reserved): all but the CUDA context."""
        return self.device_bytes - self.device.get(CONTEXT, 0)

    @property
    def allocated_bytes(self) -> int:
        """What tensors occupy at the peak (torch.cuda.max_memory_allocated)."""
        return self.reserved_bytes - self.device.get(RESERVE, 0)

    @property
    def host_bytes(self) -> int:
        """Host RAM per node at its peak: training (the sum of the terms) or loading (its own term)."""
        return max(sum(v for k, v in self.host.items() if k != LOADING), self.host.get(LOADING, 0))


def estimate(m: ModelFacts, s: Setup, processes_per_node: int = 1) -> Estimate:
    """Peak bytes per device for setup `s` of model `m`, and host bytes per node."""
    a = DTYPE_BYTES[s.precision]
    trainable = trainable_params(m, s)
    master = 2 if s.pure_bf16 else 4  # bytes of each trained value: weights, gradients, each optimizer moment
    state = {
        "weights": weight_bytes(m, s, a),
        "master weights": master_bytes(m, s, a, trainable),
        "compute copy": a * m.num_params if autocast_copy(s, a) else 0,
        "adapter": (a if deepspeed(s) else master) * trainable if s.adapter != "full" else 0,
        "gradients": gradient_bytes(m, s, a, trainable),
        "optimizer": optimizer_bytes(s, trainable),
        "reference model": weight_bytes(m, s, a, frozen=True) if s.reference_copy else 0,
    }
    state = _split_layers(m, s, trainable, state)
    device, host = _shard_and_offload(m, s, a, state)
    expert_parallel_bytes(m, s, a, device)
    acts, logits = transient_bytes(m, s, a)  # the loss and each layer's backward: the larger phase counts
    vision = vision_activation_bytes(m, s, a)
    device[REWARD_MODEL] = sum(a * reward_model_params(f) for f, _ in s.reward_models)
    gen_peak, scoring = generation_bytes(m, s, a), scoring_bytes(s, a)
    engine = s.rollout_bytes / (1 + FRAGMENTATION) if s.accelerator else s.rollout_bytes  # no reserve counts on it
    training = max(gen_peak, scoring, engine if s.rollout_sleeps else 0) <= acts + vision + logits
    device["activations"] = acts if training else 0
    device[VISION] = vision if training else 0
    device["logits and loss"] = logits if training else 0
    device["generation (KV cache)"] = 0 if training or scoring > gen_peak else gen_peak
    device[SCORING] = 0 if training or scoring <= gen_peak else scoring
    if s.activation_offload and training:
        host[PINNED_ACTIVATIONS] = offloaded_activation_bytes(m, s, a)
    if s.sharding in FSDP and s.accumulation > 1 and s.adapter != "full":
        # FSDP2 keeps whole fp32 gradients while sync is off (full fine-tuning syncs every micro-batch instead)
        device["unsharded gradients (accumulation)"] = 4 * trainable * tp_shares(m, s, trainable)[1]
    if s.accelerator:
        device[RESERVE] = int(FRAGMENTATION * sum(device.values()))
        device[CONTEXT] = CUDA_CONTEXT
    device[ROLLOUT] = s.rollout_bytes if not (s.rollout_sleeps and training) else 0  # the rollout phase, or all along
    device[LOADING] = loading_bytes(m, s, a, state) + (CUDA_CONTEXT if s.accelerator else 0)
    host[ROLLOUT_HOST] = s.rollout_host_bytes
    host = {k: v * processes_per_node for k, v in host.items()}
    host[f"process runtimes ({PROCESS_HOST_RAM / GiB:g} GiB each)"] = PROCESS_HOST_RAM * processes_per_node
    host_load = loaded_bytes(state) if s.loading == "host" else 0  # each process's whole quantized model
    host[LOADING] = (host_load + PROCESS_HOST_RAM) * processes_per_node
    device = {k: int(v) for k, v in device.items() if v}
    host = {k: int(v) for k, v in host.items() if v}
    return Estimate(device, host, m.num_params, trainable, model_notes(m, s, a))


def model_notes(m: ModelFacts, s: Setup, a: int) -> tuple[str, ...]:
    """What the estimate assumes of this model's architecture, one line each: experts held and computed, fused experts
    under QLoRA, a checkpoint's published format, and what generation caches."""
    notes = []
    if m.is_moe:
        shared = f" and a shared expert of {m.shared_expert_size}" if m.shared_expert_size else ""
        dense = f"; {len(m.dense_layers)} of the {m.num_layers} layers are dense" if m.dense_layers else ""
        held, active = m.num_params / 1e9, m.active_params / 1e9
        notes.append(
            f"MoE: {m.num_experts} experts of {m.moe_intermediate_size}{shared}, {m.experts_per_token} per token"
            f"{dense}: memory holds all {held:.1f}B parameters, a token is computed by {active:.1f}B (its experts "
            "and all that is not an expert); activations count the router's logits and each token's dispatched copies"
        )
    if m.is_moe and s.quantization != "none":
        experts = m.expert_params / 1e9
        notes.append(
            f"{s.quantization}: bitsandbytes quantizes nn.Linear modules only, so the {experts:.1f}B fused expert "
            f"parameters stay {s.precision} ({m.expert_params * a / GiB:.1f} GiB before sharding)"
        )
    if m.checkpoint_quantization == "mxfp4":  # transformers dequantizes MXFP4 experts to train them
        notes.append(f"the published MXFP4 expert weights are dequantized on load: counted at {s.precision}")
    elif m.checkpoint_quantization:
        notes.append(
            f"the published checkpoint stores {m.checkpoint_quantization} weights: the plan counts them "
            f"dequantized, at {s.precision}"
        )
    if s.generation_tokens and (m.is_mla or m.layer_count(LINEAR_ATTENTION) or m.sliding_window):
        per_token = m.cache_elements(s.generation_tokens) / s.generation_tokens
        notes.append(
            f"generation caches {per_token:,.0f} values per token over all layers (MLA's compressed latent, sliding "
            "windows and linear-attention states as they apply)"
        )
    return tuple(notes)


def tp_shares(m: ModelFacts, s: Setup, trainable: int) -> tuple[float, float]:
    """The shares of (all parameters, trained parameters) one tensor-parallel rank holds: the decoder layers' split
    over tensor_parallel ranks (their linears column- or row-wise, a LoRA adapter's matrices with them), embeddings,
    output head and final norm whole (sharded over the data-parallel ranks only)."""
    tp = s.tensor_parallel
    if tp == 1:
        return 1.0, 1.0
    layers = m.decoder_params
    params = (layers / tp + m.num_params - layers) / m.num_params
    if s.adapter == "full":
        return params, params
    lora = trainable_params(m, replace(s, modules_to_save=()))
    return params, (lora / tp + trainable - lora) / max(trainable, 1)


def _split_layers(m: ModelFacts, s: Setup, trainable: int, state: dict[str, float]) -> dict[str, float]:
    """What one tensor-parallel rank holds of each state term (see tp_shares)."""
    params, trained = tp_shares(m, s, trainable)
    per_param = ("weights", "compute copy", "reference model")
    return {k: v * (params if k in per_param else trained) for k, v in state.items()}


def deepspeed(s: Setup) -> bool:
    return s.sharding in ("zero1", "zero2", "zero3")


def autocast_copy(s: Setup, a: int) -> bool:
    """Full fine-tuning with fp32 weights under autocast: each weight's half-precision cast is cached for the step
    (replicated, or sharded with the parameters). DeepSpeed's bf16/fp16 modes hold the parameters in half precision
    themselves (`weights`), pure bf16 has nothing to cast, and FSDP2 casts while gathering (`gathered layers`)."""
    if s.adapter != "full" or a == 4 or s.pure_bf16 or deepspeed(s):
        return False
    return s.sharding not in FSDP or s.sharding == "shard_grad_op"


def master_bytes(m: ModelFacts, s: Setup, a: int, trainable: int) -> float:
    """DeepSpeed in bf16/fp16 trains half-precision parameters against an fp32 master copy of the trained ones,
    partitioned over the ranks from ZeRO-1 on (deepspeed runtime/zero/stage_1_and_2.py:
    single_partition_of_fp32_groups)."""
    if deepspeed(s) and a < 4:
        return 4 * trainable
    return 0


def gradient_bytes(m: ModelFacts, s: Setup, a: int, trainable: int) -> float:
    """Gradients of the trained parameters as they are held until the optimizer step. With the step in backward only
    the largest parameter's gradient exists at once."""
    per_value = 2 if s.pure_bf16 else 4
    if s.optimizer_in_backward:
        return per_value * min(trainable, m.largest_tensor_params)
    if deepspeed(s) and a < 4:
        # half-precision gradients, reduced in buckets into fp32 partitions (counted with the optimizer's shard);
        # ZeRO-1 keeps the whole half-precision gradient, ZeRO-2/3 only its bucket
        return a * trainable if s.sharding == "zero1" else DS_BUCKET_BYTES
    return per_value * trainable


def optimizer_bytes(s: Setup, trainable: int) -> float:
    """Optimizer state per trained parameter: AdamW's two moments (fp32, or bf16 with pure bf16), 8-bit moments, the
    Kahan compensation buffer, and DeepSpeed's fp32 gradient partition."""
    per = OPTIMIZER_BYTES[s.optimizer]
    if s.pure_bf16 and per == 8:
        per = 4
    if s.pure_bf16 and s.compensation == "kahan":
        per += 2
    if deepspeed(s) and s.precision != "fp32":
        per += 4  # the fp32 gradient partition the optimizer steps from
    return per * trainable


def _shard_and_offload(
    m: ModelFacts, s: Setup, a: int, state: dict[str, float]
) -> tuple[dict[str, float], dict[str, float]]:
    """Divide state by the shard group, then move offloaded parts to the host."""
    n = max(1, s.shard_size)
    params_sharded = s.sharding in SHARD_PARAMS
    sharded = {
        "weights": params_sharded or (s.sharding == "shard_grad_op" and s.adapter == "full"),
        "master weights": s.sharding in SHARD_OPTIMIZER,
        "compute copy": params_sharded,
        "adapter": params_sharded,
        "gradients": s.sharding in SHARD_GRADS and not deepspeed(s),
        "optimizer": s.sharding in SHARD_OPTIMIZER,
        "reference model": params_sharded,
    }
    device = {k: v / n if sharded[k] else v for k, v in state.items()}
    host: dict[str, float] = {}
    if s.optimizer in PAGED and s.offload == "none":  # unified memory: pages move to host RAM under pressure
        host["paged optimizer states"] = device.pop("optimizer")
    if s.offload == "optimizer":
        moved = [k for k in state if k in ("master weights", "optimizer")]
    elif s.offload == "all":
        moved = [k for k in state if k != "compute copy"]
    else:
        moved = []
    for k in moved:  # in state's order: the plan reads the same under any hash seed
        host[f"offloaded {k}"] = device.pop(k)
    if params_sharded and s.quantization == "nf4" and s.nf4_library == "bitsandbytes":
        # bitsandbytes keeps each 4-bit layer's quantization state (absmax, nested statistics) on the module, beside its
        # parameter (nn/modules.py Params4bit._quantize: module.quant_state), and moves it with the parameter in place
        # (Params4bit.to); FSDP2 and ZeRO-3 shard and offload parameters only, so it stays whole on every device.
        # torchao's NF4Tensor splits its scalers with its data (torchao/dtypes/nf4tensor.py, nf4_split over
        # _INNER_TENSOR_NAMES_FOR_SHARDING): sharded with the weights, as counted above
        whole = quant_state_bytes(m, s)
        held = host if s.offload == "all" else device
        key = "offloaded weights" if s.offload == "all" else "weights"
        held[key] -= whole / n
        device[QUANT_STATE] = whole
    if params_sharded:
        stored = a if s.quantization == "none" else 0.5 + 2 / 64
        device["gathered layers"] = gathered_bytes(m, s, a, stored)
        if s.offload == "all":  # each layer's shard is copied to the device before it is gathered
            device["offload staging (host to device)"] = 2 * m.layer_params * stored / n
    if s.sharding == "shard_grad_op" and s.adapter == "full":
        device["compute copy"] = a * m.num_params  # kept unsharded between forward and backward
    return device, host


def gathered_bytes(m: ModelFacts, s: Setup, a: int, stored: float) -> float:
    """Parameters gathered whole at once under ZeRO-3 / FSDP: two decoder layers (the one in use and the prefetched
    one). FSDP2 on a plain mesh (`vocab_rows`) gathers the embeddings and the head half a layer at a time; otherwise
    (distributed/fsdp.py `ends`) untied embeddings and the output head are units of their own, each gathered only
    while it runs, next to one layer; the root unit (final norm, a tied table, and the head where the loss runs it
    outside the forward pass, chunk by chunk) stays gathered for the whole step. Two whole layers also where FSDP2
    gathers a layer in parts (distributed/fsdp.py pieces, a quarter of a Llama layer each): compiled layers (chosen
    after the fit) stay whole units, and a bound for every family is two layers."""
    layer = m.layer_params * (a if s.adapter == "full" else stored) / s.tensor_parallel
    if s.sharding not in FSDP:
        return 2 * layer
    rest = m.num_params - m.decoder_params  # embeddings, head, final norm (not quantized)
    if s.fsdp_end_units and vocab_rows(s):
        # distributed/vocab.py: the tables stay sharded and are walked half a layer at a time, next to one layer; a
        # head the chunked loss runs stays in the root (and a table tied to it with it)
        plain = s.loss == "plain"
        if m.tie_word_embeddings:
            tables = m.embedding_params if plain else 0
        else:
            tables = m.embedding_params + (m.lm_head_params if plain else 0)
        return 2 * layer + a * (rest - tables)
    own = [] if m.tie_word_embeddings or not s.fsdp_end_units else [m.embedding_params]
    own += [m.lm_head_params] if own and s.loss == "plain" else []
    return max(2 * layer, layer + a * max(own, default=0)) + a * (rest - sum(own))


def vocab_rows(s: Setup) -> bool:
    """Whether FSDP2 shards the embeddings and head by vocabulary rows (distributed/fsdp.py wrap): a 1-D data-parallel
    mesh, no CPU offload of the parameters."""
    plain_mesh = s.tensor_parallel == 1 and s.context_parallel == 1 and s.expert_parallel == 1
    return plain_mesh and s.sharding in ("full_shard", "shard_grad_op") and s.offload != "all"


EXPERT_DISPATCH = "expert dispatch (all-to-all buffers)"


def expert_parallel_bytes(m: ModelFacts, s: Setup, a: int, device: dict[str, float]) -> None:
    """Expert parallelism (plan/expert_parallel.py) in place of `device`'s terms: an experts module is gathered over the
    ranks that hold the same experts, 1/ep of a layer's experts (the rest of the layer as before); the layer in flight
    holds a second copy of its routed tokens' hidden states and of the experts' outputs (sent, and received: 2·t·k·h
    beyond what the experts' computation holds without it).
    Sharded state is unchanged: the experts are split over ep × world/ep ranks, as FSDP2 splits them over the world."""
    ep = s.expert_parallel
    if ep <= 1 or not m.num_experts or "gathered layers" not in device:
        return
    device["gathered layers"] -= 2 * (m.expert_params / max(m.moe_layers, 1)) * a * (1 - 1 / ep)  # one MoE layer
    device[EXPERT_DISPATCH] = 2 * tokens_per_micro_batch(s) * m.experts_per_token * m.hidden_size * a


def loading_bytes(m: ModelFacts, s: Setup, a: int, state: dict[str, float]) -> float:
    """What one rank holds on its device while creating the model (see the module docstring)."""
    held = loaded_bytes(state)
    if s.loading == "replica":
        return held
    if s.offload == "all":  # the shards are created in host memory
        held = 0
    largest = max(m.layer_params, m.embedding_params, m.lm_head_params) * (4 if s.adapter == "full" else a)
    return held / max(1, s.shard_size) + largest


def loaded_bytes(state: dict[str, float]) -> float:
    """What loading creates of the state: weights, adapter and a reference copy."""
    return state["weights"] + state["adapter"] + state["reference model"]


def trainable_params(m: ModelFacts, s: Setup) -> int:
    """Parameters the optimizer updates."""
    if s.adapter == "full":
        return m.num_params - s.vision_frozen
    total = s.vision_trained
    for lin in targeted_linears(m, s.lora_targets):
        total += lin.count * (s.lora_r * (lin.in_features + lin.out_features) + (lin.out_features if s.dora else 0))
    for name in s.modules_to_save:
        if name in ("embed_tokens", "wte"):
            total += m.embedding_params
        elif name == "lm_head":
            total += m.lm_head_params or m.embedding_params  # a tied head trains the embedding table
    return total


def weight_bytes(m: ModelFacts, s: Setup, a: int, frozen: bool = False) -> float:
    """Bytes of the model's weights as stored (the trained fp32 master for full fine-tuning)."""
    if s.adapter == "full" and not frozen:  # the trained weights: fp32 masters, unless bf16 or DeepSpeed's half copy
        return (2 if s.pure_bf16 else a if deepspeed(s) else 4) * m.num_params
    quantizable = m.linear_params  # bitsandbytes replaces nn.Linear modules only: fused experts keep dtype a
    rest = m.num_params - quantizable
    if s.quantization != "none" and s.precision == "fp16":
        a = 4  # fp16 training keeps the weights it does not quantize in fp32 (adapters.py)
    if s.quantization == "nf4":
        return quantizable * 0.5 + quant_state_bytes(m, s) + rest * a
    if s.quantization == "int8":
        rows = sum(lin.out_features * lin.count for lin in m.decoder_linears)
        return quantizable + 4 * rows + rest * a
    return m.num_params * a


def quant_state_bytes(m: ModelFacts, s: Setup) -> float:
    """nf4's constants: an absmax per block of 64 weights, fp32, or with double quantization 8-bit with an fp32
    absmax per 256 of them."""
    if s.quantization != "nf4":
        return 0
    return m.linear_params * ((1 / 64 + 4 / (64 * 256)) if s.double_quant else 4 / 64)


def generation_bytes(m: ModelFacts, s: Setup, a: int) -> float:
    """GRPO rollout: KV cache of the per-rank batch plus fp32 logits of the last position."""
    if not s.generation_tokens:
        return 0
    return kv_cache_bytes(m, a, s.generation_tokens, s.generation_batch) + s.generation_batch * m.vocab_size * 4


def kv_cache_bytes(m: ModelFacts, a: float, tokens: float, sequences: float) -> float:
    """Keys and values of every layer for `sequences` sequences of `tokens` tokens each, in a-byte elements."""
    return m.cache_elements(tokens) * a * sequences


def reward_model_params(f: ModelFacts) -> int:
    """A sequence classifier with one output: the language model without its head, plus the score."""
    return f.num_params - f.lm_head_params + f.hidden_size


def scoring_bytes(s: Setup, a: int) -> float:
    """The largest reward model's forward pass on one scoring batch (see the module docstring)."""
    peak = 0.0
    for f, batch_size in s.reward_models:
        mlp = 3 * (f.moe_intermediate_size * f.experts_per_token if f.num_experts else f.intermediate_size)
        if f.mlp == "plain" and not f.num_experts:
            mlp = 2 * f.intermediate_size
        per_token = 2 * f.hidden_size + 2 * f.q_dim + 2 * f.kv_dim + mlp
        peak = max(peak, a * batch_size * s.seq_len * per_token)
    return peak
