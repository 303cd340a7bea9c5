"""Rules between keys: choices that contradict each other, or keys that would silently do nothing.

Each rule sees only the sections it needs and returns Problems naming every key involved. All rules
run, so a file with several conflicts gets them all in one message. Rules that depend on the hardware
(does it fit? is bf16 supported?) belong to the planner, not here.
"""

from __future__ import annotations

from collections.abc import Callable

from finetune.config.schema import Config
from finetune.errors import Problem

Rule = Callable[[Config], list[Problem]]
RULES: list[tuple[frozenset[str], Rule]] = []


def rule(*sections: str) -> Callable[[Rule], Rule]:
    """Register a rule that reads only these top-level sections."""

    def register(fn: Rule) -> Rule:
        RULES.append((frozenset(sections), fn))
        return fn

    return register


def check(config: Config, valid: set[str] | None = None) -> list[Problem]:
    """Run every rule whose sections are all in `valid` (default: all); return all problems found.

    When some sections failed validation, the loader passes a config built from the sections that
    passed, so conflicts elsewhere are still reported in the same run.
    """
    return [p for sections, fn in RULES if valid is None or sections <= valid for p in fn(config)]


@rule("adapter", "quantization")
def adapter_vs_quantization(c: Config) -> list[Problem]:
    a, q = c.adapter, c.quantization
    keys = (("quantization", "type"), ("adapter", "type"))
    if a.type == "full" and q.type in ("nf4", "int8"):
        return [
            Problem(
                keys,
                f"full fine-tuning cannot train {q.type}-quantized weights",
                "set adapter.type: qlora (nf4) or lora (int8), or quantization.type: none",
            )
        ]
    if a.type == "qlora" and q.type in ("none", "int8"):
        return [
            Problem(
                keys,
                f"qlora trains an adapter on a 4-bit nf4 base, but quantization.type is {q.type}",
                "set quantization.type: nf4 (or auto), or adapter.type: lora",
            )
        ]
    return []


@rule("adapter")
def lora_options_need_lora(c: Config) -> list[Problem]:
    a = c.adapter
    if a.type != "full":
        return []
    return [
        Problem(
            (("adapter", k), ("adapter", "type")),
            "this LoRA option has no effect with full fine-tuning",
            f"remove adapter.{k}, or set adapter.type: lora",
        )
        for k in ("r", "alpha", "dropout", "target_modules", "modules_to_save", "dora", "rslora")
        if a.explicit(k)
    ]


@rule("quantization")
def quantization_options_need_quantization(c: Config) -> list[Problem]:
    q = c.quantization
    if q.type != "none":
        return []
    return [
        Problem(
            (("quantization", k), ("quantization", "type")),
            "has no effect without quantization",
            f"remove quantization.{k}, or set quantization.type: nf4",
        )
        for k in ("double_quant", "compute_dtype")
        if q.explicit(k)
    ]


@rule("train")
def one_batch_size(c: Config) -> list[Problem]:
    t = c.train
    if t.global_batch_tokens is not None and t.explicit("global_batch_size"):
        return [
            Problem(
                (("train", "global_batch_size"), ("train", "global_batch_tokens")),
                "both set the global batch",
                "keep one: sequences (global_batch_size) or tokens (global_batch_tokens)",
            )
        ]
    return []


@rule("train")
def one_duration(c: Config) -> list[Problem]:
    t = c.train
    out = []
    if t.max_steps is not None and t.epochs is not None:
        out.append(
            Problem((("train", "max_steps"), ("train", "epochs")), "both set how long to train", "keep one of them")
        )
    if t.warmup_steps and t.warmup_ratio:
        out.append(
            Problem((("train", "warmup_steps"), ("train", "warmup_ratio")), "both set the warmup", "keep one of them")
        )
    return out


_FSDP = {"full_shard", "shard_grad_op", "hybrid_shard"}
_ZERO = {"zero1", "zero2", "zero3"}


@rule("distributed")
def backend_vs_sharding(c: Config) -> list[Problem]:
    d = c.distributed
    keys = (("distributed", "sharding"), ("distributed", "backend"))
    allowed = {"fsdp": _FSDP, "deepspeed": _ZERO, "ddp": {"none"}, "single": {"none"}}.get(d.backend)
    if allowed is None or d.sharding in allowed or d.sharding == "auto":
        return []
    owner = "fsdp" if d.sharding in _FSDP else "deepspeed" if d.sharding in _ZERO else "ddp"
    return [
        Problem(
            keys,
            f"{d.sharding} is a sharding of the {owner} backend, not of {d.backend}",
            f"set distributed.backend: {owner}, or distributed.sharding to one of {', '.join(sorted(allowed))} "
            "(or auto)",
        )
    ]


@rule("distributed")
def offload_needs_sharding_backend(c: Config) -> list[Problem]:
    d = c.distributed
    keys = (("distributed", "offload"), ("distributed", "backend"))
    if d.offload in ("auto", "none"):
        return []
    if d.backend in ("single", "ddp"):
        return [
            Problem(
                keys,
                f"offloading to host RAM needs fsdp or deepspeed, not {d.backend}",
                "set distributed.backend: fsdp (offload: all) or deepspeed, or offload: none",
            )
        ]
    if d.backend == "fsdp" and d.offload == "optimizer":
        return [
            Problem(
                keys,
                "FSDP offloads parameters, gradients and optimiser states together",
                "set distributed.offload: all, or distributed.backend: deepspeed to offload only the optimiser",
            )
        ]
    return []


BNB_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit")


@rule("train", "distributed")
def bitsandbytes_optimizer_not_under_fsdp(c: Config) -> list[Problem]:
    if c.train.optimizer not in BNB_OPTIMIZERS or c.distributed.backend != "fsdp":
        return []
    return [
        Problem(
            (("train", "optimizer"), ("distributed", "backend")),
            f"{c.train.optimizer} is a bitsandbytes optimizer; it updates plain tensors and cannot step FSDP2's "
            "sharded (DTensor) parameters",
            "set train.optimizer: adamw_torch (or adamw_torch_fused), or distributed.backend: deepspeed, ddp or auto",
        )
    ]


@rule("distributed")
def single_is_one_process(c: Config) -> list[Problem]:
    d = c.distributed
    if d.backend != "single":
        return []
    return [
        Problem(
            (("distributed", k), ("distributed", "backend")),
            "backend single runs one process",
            f"remove distributed.{k}, or choose backend ddp, fsdp or deepspeed",
        )
        for k in ("nodes", "processes_per_node")
        if getattr(d, k) not in ("auto", 1)
    ]


@rule("distributed")
def deepspeed_config_needs_deepspeed(c: Config) -> list[Problem]:
    d = c.distributed
    if d.deepspeed_config is not None and d.backend != "deepspeed":
        return [
            Problem(
                (("distributed", "deepspeed_config"), ("distributed", "backend")),
                f"a DeepSpeed JSON is only used by the deepspeed backend (backend is {d.backend})",
                "set distributed.backend: deepspeed, or remove deepspeed_config",
            )
        ]
    return []


@rule("data", "method")
def data_fits_method(c: Config) -> list[Problem]:
    allowed = c.method.formats
    out = [
        Problem(
            (("data", "datasets", i, "format"), ("method", "name")),
            f"{c.method.name} cannot train on {ds.format} data",
            f"use a dataset of format {' or '.join(sorted(allowed))}, or another method",
        )
        for i, ds in enumerate(c.data.datasets)
        if ds.format not in allowed
    ]
    if c.data.packing and not c.method.packing:
        out.append(
            Problem(
                (("data", "packing"), ("method", "name")),
                f"{c.method.name} trains on one sample per sequence: it does not pack samples",
                "set data.packing: false",
            )
        )
    return out


FIELDS = {
    "chat": {"messages", "system"},
    "instruction": {"instruction", "input", "output", "system"},
    "completion": {"text"},
    "prompt_completion": {"prompt", "completion"},
    "preference": {"prompt", "chosen", "rejected", "system", "margin"},
    "prompt_only": {"prompt", "system"},
    "unpaired": {"prompt", "completion", "label", "system"},
}


@rule("data")
def dataset_options(c: Config) -> list[Problem]:
    out = []
    specs = list(enumerate(c.data.datasets))
    for i, ds in specs:
        here = ("data", "datasets", i)
        for field in ds.columns:
            if field not in FIELDS[ds.format]:
                out.append(
                    Problem(
                        (here + ("columns", field), here + ("format",)),
                        f"{ds.format} data has no field {field!r}",
                        f"map one of: {', '.join(sorted(FIELDS[ds.format]))}",
                    )
                )
        if ds.samples is not None and ds.explicit("weight"):
            out.append(
                Problem(
                    (here + ("samples",), here + ("weight",)),
                    "both set how much of this source to use",
                    "keep one: weight (a share) or samples (a count)",
                )
            )
    return out


@rule("method")
def method_options(c: Config) -> list[Problem]:
    return c.method.problems()


@rule("train", "method")
def method_vs_train(c: Config) -> list[Problem]:
    return c.method.train_problems(c.train)


@rule("method", "adapter")
def method_vs_adapter(c: Config) -> list[Problem]:
    return c.method.adapter_problems(c.adapter)


@rule("train", "quantization")
def precision_vs_compute_dtype(c: Config) -> list[Problem]:
    p, q = c.train.precision, c.quantization.compute_dtype
    p = "bf16" if p == "bf16-pure" else p
    if "auto" in (p, q) or p == q or p == "fp32":
        return []
    return [
        Problem(
            (("quantization", "compute_dtype"), ("train", "precision")),
            f"computing in {q} while training in {p} mixes two half-precision formats",
            f"set quantization.compute_dtype: {p} (or auto)",
        )
    ]


@rule("train", "distributed")
def memory_saver_options(c: Config) -> list[Problem]:
    t, d, out = c.train, c.distributed, []
    if t.compensation != "auto" and t.precision != "bf16-pure":
        out.append(
            Problem(
                (("train", "compensation"), ("train", "precision")),
                f"compensation {t.compensation} applies to bf16-pure weights only, so it has no effect with precision "
                f"{t.precision}",
                "remove train.compensation, or set train.precision: bf16-pure",
            )
        )
    if t.precision == "bf16-pure" and d.backend == "deepspeed":
        out.append(
            Problem(
                (("train", "precision"), ("distributed", "backend")),
                "DeepSpeed's bf16 mode always keeps fp32 master weights, so bf16-pure cannot be honoured",
                "set train.precision: bf16 with deepspeed, or distributed.backend: fsdp / auto for bf16-pure",
            )
        )
    if t.optimizer_in_backward is True and t.max_grad_norm > 0:
        out.append(
            Problem(
                (("train", "optimizer_in_backward"), ("train", "max_grad_norm")),
                "with the optimizer step in backward each parameter is updated before the others' gradients exist: "
                "there is no global gradient norm to clip",
                "set train.max_grad_norm: 0, or optimizer_in_backward: auto",
            )
        )
    if t.gradient_checkpointing is False and t.checkpoint_layers not in ("auto", 0):
        out.append(
            Problem(
                (("train", "checkpoint_layers"), ("train", "gradient_checkpointing")),
                f"checkpoint_layers {t.checkpoint_layers} asks for checkpointing that gradient_checkpointing: false "
                "turns off",
                "remove one of the two (checkpoint_layers alone turns checkpointing on for that many layers)",
            )
        )
    return out


@rule("evaluation")
def evaluation_metric_options(c: Config) -> list[Problem]:
    e = c.evaluation
    if e is None:
        return []
    out = []
    for key, metric in (("pattern", "regex"), ("function", "function")):
        keys = (("evaluation", key), ("evaluation", "metric"))
        if e.metric == metric and getattr(e, key) is None:
            example = "'####\\s*(-?\\d+)'" if key == "pattern" else "my_metrics.py:score"
            out.append(
                Problem(keys, f"metric {metric} needs evaluation.{key}", f"set evaluation.{key}, e.g. {example}")
            )
        elif e.metric != metric and getattr(e, key) is not None:
            out.append(
                Problem(
                    keys,
                    f"evaluation.{key} is used by metric {metric} only, so it has no effect with {e.metric}",
                    f"remove evaluation.{key}, or set evaluation.metric: {metric}",
                )
            )
    return out
