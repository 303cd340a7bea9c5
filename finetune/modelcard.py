"""README.md of a run's final model or adapter: what was trained, on what, how, and how to use it."""

from __future__ import annotations

import json
import math
from typing import Any

from finetune.redaction import is_config, redact, redact_config


def model_card(run: dict) -> str:
    """README.md for the final model, from {"config", "plan", "data", "metrics", "artifact"} (all optional),
    plus optional "name" (title), "run_dir" (for `ft merge-lora`) and "path" (where the weights are).
    "artifact" is "adapter", "model", "reward model", "merged model" (an adapter merged into its base: `ft push
    --merged`) or "gguf" (`ft push --gguf`). For a card on the hub (`ft push`), "hub_base" is the base model's hub id
    for the front matter (None: the base is no hub model, and the front matter names none), "license" the base's
    license and "datasets" the hub ids of the training data.

    "config" is best the job's `Config` itself: then the text its secret `${VAR}` references read from the
    environment is shown as the reference everywhere in the card, not only in the config (other values from the
    environment are shown as they were: the card records what the run was trained on).
    """
    job = run.get("config")
    run = redact(
        {**run, "config": redact_config(job)} if is_config(job) else run, config=job if is_config(job) else None
    )
    cfg, plan, data, metrics = (run.get(k) or {} for k in ("config", "plan", "data", "metrics"))
    base = (cfg.get("model") or {}).get("name") or plan.get("model") or "(base model not recorded)"
    adapter = {**(cfg.get("adapter") or {})}
    adapter["type"] = plan.get("adapter") or adapter.get("type") or "lora"
    artifact = run.get("artifact") or ("model" if adapter["type"] == "full" else "adapter")
    method = (cfg.get("method") or {}).get("name") or plan.get("method") or "sft"
    title = run.get("name") or (cfg.get("output") or {}).get("run_name") or f"{base} fine-tuned with ft"
    kind = _ADAPTER_NAMES.get(adapter["type"], adapter["type"])
    what = {
        "adapter": f"a {kind} adapter for",
        "reward model": "a reward model trained from",
        "merged model": f"a {kind} adapter merged into the weights of",
        "gguf": "a GGUF export (llama.cpp, Ollama) of a fine-tune of",
    }.get(artifact, "a fully fine-tuned")
    front = _front_matter(run, base, artifact, method, adapter["type"])
    parts = [
        "---\n" + "".join(f"{k}: {json.dumps(v)}\n" for k, v in front.items()) + "---",
        f"# {title}",
        f"This is {what} `{base}`, trained with ft ({method.upper()}).",
        "## Model\n\n" + _table(_model_rows(cfg, plan, adapter, artifact, base)),
        "## Data\n\n" + _table(_data_rows(cfg, data)),
        "## Training\n\n" + _table(_training_rows(cfg, plan)),
        "## Results\n\n" + _table(_result_rows(metrics, cfg.get("evaluation") or {})),
        _usage(base, artifact, run, data),
    ]
    return "\n\n".join(p for p in parts if p) + "\n"


_ADAPTER_NAMES = {"lora": "LoRA", "qlora": "QLoRA"}
_LIBRARIES = {"adapter": "peft", "gguf": None}  # library_name in the front matter (default transformers)


def _front_matter(run: dict, base: str, artifact: str, method: str, adapter: str) -> dict:
    """The card's YAML front matter, the metadata the hub reads: base model, library, license, data sets, tags."""
    front = {"base_model": run["hub_base"] if "hub_base" in run else base}
    front["library_name"] = _LIBRARIES.get(artifact, "transformers")
    front["license"] = run.get("license")
    front["datasets"] = list(run.get("datasets") or [])
    front["tags"] = (
        ["ft", method]
        + ([adapter] if artifact in ("adapter", "merged model") else [])
        + (["reward-model"] if artifact == "reward model" else [])
        + (["merged"] if artifact == "merged model" else [])
        + (["gguf"] if artifact == "gguf" else [])
    )
    return {k: v for k, v in front.items() if v not in (None, "", [])}


def _table(rows: list[tuple[str, Any]]) -> str:
    rows = [(k, v) for k, v in rows if v not in (None, "", [])]
    if not rows:
        return "_not recorded_"
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {str(v).replace('|', '/')} |" for k, v in rows)


def _model_rows(cfg: dict, plan: dict, adapter: dict, artifact: str, base: str) -> list:
    model = cfg.get("model") or {}
    rows = [
        ("base model", f"`{base}`"),
        ("revision", model.get("revision")),
        ("method", ((cfg.get("method") or {}).get("name") or plan.get("method") or "").upper()),
        (
            "trained",
            "all weights"
            if artifact == "model" or adapter["type"] == "full"
            else f"{_ADAPTER_NAMES.get(adapter['type'], adapter['type'])} adapter"
            + (" (merged into the weights here)" if artifact in ("reward model", "merged model") else ""),
        ),
    ]
    if artifact in ("adapter", "merged model"):
        targets = adapter.get("target_modules")
        rows += [
            ("rank r / alpha", f"{adapter.get('r', '?')} / {adapter.get('alpha', '?')}"),
            ("target modules", ", ".join(targets) if isinstance(targets, list) else targets),
            ("dropout", _dropout(plan, adapter)),
            ("DoRA", "yes" if adapter.get("dora") else None),
            ("rsLoRA", "yes" if adapter.get("rslora") else None),
            ("modules trained in full", ", ".join(adapter.get("modules_to_save") or [])),
        ]
    rows.append(
        ("base quantization", plan.get("quantization") if plan.get("quantization") not in (None, "none") else None)
    )
    params = plan.get("params") or {}
    if params.get("total") and params.get("trainable"):
        rows.append(
            (
                "trained parameters",
                f"{params['trainable']:,} of {params['total']:,} ({100 * params['trainable'] / params['total']:.2f}%)",
            )
        )
    return rows


def _dropout(plan: dict, adapter: dict):
    """The LoRA dropout the run trained with: the plan's (0 on an MoE model's fused experts, whatever the config's
    default), else, in plans written before it was recorded, the config's adapter.dropout."""
    used = plan.get("lora_dropout")
    return adapter.get("dropout") if used is None else used


def _data_rows(cfg: dict, data: dict) -> list:
    sources = data.get("sources") or (cfg.get("data") or {}).get("datasets") or []
    rows = [(f"source {i + 1}", _source(s)) for i, s in enumerate(sources)]
    names = (
        ("train_samples", "training samples"),
        ("validation_samples", "validation samples"),
        ("tokens_per_epoch", "tokens per epoch"),
        ("trained_tokens_per_epoch", "trained tokens per epoch"),
        ("packed_rows", "packed rows"),
    )
    rows += [(label, f"{data[k]:,}" if isinstance(data.get(k), int) else data.get(k)) for k, label in names]
    rows.append(("special tokens added", ", ".join(data.get("added_tokens") or [])))
    return rows


def _source(s: Any) -> str:
    if not isinstance(s, dict):
        return f"`{s}`"
    extra = [f"{k} {s[k]}" for k in ("format", "subset", "split") if s.get(k)]
    if s.get("samples"):
        extra.append(f"{s['samples']} samples")
    elif s.get("weight") not in (None, 1, 1.0):
        extra.append(f"weight {s['weight']}")
    return f"`{s.get('path', '?')}`" + (f" ({', '.join(extra)})" if extra else "")


def _training_rows(cfg: dict, plan: dict) -> list:
    train, data = cfg.get("train") or {}, cfg.get("data") or {}
    batch = None
    if all(k in plan for k in ("micro_batch_size", "gradient_accumulation_steps", "world_size", "global_batch_size")):
        batch = (
            f"{plan['micro_batch_size']} micro × {plan['gradient_accumulation_steps']} accumulation × "
            f"{plan['world_size']} ranks = {plan['global_batch_size']} sequences per step"
        )
    backend = plan.get("backend")
    if backend and plan.get("sharding") not in (None, "none"):
        backend = f"{backend} ({plan['sharding']})"
    seq_len = plan.get("seq_len") or data.get("seq_len")
    lr = plan.get("lr") or train.get("lr")
    return [
        ("hardware", plan.get("hardware")),
        ("precision", plan.get("precision") or train.get("precision")),
        ("backend", backend),
        ("offload", plan.get("offload_target") if plan.get("offload") else None),
        ("batch", batch),
        ("sequence length", f"{seq_len}{', packed' if data.get('packing') else ''}" if seq_len else None),
        ("learning rate", f"{lr:g}" if isinstance(lr, float) else lr),
        ("schedule / optimizer", " / ".join(str(train[k]) for k in ("scheduler", "optimizer") if train.get(k))),
        ("gradient checkpointing", {True: "on", False: "off"}.get(plan.get("gradient_checkpointing"))),
    ]


def _result_rows(metrics: dict, evaluation: dict) -> list:
    def loss(v):
        return f"{v:.4f}" if isinstance(v, (int, float)) and math.isfinite(v) else None

    seconds = metrics.get("seconds")
    duration = None
    if isinstance(seconds, (int, float)):
        h, rest = divmod(int(round(seconds)), 3600)
        duration = f"{h}h {rest // 60:02d}m {rest % 60:02d}s"
    rows = [("final train loss", loss(metrics.get("final_loss")))]
    rows += [(f"final train {name}", _number(v)) for name, v in (metrics.get("final_metrics") or {}).items()]
    rows.append(("final eval loss", loss(metrics.get("final_eval_loss"))))
    evals = {k.removeprefix("final_eval_"): v for k, v in metrics.items() if k.startswith("final_eval_")}
    rows += [(f"final eval {name}", _number(v)) for name, v in evals.items() if name != "loss"]
    rows.append(_task_row(metrics, evaluation))
    return rows + [("optimizer steps", metrics.get("steps")), ("training time", duration)]


def _number(v: Any) -> str | None:
    return f"{v:.4g}" if isinstance(v, (int, float)) and math.isfinite(v) else None


def _task_row(metrics: dict, evaluation: dict) -> tuple[str, Any]:
    """The job's task evaluation (`evaluation:`), before and after training, as `ft train` printed it."""
    after = metrics.get("task_after")
    if not isinstance(after, (int, float)) or not evaluation.get("metric"):
        return ("task evaluation", None)
    from finetune.infer.scoring import score_text

    metric, before = evaluation["metric"], metrics.get("task_before")
    shown = score_text(metric, after, 1)
    if isinstance(before, (int, float)):
        shown = f"{score_text(metric, before, 1)} before, {shown} after"
    return (f"{metric} on `{evaluation.get('path', '?')}`", shown)


def _usage(base: str, artifact: str, run: dict, data: dict) -> str:
    run_dir = run.get("run_dir") or "RUN"
    path = run.get("path") or f"{run_dir}/final"
    if artifact == "reward model":
        return (
            "## Use\n\nOne score per sequence (prompt and answer, formatted as in training), higher for better "
            "answers:\n\n```python\nfrom transformers import AutoModelForSequenceClassification, AutoTokenizer\n\n"
            f'model = AutoModelForSequenceClassification.from_pretrained("{path}", dtype="auto")\n'
            f'tokenizer = AutoTokenizer.from_pretrained("{path}")\n```\n\n'
            f"As the reward of a GRPO job: `rewards: [{{model: {path}}}]`"
        )
    if artifact == "gguf":
        return (
            "## Use\n\nThe `.gguf` files load in llama.cpp (`llama-cli -m FILE.gguf`); the `Modelfile` makes an Ollama "
            "model of the file it names (`ollama create NAME -f Modelfile`, in a folder holding both)."
        )
    if artifact in ("model", "merged model"):
        return (
            "## Use\n\n```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f'model = AutoModelForCausalLM.from_pretrained("{path}", dtype="auto")\n'
            f'tokenizer = AutoTokenizer.from_pretrained("{path}")\n```'
        )
    resize = "base.resize_token_embeddings(len(tokenizer))\n" if data.get("added_tokens") else ""
    return (
        "## Use\n\n```python\nfrom peft import PeftModel\nfrom transformers import AutoModelForCausalLM, "
        "AutoTokenizer\n\n"
        f'tokenizer = AutoTokenizer.from_pretrained("{path}")\nbase = AutoModelForCausalLM.from_pretrained("{base}", '
        f'dtype="auto")\n{resize}model = PeftModel.from_pretrained(base, "{path}")\n```\n\n'
        f"To merge the adapter into the base weights for a standalone model: `ft merge-lora {run_dir}`"
    )
