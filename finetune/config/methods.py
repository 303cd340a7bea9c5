"""The `method:` sections. Each answers, besides its keys, what the checks and the planner need to know about its
method (class attributes and methods, never keys): a new method is its section here, added to `Method`, and its
module in finetune/methods/."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field

from finetune.config.section import FilePath, Section, Text, Tokens
from finetune.config.types import Bounded, checked_template
from finetune.errors import Problem


# ---------------------------------------------------------------- method
class MethodSection(Section):
    """Base of the method sections. Besides its keys, a method's section answers what the checks and the planner need
    to know about the method (class attributes and methods, never keys), so that a new method is its section here
    and its module in finetune/methods/, and nothing else."""

    formats: ClassVar[frozenset[str]] = frozenset()  # the data formats it trains on
    packing: ClassVar[bool] = False  # whether data.packing applies to it
    images: ClassVar[bool] = False  # it trains a vision-language model on chat records with images (finetune/vision.py)
    validates: ClassVar[bool] = True  # it has a validation loss (data.validation is evaluated)
    sequences_per_row: ClassVar[int] = 1  # sequences a dataset row puts through the model (DPO: chosen + rejected)
    learning_rates: ClassVar[tuple[float, float]] = (2e-5, 2e-4)  # lr: auto for (full fine-tuning, an adapter)
    head: ClassVar[str] = "lm"  # what the model ends in: lm (next-token logits) or score (one value per sequence)
    # its loss sums next-token NLL over tokens wherever they are: liger's fused loss and context parallelism serve it
    summed_loss: ClassVar[bool] = False
    # the metrics.jsonl keys that the progress line, the bar and loss.png show besides the loss (finetune/progress.py;
    # "prefix/*": every key under prefix/)
    progress_metrics: ClassVar[tuple[str, ...]] = ()

    def default_lr(self, full: bool) -> tuple[float, str]:
        """The peak learning rate `train.lr: auto` gives, and why."""
        lr = self.learning_rates[0] if full else self.learning_rates[1]
        return lr, f"common starting point for {self.name} with {'full fine-tuning' if full else 'an adapter'}"

    def reference_kind(self, adapter: str) -> str:
        """What the policy is compared with for this adapter type: none, adapter (the base with the adapter off),
        copy (a frozen copy) or precomputed (log-probs computed once before training)."""
        return "none"

    def generation_tokens(self, seq_len: int) -> int:
        """Tokens of each sequence the method samples during training (0: it samples none)."""
        return 0

    def completion_tokens(self) -> int:
        """Tokens of data.seq_len kept for the completions the method generates (0: it generates none)."""
        return 0

    def reward_specs(self) -> tuple[RewardSpec, ...]:
        """The rewards its samples are scored with (none: it samples none, or scores them otherwise)."""
        return ()

    def rows_per_step(self, global_batch: int) -> int:
        """Dataset rows one optimizer step consumes, for a global batch of `global_batch` sequences."""
        return global_batch

    def steps_per_batch(self) -> int:
        """Optimizer steps taken on each batch of rows (GRPO's num_iterations): the data stream deals a new batch every
        this many steps."""
        return 1

    def problems(self) -> list[Problem]:
        """Conflicts between this method's own keys."""
        return []

    def train_problems(self, train: Section) -> list[Problem]:
        """Conflicts between this method's keys and the train section."""
        return []

    def adapter_problems(self, adapter: Section) -> list[Problem]:
        """Conflicts between this method's keys and the adapter section."""
        return []


def _adapter_or_copy(adapter: str) -> str:
    return "copy" if adapter == "full" else "adapter"


PREFERENCE_METRICS = ("rewards/margin", "rewards/accuracy")  # what a preference method's implicit rewards show


class ReferenceMethod(MethodSection):
    """Base of the methods whose `reference` key (auto, adapter_disabled, copy, precomputed) chooses the reference
    model: DPO and KTO."""

    def reference_kind(self, adapter: str) -> str:
        if self.reference == "auto":
            return _adapter_or_copy(adapter)
        return "adapter" if self.reference == "adapter_disabled" else self.reference

    def adapter_problems(self, adapter: Section) -> list[Problem]:
        if self.reference != "adapter_disabled" or adapter.type != "full":
            return []
        return [
            Problem(
                (("method", "reference"), ("adapter", "type")),
                "full fine-tuning has no adapter to disable for the reference model",
                "set method.reference: copy (or auto), or adapter.type: lora",
            )
        ]


class SFTMethod(MethodSection):
    """Supervised fine-tuning: next-token loss on the trained tokens."""

    formats: ClassVar[frozenset[str]] = frozenset({"chat", "instruction", "completion", "prompt_completion"})
    packing: ClassVar[bool] = True
    images: ClassVar[bool] = True
    summed_loss: ClassVar[bool] = True

    name: Literal["sft"]
    """Method name."""


class DPOMethod(ReferenceMethod):
    """Direct preference optimisation on prompt/chosen/rejected pairs."""

    formats: ClassVar[frozenset[str]] = frozenset({"preference"})
    sequences_per_row: ClassVar[int] = 2
    learning_rates: ClassVar[tuple[float, float]] = (5e-7, 5e-6)
    progress_metrics: ClassVar[tuple[str, ...]] = PREFERENCE_METRICS
    images: ClassVar[bool] = True  # pairs whose prompt holds images

    name: Literal["dpo"]
    """Method name."""
    beta: Bounded(float, gt=0, le=100) = 0.1
    """Strength of the implicit KL constraint to the reference model."""
    loss: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    """DPO loss variant."""
    label_smoothing: Bounded(float, ge=0, lt=0.5) = 0.0
    """Assumed label noise (conservative DPO); sigmoid loss only."""
    reference: Literal["auto", "adapter_disabled", "copy", "precomputed"] = "auto"
    """Reference model: `auto` uses the base with the adapter disabled for LoRA/QLoRA and a frozen copy for full
    fine-tuning; `precomputed` computes reference log-probs once before training."""

    def problems(self) -> list[Problem]:
        if not self.label_smoothing or self.loss == "sigmoid":
            return []
        return [
            Problem(
                (("method", "label_smoothing"), ("method", "loss")),
                f"label smoothing applies to the sigmoid loss, not {self.loss}",
                "remove label_smoothing or set loss: sigmoid",
            )
        ]


class RewardSpec(Section):
    """One reward for GRPO: a function, or a trained reward model (give exactly one of `function` and `model`)."""

    function: FilePath | None = None
    """Built-in (`exact_match`, `regex`, `length_penalty`) or user function as `module:function` or
    `path/to/file.py:function`."""
    model: FilePath | None = None
    """A trained reward model: a folder (what `method: {name: reward}` writes to RUN/final) or hub id that transformers
    loads as AutoModelForSequenceClassification with one output (num_labels 1, pad_token_id set, its tokenizer saved
    with it). Each completion is scored as the prompt conversation plus the completion as the assistant's reply, in the
    reward model's own tokenizer and chat template (`template`), keeping the last data.seq_len tokens; the reward is
    the model's single logit. Loaded once per process on its training device, frozen, in the plan's precision."""
    weight: Bounded(float, ge=-1e6, le=1e6) = 1.0
    """Weight of this reward in the sum."""
    args: dict[str, Any] = {}
    """Keyword arguments passed to the function (e.g. {column: answer} or {pattern: '...'})."""
    batch_size: Bounded(int, ge=1, le=4096) = 16
    """With `model`: completions scored per forward pass of the reward model."""
    revision: Text = "main"
    """With `model`: hub revision (branch, tag or commit) of the reward model; ignored for local folders."""
    template: Annotated[str, checked_template] = "tokenizer"
    """With `model`: the chat template the reward model was trained with, as in data.template: `tokenizer` (its
    tokenizer's own), a built-in or a path to a Jinja file."""
    trust_remote_code: bool = False
    """With `model`: run Python code shipped with the reward model's repository. Off unless you trust its author."""

    def problems(self, index: int) -> list[Problem]:
        """Exactly one of function and model, and the keys of the other kind left out."""
        key = ("method", "rewards", index)
        if (self.function is None) == (self.model is None):
            given = "both `function` and `model` are" if self.model is not None else "neither `function` nor `model` is"
            return [
                Problem(
                    (key,),
                    f"{given} given; a reward is either a function or a trained reward model",
                    "give exactly one: function: exact_match (or module:function), or model: runs/rm/final",
                )
            ]
        if self.model is not None and self.args:
            return [
                Problem(
                    (key + ("args",), key + ("model",)),
                    "args are passed to reward functions, not to a reward model",
                    f"remove method.rewards[{index}].args",
                )
            ]
        if self.model is not None:
            return []
        only_model = [k for k in ("batch_size", "revision", "template", "trust_remote_code") if self.explicit(k)]
        return [
            Problem(
                (key + (k,), key + ("function",)),
                f"{k} applies to a reward model (`model`), not to a reward function",
                f"remove method.rewards[{index}].{k}",
            )
            for k in only_model
        ]


class RolloutSection(Section):
    """Where a vLLM rollout engine runs and how it receives the trainer's weights."""

    placement: Literal["auto", "colocated", "server", "ray"] = "auto"
    """`colocated`: a vLLM engine inside each training process, sharing its GPU (its memory share planned, asleep
    during the backward pass on GPUs); `server`: vLLM's own server (`vllm serve`) on a separate pool of GPUs (on CPU,
    one more process), started by ft train or given by `url`; the trainer sends it prompts through its OpenAI API and
    weights through its weight-transfer routes; `ray`: the trainer's ranks and vLLM's servers as actors of a Ray
    cluster (`ray_address`), in one placement group that pins each to the node the plan gives it (a node of its own
    for the engines across nodes; needs `pip install 'finetune[ray]'`); `auto`: the planner chooses (see `ft plan`)."""
    gpus: Literal["auto"] | Bounded(int, ge=1, le=100_000) = "auto"
    """GPUs of the server pool (placement: server), taken from the job's GPUs; `auto`: the planner chooses."""
    tensor_parallel: Literal["auto"] | Bounded(int, ge=1, le=64) = "auto"
    """GPUs each vLLM engine splits the model over; `auto`: the fewest that hold the weights and the KV cache."""
    memory_share: Literal["auto"] | Bounded(float, gt=0, lt=1) = "auto"
    """Share of each GPU's memory given to vLLM (its gpu_memory_utilization); `auto`: what the plan computes."""
    sync_every: Bounded(int, ge=1, le=100_000) = 1
    """Send the trainer's weights to the engine every this many optimizer steps."""
    asynchronous: bool = False
    """Generate the next rollouts while the current one trains (off-policy by up to `max_staleness` rollouts; the lag
    is logged as `rollout_lag`). Needs `engine: vllm`."""
    max_staleness: Bounded(int, ge=1, le=64) = 1
    """With `asynchronous`: rollouts generated ahead while the trainer steps. A rollout trains at most this many
    rollouts (× num_iterations optimizer steps) after the weights that generated it; a rollout server keeps
    generating across weight updates (vLLM's pause mode `keep`)."""
    url: str | list[str] | None = None
    """A vLLM server already running (http://host:port; `ft rollout-server JOB` starts one with the job's settings),
    e.g. on other nodes, or a list of them (data-parallel engines: each rank's prompts are shared out evenly); ft then
    starts none. The server reads the adapters and weights the trainer writes into the run folder (a shared file
    system across nodes)."""
    command: str | None = None
    """How ft starts vLLM's OpenAI-compatible server, e.g. `vllm serve` or `/opt/vllm/bin/python -m
    vllm.entrypoints.openai.api_server` (vLLM in another environment); ft appends the model and the job's flags. null:
    this environment's vLLM where it is installed, else `vllm serve` from PATH."""
    timeout_s: Bounded(float, gt=0, le=86_400) = 600
    """Seconds the trainer waits for one answer of a rollout server (a completion, a weight update) before ending the
    job with the server's address (`ft train --resume` continues)."""
    kv_cache_gib: Bounded(float, gt=0, le=100_000) | None = None
    """KV cache for a vLLM engine on CPU, in GiB (GPUs size it from memory_share); null: 1 GiB."""
    ray_address: str | None = None
    """The Ray cluster of `placement: ray` (`ray start --head` prints it, e.g. 10.0.0.1:6379); null: the
    `RAY_ADDRESS` environment variable, else the cluster this machine belongs to (`auto`)."""


class GRPOMethod(MethodSection):
    """Group relative policy optimisation: sample several completions per prompt, score them, push up the better
    ones."""

    formats: ClassVar[frozenset[str]] = frozenset({"prompt_only"})
    validates: ClassVar[bool] = False  # no validation loss: the reward on held-out prompts is the measure (ft eval)
    learning_rates: ClassVar[tuple[float, float]] = (1e-6, 1e-5)
    progress_metrics: ClassVar[tuple[str, ...]] = ("reward", "rewards/*", "kl", "completion_length")

    name: Literal["grpo"]
    """Method name."""
    rewards: Annotated[list[RewardSpec], Field(min_length=1)]
    """Rewards (functions, or trained reward models), summed with their weights."""
    num_generations: Bounded(int, ge=2, le=1024) = 8
    """Completions sampled per prompt (the group)."""
    max_new_tokens: Tokens = 256
    """Longest completion generated."""
    temperature: Bounded(float, gt=0, le=100) = 1.0
    """Sampling temperature."""
    top_p: Bounded(float, gt=0, le=1) = 1.0
    """Nucleus sampling threshold."""
    kl_coef: Bounded(float, ge=0, le=1000) = 0.0
    """Weight of the KL penalty to the reference model (0: no reference model is needed)."""
    clip_eps: Bounded(float, gt=0, le=100) = 0.2
    """PPO-style ratio clipping."""
    loss_normalization: Literal["sequence", "token", "dr_grpo"] = "sequence"
    """`sequence`: mean over each completion, then over the group (GRPO paper); `token`: mean over all tokens (DAPO);
    `dr_grpo`: sum over tokens divided by a constant (Dr. GRPO)."""
    engine: Literal["auto", "transformers", "vllm"] = "auto"
    """Rollout engine: `vllm` samples with vLLM (colocated in each training process or on a separate pool, see
    `rollout`) and receives the trainer's weights after each update; `transformers` samples with `generate` on the
    training model; `auto` is vLLM on GPUs where it is installed, transformers otherwise."""
    num_iterations: Bounded(int, ge=1, le=64) = 1
    """Optimizer steps taken on each rollout (PPO/GRPO's μ): the rollout's policy is the old policy of the ratio, so
    `clip_eps` acts from the second step on."""
    importance_sampling_cap: Bounded(float, ge=1, le=1e6) | None = 2.0
    """Truncated importance sampling between the rollout engine and the trainer: each completion token's loss is
    weighted by min(π_trainer/π_engine, cap), which corrects for the engine's numerics (and, with async rollouts, its
    older weights). null: no correction. Has an effect only when an engine other than the training model samples."""
    rollout: RolloutSection = RolloutSection()
    """Where and how a vLLM engine samples (ignored with `engine: transformers`)."""

    def reference_kind(self, adapter: str) -> str:
        return "none" if self.kl_coef == 0 else _adapter_or_copy(adapter)

    def generation_tokens(self, seq_len: int) -> int:
        return seq_len  # prompt and completion together stay within data.seq_len

    def completion_tokens(self) -> int:
        return self.max_new_tokens

    def reward_specs(self) -> tuple[RewardSpec, ...]:
        return tuple(self.rewards)

    def rows_per_step(self, global_batch: int) -> int:
        return global_batch // self.num_generations  # the batch counts completions; a row is a prompt

    def steps_per_batch(self) -> int:
        return self.num_iterations

    def problems(self) -> list[Problem]:
        found = [p for i, reward in enumerate(self.rewards) for p in reward.problems(i)]
        if self.rollout.asynchronous and self.engine == "transformers":
            found.append(
                Problem(
                    (("method", "rollout", "asynchronous"), ("method", "engine")),
                    "asynchronous rollouts need a separate rollout engine: transformers samples with the training "
                    "model itself, which cannot generate while it trains",
                    "set method.engine: vllm, or method.rollout.asynchronous: false",
                )
            )
        if self.rollout.max_staleness > 1 and not self.rollout.asynchronous:
            found.append(
                Problem(
                    (("method", "rollout", "max_staleness"), ("method", "rollout", "asynchronous")),
                    f"max_staleness: {self.rollout.max_staleness} generates rollouts ahead, which only asynchronous "
                    "rollouts do",
                    "set method.rollout.asynchronous: true, or remove method.rollout.max_staleness",
                )
            )
        if self.rollout.url is not None and self.rollout.placement == "colocated":
            found.append(
                Problem(
                    (("method", "rollout", "url"), ("method", "rollout", "placement")),
                    "a rollout server URL was given with placement colocated",
                    "remove method.rollout.url, or set method.rollout.placement: server (or auto)",
                )
            )
        found += self._ray_problems()
        urls = [self.rollout.url] if isinstance(self.rollout.url, str) else self.rollout.url or []
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if bad or (self.rollout.url is not None and not urls):
            found.append(
                Problem(
                    (("method", "rollout", "url"),),
                    f"{bad[0]!r} is not an http(s) URL" if bad else "an empty list of servers",
                    "give the address of a running vLLM server (ft rollout-server prints it), e.g. http://node7:8420",
                )
            )
        return found

    def _ray_problems(self) -> list[Problem]:
        r, placement = self.rollout, ("method", "rollout", "placement")
        if r.placement != "ray":
            return []
        found = []
        if self.engine == "transformers":
            found.append(
                Problem(
                    (placement, ("method", "engine")),
                    "placement: ray runs vLLM's servers as Ray actors, but method.engine: transformers samples with "
                    "the training model itself",
                    "set method.engine: vllm, or method.rollout.placement: auto",
                )
            )
        if r.url is not None:
            found.append(
                Problem(
                    (("method", "rollout", "url"), placement),
                    "placement: ray starts its own vLLM servers on the Ray cluster, but a server URL was given",
                    "remove method.rollout.url, or set method.rollout.placement: server",
                )
            )
        return found

    def train_problems(self, train: Section) -> list[Problem]:
        if train.global_batch_tokens is not None or train.global_batch_size % self.num_generations == 0:
            return []
        n, batch = self.num_generations, train.global_batch_size
        return [
            Problem(
                (("train", "global_batch_size"), ("method", "num_generations")),
                f"a GRPO batch holds whole groups: {batch} completions is not a multiple of {n} generations per prompt",
                f"set train.global_batch_size to a multiple of {n}, e.g. {n * max(1, batch // n)}",
            )
        ]


class KTOMethod(ReferenceMethod):
    """Kahneman-Tversky optimisation on unpaired feedback: each row is one completion labelled desirable or not."""

    formats: ClassVar[frozenset[str]] = frozenset({"unpaired"})
    learning_rates: ClassVar[tuple[float, float]] = (5e-7, 5e-6)
    progress_metrics: ClassVar[tuple[str, ...]] = PREFERENCE_METRICS
    images: ClassVar[bool] = True  # rows whose prompt holds images

    name: Literal["kto"]
    """Method name."""
    beta: Bounded(float, gt=0, le=100) = 0.1
    """Strength of the implicit KL constraint to the reference model."""
    desirable_weight: Bounded(float, gt=0, le=1000) = 1.0
    """Weight of the loss of desirable completions (`label: true`); raise it when they are the fewer."""
    undesirable_weight: Bounded(float, gt=0, le=1000) = 1.0
    """Weight of the loss of undesirable completions (`label: false`); the KTO paper keeps
    desirable_weight × desirable rows / (undesirable_weight × undesirable rows) between 1 and 4/3."""
    reference: Literal["auto", "adapter_disabled", "copy", "precomputed"] = "auto"
    """Reference model: `auto` uses the base with the adapter disabled for LoRA/QLoRA and a frozen copy for full
    fine-tuning; `precomputed` computes reference log-probs once before training. The KL baseline pairs each prompt
    with another row's completion: the previous row's in the same micro-batch, or with `precomputed` (whose pairs
    must be known ahead) the previous row's of the prepared dataset, which also allows micro-batches of 1 row."""

    def train_problems(self, train: Section) -> list[Problem]:
        if self.reference == "precomputed" or train.micro_batch_size == "auto" or train.micro_batch_size > 1:
            return []
        return [
            Problem(
                (("train", "micro_batch_size"), ("method", "name")),
                "KTO estimates its KL baseline from each prompt paired with another row's completion of the same "
                "micro-batch, so a micro-batch of 1 row has no other completion",
                "set train.micro_batch_size to 2 or more (or auto), or method.reference: precomputed",
            )
        ]


class ORPOMethod(MethodSection):
    """Odds ratio preference optimisation on prompt/chosen/rejected pairs: the SFT loss on the chosen answer plus an
    odds-ratio term that favours it over the rejected one. Reference-free: no reference model."""

    model_config = ConfigDict(serialize_by_alias=True)  # the key `lambda` is a Python keyword: the field is lambda_
    formats: ClassVar[frozenset[str]] = frozenset({"preference"})
    sequences_per_row: ClassVar[int] = 2
    learning_rates: ClassVar[tuple[float, float]] = (8e-6, 8e-5)
    progress_metrics: ClassVar[tuple[str, ...]] = PREFERENCE_METRICS
    images: ClassVar[bool] = True  # pairs whose prompt holds images

    name: Literal["orpo"]
    """Method name."""
    lambda_: Bounded(float, ge=0, le=100) = Field(0.1, alias="lambda")
    """Weight of the odds-ratio term added to the chosen answer's NLL (the ORPO paper's λ; trl's `beta`)."""


class SimPOMethod(MethodSection):
    """Simple preference optimisation on prompt/chosen/rejected pairs: a margin between the length-normalised
    log-probabilities of the chosen and rejected answers. Reference-free: no reference model."""

    formats: ClassVar[frozenset[str]] = frozenset({"preference"})
    sequences_per_row: ClassVar[int] = 2
    learning_rates: ClassVar[tuple[float, float]] = (5e-7, 5e-6)
    progress_metrics: ClassVar[tuple[str, ...]] = PREFERENCE_METRICS
    images: ClassVar[bool] = True  # pairs whose prompt holds images

    name: Literal["simpo"]
    """Method name."""
    beta: Bounded(float, gt=0, le=100) = 2.0
    """Scale of the reward, β times an answer's mean token log-probability (the SimPO paper uses 2 to 2.5)."""
    gamma: Bounded(float, ge=0, le=100) = 1.0
    """Target reward margin γ between chosen and rejected (the paper keeps γ/β near 0.5; trl's `simpo_gamma`)."""
    label_smoothing: Bounded(float, ge=0, lt=0.5) = 0.0
    """Assumed label noise: the loss mixes in, with this weight, the loss of the swapped pair."""


class RewardMethod(MethodSection):
    """Reward-model training on prompt/chosen/rejected pairs: a sequence-classification head scores each whole sequence
    and the Bradley–Terry loss pushes the chosen answer's score above the rejected one's. The run's final/ folder is a
    model transformers loads as AutoModelForSequenceClassification (merged when trained with an adapter), which GRPO
    takes as a reward (`rewards: [{model: RUN/final}]`)."""

    formats: ClassVar[frozenset[str]] = frozenset({"preference"})
    sequences_per_row: ClassVar[int] = 2
    learning_rates: ClassVar[tuple[float, float]] = (1e-5, 1e-4)
    head: ClassVar[str] = "score"
    progress_metrics: ClassVar[tuple[str, ...]] = PREFERENCE_METRICS

    name: Literal["reward"]
    """Method name."""
    margin: bool = False
    """Use each pair's `margin` (a number in the data: how much better chosen is than rejected) in the loss,
    −log σ(r_chosen − r_rejected − margin), as Llama 2's reward models do. Every row must then have a margin."""
    center_rewards: Bounded(float, ge=0, le=100) = 0.0
    """Weight of a penalty on the squared sum of each pair's rewards, which keeps rewards centred on 0 (trl's
    center_rewards_coefficient; 0.01 is common)."""


Method = Annotated[
    SFTMethod | DPOMethod | GRPOMethod | KTOMethod | ORPOMethod | SimPOMethod | RewardMethod,
    Field(discriminator="name"),
]
