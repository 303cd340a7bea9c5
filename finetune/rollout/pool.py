"""The rollout server `ft train` starts itself when the plan puts generation on a separate pool (placement: server,
no url): vLLM's own server (`vllm serve`, rollout/serve.py) on this node, on the GPUs the plan gives the pool (their
engines as vLLM's data-parallel ranks; on CPU, one more process), its command and log in RUN/rollout-server.log. Its
address reaches the ranks through the run folder (RUN/rollout-server.json, removed when the server stops), a fresh
token through their environment (vLLM's API key; a secret is never written); it is stopped when the job ends, however
it ends (SIGTERM, then its whole session)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
from pathlib import Path

from finetune.artifacts.run import RunFolder
from finetune.errors import FtError
from finetune.files import atomic_write_text
from finetune.rollout.factory import TOKEN_ENV, engine_spec

READY_TIMEOUT_S = 900  # loading a large model onto the pool's GPUs


def needs_pool(plan) -> bool:
    """Whether this job's plan asks ft to start a rollout server (node 0 does)."""
    return plan.rollout is not None and plan.rollout.placement == "server" and not plan.rollout.url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_devices(plan) -> tuple[str | None, str | None]:
    """(the trainer's CUDA_VISIBLE_DEVICES, the server's): the pool takes the last `server_gpus` of this node's GPUs."""
    pool = plan.rollout.server_gpus if plan.rollout else 0
    if not pool:
        return None, None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(plan.processes_per_node + pool)]
    return ",".join(devices[:-pool]), ",".join(devices[-pool:])


@contextlib.contextmanager
def rollout_pool(config, plan, run_dir: Path):
    """Start the server, wait until it answers, write its address into the run folder and its token into this
    process's environment (the ranks inherit it), and stop it on the way out."""
    if not needs_pool(plan):
        yield None
        return
    from finetune.rollout.serve import server_command, server_env, shown
    from finetune.rollout.server import Http, wait_ready

    spec = engine_spec(plan, config.model, config.adapter, config.train.seed, config.method)
    host = "0.0.0.0" if plan.nodes > 1 else "127.0.0.1"
    port, token = free_port(), secrets.token_hex(16)
    trainer_devices, server_devices = split_devices(plan)
    gpu = plan.device == "GPU"
    engines = max(1, plan.rollout.server_gpus // max(1, spec.tensor_parallel))
    cmd = server_command(spec, host, port, config.method.rollout.command, gpu, engines)
    env = server_env(os.environ, token, gpu)
    if server_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = server_devices
    folder = RunFolder(run_dir)
    log_path = folder.rollout_log_path
    log = open(log_path, "ab")  # noqa: SIM115 (kept open while the server runs)
    address = f"http://{_reachable(host)}:{port}"
    log.write(f"ft rollout server: listening on {address} once ready; started as: {shown(cmd)}\n".encode())
    log.flush()
    try:
        process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as e:
        log.close()
        raise FtError(
            f"method.rollout.command: cannot start vLLM's server ({cmd[0]}: {e.strerror})\n    fix: install vLLM "
            "here, or set method.rollout.command to how vLLM starts where it is installed (e.g. /opt/vllm/bin/python "
            "-m vllm.entrypoints.openai.api_server)"
        ) from None
    saved = {k: os.environ.get(k) for k in (TOKEN_ENV, "CUDA_VISIBLE_DEVICES")}
    try:
        sys.stderr.write(f"starting the vLLM rollout server ({address}, log: {log_path})\n")
        try:
            wait_ready(Http(address, token, 60), READY_TIMEOUT_S, process)
        except FtError as e:
            raise FtError(f"{e}; its log ({log_path}) ends:\n{log_tail(log_path)}") from None
        atomic_write_text(folder.rollout_server_path, json.dumps({"url": address, "pid": process.pid}) + "\n")
        os.environ[TOKEN_ENV] = token
        if trainer_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = trainer_devices
        yield address
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        folder.rollout_server_path.unlink(missing_ok=True)  # the address of a server that no longer runs
        stop_server(process)
        log.close()


def log_tail(path: Path, lines: int = 15) -> str:
    """The last lines of a server's log, indented, for an error message."""
    text = path.read_text(errors="replace").splitlines()
    return "\n".join("    " + line for line in text[-lines:])


def _reachable(host: str) -> str:
    return socket.gethostname() if host == "0.0.0.0" else host


def stop_server(process) -> None:
    """SIGTERM to vLLM's server (it stops its engines), then whatever is left of its session: the engine processes a
    server that died or hung left behind (ft started them all, in a session of their own)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
