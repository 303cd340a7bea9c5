"""`ft consolidate RUN`: what RUN/final would hold, written from a checkpoint, in one process, no GPU needed.

The model is built as the run built it (from RUN/config.yaml and RUN/plan.json; a quantized base is
loaded unquantized, which leaves the adapter's shapes unchanged), the checkpoint's trained tensors are
loaded into it by the engine code that owns the checkpoint's format (recorded in its state.json: a single
copy, FSDP shards or DeepSpeed ZeRO partitions, written by any number of ranks), and the adapter (peft
format) or the whole model (safetensors) is saved with the tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

from finetune import checkpoint
from finetune.artifacts.run import RunFolder, checkpoint_step, complete, refuse_replacing_run
from finetune.artifacts.weights import final_dtype, record_dtype, saved_state
from finetune.errors import FtError


def consolidate(
    run_dir: str | Path, step: int | None = None, out: str | Path | None = None, overwrite: bool = False
) -> Path:
    """Write the consolidated adapter or model of checkpoint `step` (default: the newest); return its folder."""
    import torch

    run_dir = Path(run_dir)
    ckpt = _checkpoint(run_dir, step)
    out = Path(out) if out is not None else RunFolder(run_dir).consolidated_dir / ckpt.name

    refuse_replacing_run(out, "--out")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FtError(f"--out {out} is not empty; choose another folder or pass --overwrite")
    config, plan = _run(run_dir)
    model, tokenizer = _model(config, plan)
    fmt = checkpoint.written_format(ckpt)
    from finetune.distributed.engine import read_trained

    # full CPU tensors by the names of the model's parameters, read by the engine code that owns the format
    trained = read_trained(ckpt, fmt, model)
    params = dict(model.named_parameters(remove_duplicate=False))  # tied weights under each of their names
    covered = {id(params[n]) for n in trained if n in params}
    missing = sorted(n for n, p in model.named_parameters() if p.requires_grad and id(p) not in covered)[:3]
    extra = sorted(n for n in trained if n not in params or not params[n].requires_grad)[:3]
    if missing or extra:
        raise FtError(
            f"checkpoint {ckpt} does not match the model of {RunFolder(run_dir).config_path} (missing {missing}, "
            f"unexpected {extra}); was the run folder's config edited?"
        )
    with torch.no_grad():
        for name, value in trained.items():
            params[name].copy_(value)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dtype = final_dtype(config.output, plan)  # a full model as train.save_final writes it (output.save_dtype)
    model.save_pretrained(str(tmp), **({"state_dict": saved_state(model, dtype)} if dtype is not None else {}))
    if dtype is not None:
        record_dtype(tmp, dtype)
    tokenizer.save_pretrained(str(tmp))
    (tmp / "consolidated.json").write_text(
        json.dumps({"run": str(run_dir), "checkpoint": ckpt.name, "format": fmt}, indent=2)
    )
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _checkpoint(run_dir: Path, step: int | None) -> Path:
    folder = RunFolder(run_dir)
    if not folder.plan_path.is_file():
        raise FtError(f"{run_dir} is not an ft run folder (no plan.json); give the output.dir of a run")
    if step is None:
        found = checkpoint.latest(run_dir)
        if found is None:
            raise FtError(
                f"{run_dir} has no complete checkpoint (checkpoints/step-*/state.json); its final weights, if "
                f"training finished, are in {folder.final}"
            )
        return found
    path = folder.checkpoint(step)
    if not complete(path):
        have = ", ".join(str(checkpoint_step(p)) for p in folder.checkpoints()) or "none"
        raise FtError(f"--step {step}: {run_dir} has no complete checkpoint at that step (complete: {have})")
    return path


def _run(run_dir: Path):
    """The run's config and its Plan as one fp32 process on the CPU would run it (the adapter, trained embeddings, the
    attention kernel and every other decision as planned; no quantization, sharding or process group)."""
    from finetune.config import load

    folder = RunFolder(run_dir)
    config = load(folder.config_path)
    plan = replace(
        folder.plan(),
        quantization="none",
        quant_storage=None,
        precision="fp32",
        backend="single",
        sharding=None,
        offload="none",
        world_size=1,
        nodes=1,
        processes_per_node=1,
        process_group=False,
        loading="replica",
        generation="local",
        gradient_checkpointing=False,
    )
    return config, plan


def _model(config, plan):
    from finetune.adapters import apply_adapter
    from finetune.data.preprocess import training_tokenizer
    from finetune.models import load_model

    tokenizer, _, _, _ = training_tokenizer(config)
    # the attention the run's plan chose, which the model class supports (no forward pass runs here)
    model = apply_adapter(load_model(config.model, plan, tokenizer), config.adapter, plan)
    return model, tokenizer
