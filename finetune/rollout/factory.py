"""The rollout engine a job's plan places: the training model itself, a vLLM engine in each training process, or a
client of a rollout server."""

from __future__ import annotations

import os

from finetune.errors import FtError
from finetune.plan.rollout import unservable

TOKEN_ENV = "FT_ROLLOUT_TOKEN"  # a shared secret between trainer and server (never written anywhere)


NO_SERVER = {  # a rank that finds no rollout server to send its prompts to, by placement
    "ray": (
        "method.rollout.placement: ray, but no rollout engine is known to this rank (rollout-engines.json is "
        "missing from the run folder): start the job with ft train, which starts the engines on the Ray cluster and "
        "then the ranks"
    ),
    "server": (
        "method.rollout.placement: server, but no rollout server is known to this rank: set method.rollout.url to a "
        "running vLLM server (`ft rollout-server JOB` starts one), or let ft train start one (placement: server "
        "without url)"
    ),
}


def placement(plan, section) -> tuple[str, str]:
    """(engine, placement): the plan's (the planner places the rollouts of every method that samples)."""
    if plan.rollout is None:
        raise FtError(
            "plan.json places no rollout engine for a method that samples (an edited plan.json?); run ft train "
            "again, which plans the job"
        )
    return plan.rollout.engine, plan.rollout.placement


def create_engine(section, context):
    """The rollout engine for this rank."""
    from finetune.infer.engines import stop_ids

    engine, where = placement(context.plan, section)
    if where == "inline":
        from finetune.rollout.local import TransformersRollout

        return TransformersRollout(context.engine, context.tokenizer, section, context.device, context.autocast)
    servable(context)
    stop = stop_ids(context.tokenizer)
    if where in ("ray", "server"):  # vLLM servers: given by url, or started by ft train (rollout/ray_run.py, pool.py)
        from finetune.artifacts.run import RunFolder
        from finetune.rollout.server import RemoteRollout

        folder = RunFolder(context.folder)
        urls = folder.rollout_engines() if where == "ray" else section.rollout.url or folder.rollout_server()
        if not urls:
            raise FtError(NO_SERVER[where])
        return RemoteRollout(urls, section, stop, os.environ.get(TOKEN_ENV), section.rollout.timeout_s)
    import torch

    from finetune.rollout.vllm import VllmRollout, prepare_environment

    rt = context.runtime
    prepare_environment(torch.cuda.is_available(), rt.local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    spec = engine_spec(context.plan, context.model, context.adapter, context.seed, section, rt.world_size > 1)
    return VllmRollout(spec, section, stop)


def engine_spec(plan, model, adapter, seed: int, section, external_launcher: bool = False):
    """A vLLM engine for this job: the model as the trainer loaded it, in the plan's precision, with the plan's share
    (a colocated engine, or the server `ft train` starts)."""
    from finetune.models import BUILT_IN, model_path
    from finetune.rollout.vllm import EngineSpec

    r = plan.rollout  # None in plans written before rollouts were placed
    return EngineSpec(
        model=model_path(model),
        tokenizer=model_path(model) if not model.tokenizer or model.tokenizer.lower() in BUILT_IN else model.tokenizer,
        dtype=plan.precision if plan.precision in ("fp32", "bf16", "fp16") else "bf16",
        max_model_len=plan.seq_len,
        seed=seed,
        lora_rank=adapter.r if plan.adapter != "full" else 0,
        tensor_parallel=r.tensor_parallel if r else 1,
        memory_share=r.memory_share if r else 0.0,
        kv_cache_bytes=(r.kv_cache_bytes if r else 0) or int((section.rollout.kv_cache_gib or 1) * 2**30),
        sleep=bool(r and r.sleep) and not section.rollout.asynchronous,
        trust_remote_code=model.trust_remote_code,
        external_launcher=external_launcher,
    )


def servable(context) -> None:
    """What a vLLM engine cannot take from the trainer is refused before anything loads."""
    why = unservable(context.adapter, context.plan.adapter, context.plan.train_embeddings)
    if why:
        raise FtError(
            f"method.engine: vllm: vLLM cannot serve {why}.\n    fix: remove it (use tokens the tokenizer already "
            "has), or set method.engine: transformers"
        )
