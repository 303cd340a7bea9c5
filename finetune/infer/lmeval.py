"""lm-evaluation-harness tasks on ft's model, through the harness's Python API (an optional extra).

The model ft loaded (a merged adapter included) is handed to the harness's HFLM wrapper, so the
harness evaluates exactly what `ft generate` would run. Local task folders (YAML task files) are added
with `include`, which also works offline when the task reads a local file (`dataset_path: json`).
"""

from __future__ import annotations

import importlib.util

from finetune.errors import FtError

INSTALL = "pip install 'finetune[lm-eval]' (or pip install lm-eval)"


def check_installed() -> None:
    if importlib.util.find_spec("lm_eval") is None:
        raise FtError(f"--lm-eval needs lm-evaluation-harness, which is not installed.\n    fix: {INSTALL}")


def run_tasks(
    model, tokenizer, tasks: list[str], include: str | None, limit: int | None, batch_size: int, chat: bool
) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} for the harness's tasks; `chat` applies the tokenizer's chat template."""
    check_installed()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include) if include else TaskManager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or in {include}" if include else ""
        raise FtError(
            f"--lm-eval: unknown task {', '.join(unknown)} (not among the harness's tasks{where}).\n"
            "    fix: check the name (lm-eval ls tasks), or add the folder holding its YAML with --lm-eval-include"
        )
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    results = simple_evaluate(
        model=lm, tasks=list(tasks), task_manager=manager, limit=limit, apply_chat_template=chat, log_samples=False
    )
    return {task: _numbers(values) for task, values in (results or {}).get("results", {}).items()}


def _numbers(values: dict) -> dict[str, float]:
    """The harness's metrics of one task, `exact_match,none` shown as `exact_match`; stderr and labels left out."""
    out = {}
    for key, value in values.items():
        metric, _, flt = key.partition(",")
        if (
            metric in ("alias", "name", "sample_len")
            or metric.endswith("_stderr")
            or not isinstance(value, (int, float))
            and not hasattr(value, "item")
        ):
            continue
        out[metric if flt in ("", "none") else f"{metric} ({flt})"] = float(value)
    return out
