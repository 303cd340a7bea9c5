"""The job file's schema: one frozen pydantic model per section.

Each field's docstring is its only documentation: it feeds the JSON Schema (`ft schema`), the key
reference (`ft explain`, docs/config.md) and the messages of `ft validate`. Cross-section rules (two keys
that contradict each other) live in `finetune.config.checks`, so that every problem is reported at once.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr

from finetune.config.methods import Method, SFTMethod
from finetune.config.section import AUTO, Auto, FilePath, NonNegSteps, Section, Seed, Steps, Text, Tokens
from finetune.config.types import Bounded, checked_pattern, checked_template


# ---------------------------------------------------------------- model
class ModelSection(Section):
    """The model to fine-tune."""

    name: FilePath
    """Hub id (`meta-llama/Llama-3.1-8B`), a name from ft's catalog (`ft-tiny`), or a local folder with config.json."""
    revision: Text = "main"
    """Hub revision (branch, tag or commit) to load; ignored for local folders."""
    tokenizer: FilePath | None = None
    """Tokenizer to use when it is not the model's own (hub id or folder). Leave unset to use the model's."""
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Dtype the frozen weights are loaded in. `auto` follows the plan's precision."""
    attn_implementation: Literal["auto", "sdpa", "sdpa_varlen", "eager", "flash_attention_2"] = "auto"
    """Attention kernel. `auto`: chosen from what the model class supports, with the reason in `ft plan`: sdpa, or with
    packing ft's padding-free `sdpa_varlen` (one causal attention per sample, sliding windows honoured), which SFT's
    unpacked rows also take (a micro-batch's rows concatenated into one row, none padded) unless the layers are
    compiled; where the class
    has no SDPA (attention sinks, logit softcapping) flex_attention on GPUs, else eager; packed rows the per-sample
    path cannot run (chunked attention shorter than a row, no SDPA) get one mask per layer type. Set
    flash_attention_2 where flash-attn is installed."""
    trust_remote_code: bool = False
    """Run Python code shipped with the model's repository. Off unless you trust its author."""
    train_vision: Literal["auto", "none", "projector", "all"] = "auto"
    """Vision-language models: what of the vision side trains. `none`: the vision tower and the projector stay frozen
    (the adapter, or full fine-tuning, on the language model only); `projector`: the projector into the language model
    trains in full as well; `all`: the vision tower too. `auto`: none with LoRA/QLoRA, projector with full
    fine-tuning; `ft plan` says which and why."""


# ---------------------------------------------------------------- data
DataFormat = Literal["chat", "instruction", "completion", "prompt_completion", "preference", "prompt_only", "unpaired"]


class DatasetSpec(Section):
    """One data source. Several sources are mixed."""

    path: FilePath
    """Local file (.jsonl, .json, .csv, .parquet, .txt), glob or folder, or a hub dataset id."""
    format: DataFormat
    """How records are read: chat (`messages` with role/content, or ShareGPT `conversations` with from/value),
    instruction (alpaca: instruction/input/output), completion (plain `text`), prompt_completion (`prompt`/`completion`
    text), preference (`prompt`/`chosen`/`rejected`, text or messages, and an optional number `margin` for
    reward models), prompt_only (`prompt` plus extra columns kept for reward functions), unpaired
    (`prompt`/`completion`, text or messages, and `label`: true for a desirable completion, false for an undesirable
    one; for KTO)."""
    subset: Text | None = None
    """Hub dataset configuration name (e.g. `main` for gsm8k)."""
    split: Text = "train"
    """Split to read."""
    revision: Text | None = None
    """Hub dataset revision; unset means the default branch."""
    columns: dict[str, str] = {}
    """Map ft's field names to this source's column names, e.g. {messages: conversations} or {prompt: question}."""
    weight: Bounded(float, gt=0, le=1000) = 1.0
    """Share of this source: 1 uses every record once, 0.5 a random half, 2 every record twice."""
    samples: Steps | None = None
    """Exact number of records to take from this source (a random subset, or repeats when larger); instead of weight."""
    system_prompt: str | None = None
    """System message added to conversations that have none."""


class ImageSection(Section):
    """How a vision-language model's processor sizes images (the images' tokens per sample follow from it)."""

    min_pixels: Bounded(int, ge=1, le=2**40) | None = None
    """Fewest pixels an image is resized to, for processors that resize by pixel count (Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
    GLM-4V...); unset: the processor's own."""
    max_pixels: Bounded(int, ge=1, le=2**40) | None = None
    """Most pixels an image is resized to (fewer image tokens, less memory), for the same processors; unset: the
    processor's own."""
    per_sample: Bounded(int, ge=1, le=4096) | None = None
    """Images in one training sequence (a sample, or a packed row) that the plan sizes memory, step time and seq_len
    for; unset: the most any prepared row holds where ft train has prepared the data, else 1."""
    processor: dict[str, Any] = {}
    """Other settings of the processor's image side, by its own names (e.g. `{size: {longest_edge: 1536}}` for
    SmolVLM/Idefics3, `{max_patches: 8}` where the processor has it); each must be one the processor takes."""


class DataSection(Section):
    """Training data and how it becomes token sequences."""

    datasets: Annotated[list[DatasetSpec], Field(min_length=1)]
    """Data sources, mixed by weight."""
    seq_len: Bounded(int, ge=16, le=2**24) = 2048
    """Maximum tokens per training sequence (packed row or padded sample)."""
    packing: bool = False
    """Pack several samples into each sequence; attention never crosses sample boundaries."""
    template: Annotated[str, checked_template] = "tokenizer"
    """Chat template: `tokenizer` (the tokenizer's own), a built-in (chatml, llama3, mistral, gemma, qwen, phi3, plain,
    alpaca: the instruction format's classic prompt) or a path to a Jinja file."""
    add_special_tokens: list[str] = []
    """Tokens to add to the tokenizer (the model's embeddings grow and are trained)."""
    train_on: Literal["assistant", "last_assistant", "all"] = "assistant"
    """Which tokens carry loss: every assistant turn with its end-of-turn token (default), only the last assistant turn,
    or all tokens (prompt included)."""
    overlong: Literal["truncate", "drop"] = "truncate"
    """What to do with a sample longer than seq_len: cut it, or leave it out (both are counted in the summary)."""
    validation: Bounded(float, ge=0, lt=1) | DatasetSpec = 0.0
    """Held-out evaluation data: a fraction of the training mix (0: none), or a dataset of its own."""
    seed: Seed = 42
    """Seed for shuffling, mixing and the validation split: the same config gives the same data."""
    num_proc: Bounded(int, ge=1, le=1024) = 1
    """Processes used to tokenize."""
    skip_bad_records: bool = False
    """Skip (and count) records that cannot be parsed or rendered instead of stopping at the first."""
    cache_dir: FilePath = "~/.cache/ft/data"
    """Where tokenized data is cached, under a fingerprint of everything that changes it."""
    image: ImageSection = ImageSection()
    """Image sizing for vision-language models (their processor's resolution rules)."""

    # the largest share of a prepared row's positions trained (never a job file's key): the planner is given it once
    # the data is prepared (ft train), and sizes the plain loss's logits by it (plan/transients.py)
    _trained_share: float | None = PrivateAttr(default=None)

    def trained_share(self) -> float | None:
        """The largest share of a prepared row's positions that are trained; None before the data is prepared."""
        return self._trained_share

    def with_trained_share(self, share: float | None) -> DataSection:
        """This section as planned for prepared rows of which at most `share` of a row's positions are trained (None:
        every position, as before the data is prepared)."""
        data = self.model_copy()
        data._trained_share = None if share is None else min(1.0, max(0.0, float(share)))
        return data


# ---------------------------------------------------------------- adapter, quantization
class AdapterSection(Section):
    """What is trained: all weights, or a LoRA adapter on frozen (optionally quantized) weights."""

    type: Literal["auto", "full", "lora", "qlora"] = "auto"
    """`full` trains every weight; `lora` trains low-rank adapters; `qlora` does so on a 4-bit base; `auto` picks LoRA,
    or QLoRA when LoRA does not fit."""
    r: Bounded(int, ge=1, le=2**16) = 16
    """LoRA rank."""
    alpha: Bounded(float, gt=0, le=2**20) = 32
    """LoRA scaling numerator (scale = alpha / r, or alpha / sqrt(r) with rslora)."""
    dropout: Bounded(float, ge=0, lt=1) = 0.05
    """Dropout on the adapter's input. On a CPU ft draws only the dropped positions (the same distribution; torch's
    dropout draws a number for every element), shown in `ft plan`."""
    target_modules: Literal["all-linear"] | Annotated[list[str], Field(min_length=1)] = "all-linear"
    """Modules that get an adapter: `all-linear` (every linear layer of the decoder, not the output head) or a list of
    names such as [q_proj, v_proj]."""
    modules_to_save: list[str] = []
    """Modules trained in full next to the adapter (e.g. [embed_tokens, lm_head] when tokens are added)."""
    dora: bool = False
    """Weight-decomposed LoRA (DoRA): adds a trained magnitude vector per module."""
    rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(r)."""


class QuantizationSection(Section):
    """Quantization of the frozen base weights (bitsandbytes)."""

    type: Literal["auto", "none", "nf4", "int8"] = "auto"
    """`nf4`: 4-bit NormalFloat (QLoRA); `int8`: LLM.int8(); `none`; `auto`: nf4 for QLoRA, none otherwise."""
    double_quant: bool = True
    """Quantize the 4-bit quantization constants too (saves about 0.4 bits per parameter)."""
    compute_dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Dtype of the matmuls on dequantized weights; `auto` follows the plan's precision."""


# ---------------------------------------------------------------- train
class TrainSection(Section):
    """Optimisation: batch, length of training, optimiser, precision."""

    global_batch_size: Bounded(int, ge=1, le=2**20) = 32
    """Sequences per optimiser step, over all devices. ft derives accumulation so this holds at any world size."""
    global_batch_tokens: Bounded(int, ge=1, le=2**27) | None = None
    """Alternative to global_batch_size: tokens per optimiser step (converted to sequences of seq_len)."""
    micro_batch_size: Auto | Bounded(int, ge=1, le=2**20) = AUTO
    """Sequences per device per forward pass; `auto` picks the largest that fits."""
    max_steps: Steps | None = None
    """Optimiser steps to train. Set this or epochs."""
    epochs: Bounded(float, gt=0, le=10_000) | None = None
    """Passes over the data (default 1 when max_steps is not set)."""
    lr: Auto | Bounded(float, gt=0, le=10) = AUTO
    """Peak learning rate; `auto` picks a common starting point for the method and adapter (SFT: 2e-4 with an adapter,
    2e-5 full; lower for DPO and GRPO), shown by `ft plan`."""
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    """Learning-rate schedule after warmup."""
    warmup_steps: NonNegSteps = 0
    """Linear warmup in steps (set this or warmup_ratio)."""
    warmup_ratio: Bounded(float, ge=0, lt=1) = 0.0
    """Linear warmup as a fraction of all steps."""
    optimizer: Literal["adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"] = (
        "adamw_torch"
    )
    """Optimiser; the 8-bit ones (bitsandbytes) keep 2 bytes of state per trained parameter instead of 8."""
    weight_decay: Bounded(float, ge=0, le=100) = 0.0
    """Decoupled weight decay."""
    max_grad_norm: Bounded(float, ge=0, le=1e6) = 1.0
    """Clip the global gradient norm to this value (0: no clipping)."""
    precision: Literal["auto", "bf16", "bf16-pure", "fp16", "fp32"] = "auto"
    """Compute precision; `auto`: bf16 where the accelerator supports it, fp16 on older GPUs, fp32 on CPU.
    `bf16-pure` keeps the trained weights, their gradients and the optimizer states in bf16 too (8 bytes per trained
    parameter instead of 18 for full fine-tuning); `auto` picks it only when mixed precision does not fit."""
    compensation: Literal["auto", "stochastic_rounding", "kahan", "none"] = "auto"
    """With bf16-pure: how updates smaller than bf16 can hold are kept. `stochastic_rounding` rounds each new weight up
    or down at random in proportion (no extra memory); `kahan` carries the rounding error in a bf16 buffer (2 bytes per
    trained parameter); `none` rounds to nearest (small updates are lost). `auto`: stochastic_rounding."""
    loss_implementation: Literal["auto", "plain", "chunked", "liger", "cut_cross_entropy"] = "auto"
    """How the output head and the cross-entropy are computed. `plain` materialises the whole logits tensor, its fp32
    copy and its gradient; `chunked` computes them a chunk of tokens at a time and recomputes each chunk in the backward
    pass (pure torch, any device); `liger` / `cut_cross_entropy` use those packages' fused GPU kernels. `auto`: a fused
    kernel on GPUs where one is installed, else chunked when the logits would be a large share of memory, else
    plain."""
    gradient_checkpointing: Auto | bool = AUTO
    """Recompute activations in the backward pass to save memory; `auto` turns it on only when needed to fit."""
    checkpoint_layers: Auto | Bounded(int, ge=0, le=100_000) = AUTO
    """Selective checkpointing: how many decoder layers recompute their activations (the others keep them). `auto`:
    every layer when gradient_checkpointing is true, the fewest that fit when it is auto."""
    activation_offload: Auto | bool = AUTO
    """Move the activations saved for the backward pass to host memory (pinned buffers, copied on a side stream) and
    back when needed. GPU only; `auto` turns it on only when nothing cheaper fits."""
    optimizer_in_backward: Auto | bool = AUTO
    """Update each parameter as soon as its gradient is complete and free that gradient, so that the whole model's
    gradients never exist at once. Needs one process, no gradient accumulation and max_grad_norm: 0; `auto` turns it
    on only when needed to fit."""
    compile: Auto | bool = AUTO
    """Compile each decoder layer with torch.compile (regional compilation: one layer is compiled and the others reuse
    it). Needs torch's code generator (Triton on GPUs, a C++ compiler on CPUs); not under DeepSpeed nor on a
    bitsandbytes 4/8-bit base. `auto` compiles where it is supported and the run (train.max_steps) is long enough to
    win back the minute or two compiling takes; `ft plan` says why."""
    router_aux_loss_coef: Auto | Bounded(float, ge=0, le=1000) = AUTO
    """Mixture-of-experts models: weight of the router's load-balancing loss, added to the training loss of every
    method and logged as aux_loss (expert use is logged as experts/*). `auto`: the model's own router_aux_loss_coef
    where transformers defines a load-balancing loss for its family, else off; 0 turns it off."""
    seed: Seed = 42
    """Seed for weights of new modules, dropout and data order."""


# ---------------------------------------------------------------- distributed
class DistributedSection(Section):
    """How the job spreads over devices and nodes."""

    backend: Literal["auto", "single", "ddp", "fsdp", "deepspeed"] = "auto"
    """`single` process, torch `ddp`, `fsdp` (FSDP2) or `deepspeed` ZeRO; `auto` picks the cheapest that fits."""
    sharding: Literal["auto", "none", "full_shard", "shard_grad_op", "hybrid_shard", "zero1", "zero2", "zero3"] = "auto"
    """What is sharded: FSDP `full_shard` / `shard_grad_op` / `hybrid_shard` (shard in a node, replicate across nodes),
    or DeepSpeed `zero1` / `zero2` / `zero3`."""
    offload: Literal["auto", "none", "optimizer", "all"] = "auto"
    """Move optimiser states (`optimizer`, DeepSpeed) or parameters, gradients and optimiser states (`all`) to host
    RAM."""
    nodes: Auto | Bounded(int, ge=1, le=65536) = AUTO
    """Nodes to use; `auto`: all the hardware has."""
    processes_per_node: Auto | Bounded(int, ge=1, le=1024) = AUTO
    """Processes per node; `auto`: one per GPU (one on a CPU-only machine)."""
    tensor_parallel: Auto | Bounded(int, ge=1, le=1024) = AUTO
    """Tensor-parallel degree: each decoder layer's attention and MLP weights are split over this many GPUs of one
    node, and FSDP2 shards over the rest (a 2-D mesh); `auto`: the planner's choice, 1 unless it pays."""
    context_parallel: Auto | Bounded(int, ge=1, le=1024) = AUTO
    """Context-parallel degree: each sequence is split over this many ranks, which exchange keys and values in a ring
    (long-context training); `auto`: the planner's choice, 1 unless one sequence's activations dominate."""
    expert_parallel: Auto | Bounded(int, ge=1, le=1024) = AUTO
    """Expert-parallel degree of a mixture-of-experts model: each MoE layer's routed experts are split over this many
    data-parallel ranks, which send each token to its experts' rank and back (all-to-all), and FSDP2 shards the rest;
    it must divide the ranks and the experts. `auto`: the planner's choice, on GPUs where it moves fewer bytes per step
    than FSDP2 gathering every expert."""
    timeout_minutes: Bounded(float, gt=0, le=10_080) = 30
    """Time a collective may wait before the job fails with a message naming the rank."""
    deepspeed_config: FilePath | None = None
    """Your own DeepSpeed JSON file, used as is instead of the one ft writes."""


# ---------------------------------------------------------------- output
class OutputSection(Section):
    """Where the run folder goes and how often it is written to."""

    dir: FilePath
    """Run folder: config, plan, metrics, checkpoints and the final model."""
    save_steps: NonNegSteps = 500
    """Save a checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: Bounded(int, ge=1, le=10_000) = 3
    """Keep the newest N checkpoints."""
    eval_steps: NonNegSteps = 0
    """Evaluate on the validation split every N steps (0: only at the end)."""
    log_steps: Steps = 10
    """Write metrics every N steps, and a progress line where the output is not a terminal (a log file, Slurm,
    Kubernetes), also after any step that ends 30 s or more after the last line."""
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = []
    """Experiment trackers to log to, besides metrics.jsonl."""
    run_name: Text | None = None
    """Name shown in trackers (default: the run folder's name)."""
    resume: Literal["never", "auto"] = "never"
    """`auto`: continue from the newest complete checkpoint in dir when there is one."""
    save_dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Dtype of a fully fine-tuned model's weights in final/: `auto` is the training precision (bf16 or fp16 under
    mixed precision: the fp32 master weights rounded once, at the end; fp32 where training ran in fp32). An adapter
    is saved as it was trained."""


# ---------------------------------------------------------------- evaluation
class EvaluationSection(Section):
    """A task metric measured by generating answers: before training, every `every_steps` steps, and at the end. `ft
    eval RUN` measures it again."""

    path: FilePath
    """Prompt/answer file (.jsonl, .json, .csv, .parquet): a conversation's last assistant message is its reference
    answer, else an `answer` column."""
    metric: Literal["exact_match", "contains", "regex", "function"] = "exact_match"
    """`exact_match`: the generated answer equals the reference (whitespace-trimmed); `contains`: it contains it;
    `regex`: what `pattern` extracts from the answer equals the reference; `function`: the mean of your `function`'s
    scores."""
    pattern: Annotated[str, checked_pattern] | None = None
    """For metric regex: the pattern that extracts the answer (its first group when it has groups, else the whole
    match), e.g. '####\\s*(-?\\d+)'. A reference it matches is extracted the same way."""
    function: FilePath | None = None
    """For metric function: `module:function` or `path/to/file.py:function`, called as fn(completions, **columns) with
    each input column as a list (and `reference`), returning one number per completion."""
    max_new_tokens: Tokens = 32
    """Longest answer generated (greedy decoding)."""
    samples: Steps | None = None
    """Evaluate on the first N records (unset: all)."""
    every_steps: NonNegSteps = 0
    """Also evaluate every N optimiser steps during training, logged to metrics.jsonl as eval_METRIC (0: only before
    training and at the end)."""


# ---------------------------------------------------------------- the job
class Config(Section):
    """An ft job: one file, one section per concern."""

    model: ModelSection
    """The model to fine-tune."""
    data: DataSection
    """Training data and its preparation."""
    method: Method = SFTMethod(name="sft")
    """Training method, chosen by `name` (each method's section lists its own options)."""
    adapter: AdapterSection = AdapterSection()
    """Full fine-tuning or a (Q)LoRA adapter."""
    quantization: QuantizationSection = QuantizationSection()
    """Quantization of the frozen base."""
    train: TrainSection = TrainSection()
    """Optimisation settings."""
    distributed: DistributedSection = DistributedSection()
    """Devices, nodes, backend and sharding."""
    output: OutputSection
    """Run folder and cadence of saving, evaluation and logging."""
    evaluation: EvaluationSection | None = None
    """Optional task evaluation by generation (e.g. exact-match accuracy), run before training and at the end."""

    # key path -> text as written, for values read from ${VAR}
    _env_references: dict = PrivateAttr(default_factory=dict)
    _env_variables: dict = PrivateAttr(default_factory=dict)  # variable -> value, for the ${VAR} that were read

    def env_references(self) -> dict[tuple, str]:
        """Key paths whose value took text from the environment, each with the text as written (`${HF_TOKEN}`)."""
        return dict(self._env_references)

    def env_variables(self) -> dict[str, str]:
        """The environment variables the file's `${VAR}` references read, with their values."""
        return dict(self._env_variables)
