"""What runs inside the Ray actors of `placement: ray` (rollout/ray_run.py places and follows them).

EngineServer  starts vLLM's own server (`vllm serve`, rollout/serve.py) on its node, with the GPUs of its bundle (Ray
              sets CUDA_VISIBLE_DEVICES for the actor; the server inherits it), binds it to the node's address, waits
              until it answers and reports its URL; it stops the server with the job.
RankProcess   runs one trainer rank as torchrun would: `python -m finetune.rank RUN_DIR` with RANK, WORLD_SIZE,
              LOCAL_RANK, MASTER_ADDR, ... in its environment (rollout/ray_layout.py), and passes on its error output
              (Ray shows it on ft train's terminal) keeping the last lines for the launcher's message. The rank runs in
              a session of its own: what Ray does to its worker's process group never reaches it, and it stops (with a
              checkpoint) when this worker dies (distributed/lifecycle.py: the parent-death signal).

Both keep their process while the launcher calls them again (`wait`, `signal`, `stop`): the actors are threaded
(max_concurrency 2), so a call that blocks until the process ends does not hold up the others. The token that guards
the servers, and any secret-named variable of ft train's environment, reach both as a call's argument and from there
only the process's environment: Ray's runtime-env agent writes the job's runtime environment into its log.
"""

from __future__ import annotations

import collections
import os
import socket
import subprocess
import sys

TAIL_LINES = 25  # a failed rank's last error lines, in the launcher's message
MASTER_PORT = 29500  # torchrun's default port of the process group, and the ones after it
SERVER_PORT = 8420  # ft rollout-server's port in the docs, and the ones after it
PORT_SPAN = 500


def node_address() -> str:
    """This node's address in the Ray cluster (what the other nodes reach it at)."""
    import ray

    return ray.util.get_node_ip_address()


def free_port(host: str, first: int) -> int:
    """A port nothing listens on, from `first` up: outside the kernel's ephemeral range (32768-60999 on Linux), from
    which every outgoing connection and every bind to port 0 (Ray's, vLLM's) draws, so that no other process takes it
    in the seconds before the rank or the server binds it (a port from bind(0) was taken so under load)."""
    for port in range(first, first + PORT_SPAN):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # all taken: any port
        s.bind((host, 0))
        return s.getsockname()[1]


class EngineServer:
    """One vLLM server on this actor's node."""

    def __init__(self):
        self.process = None

    def start(
        self, spec, command: str | None, gpu: bool, data_parallel: int, log_path: str, timeout_s: float, secrets: dict
    ) -> str:
        from finetune.rollout.factory import TOKEN_ENV
        from finetune.rollout.serve import server_command, server_env, shown
        from finetune.rollout.server import Http, wait_ready

        host = node_address()
        port = free_port(host, SERVER_PORT)
        cmd = server_command(spec, host, port, command, gpu, data_parallel)
        token = secrets.get(TOKEN_ENV)
        url = f"http://{host}:{port}"
        with open(log_path, "ab") as log:
            log.write(f"ft rollout engine: listening on {url} once ready; started as: {shown(cmd)}\n".encode())
            log.flush()
            env = server_env({**os.environ, **secrets}, token, gpu)
            self.process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_ready(Http(url, token, 60), timeout_s, self.process)
        return url

    def wait(self) -> int:
        """Block until the server exits; its exit code."""
        return self.process.wait()

    def pid(self) -> int:
        return self.process.pid

    def node(self) -> str:
        """The id of the node Ray placed this actor on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def gpus(self) -> str:
        """The GPUs Ray gave this actor, as its node numbers them (Ray sets CUDA_VISIBLE_DEVICES when it creates the
        actor, and the server inherits it)."""
        return os.environ.get("CUDA_VISIBLE_DEVICES", "")

    def stop(self) -> None:
        from finetune.rollout.pool import stop_server

        if self.process is not None:
            stop_server(self.process)


class RankProcess:
    """One trainer rank, in a process of its own on this actor's node."""

    def __init__(self):
        self.process = None

    def where(self) -> dict:
        """This node's address and id, a free port on it (rank 0's is the process group's), and the GPUs Ray gave the
        actor."""
        import ray

        host = node_address()
        gpus = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        return {
            "address": host,
            "port": free_port(host, MASTER_PORT),
            "gpus": [str(g) for g in gpus],
            "node": ray.get_runtime_context().get_node_id(),
        }

    def run(self, argv: list[str], env: dict[str, str], cwd: str | None, secrets: dict) -> tuple[int, list[str]]:
        """The rank to its end: its exit code and its last error lines (all of them also go to this actor's stderr)."""
        self.process = subprocess.Popen(
            [sys.executable, *argv],
            env={**os.environ, **env, **secrets},
            cwd=cwd if cwd and os.path.isdir(cwd) else None,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,  # only the launcher's signals reach it; it dies with this actor's worker
        )
        tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        for line in self.process.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            tail.append(line.rstrip("\n"))
        return self.process.wait(), list(tail)

    def signal(self, signum: int) -> None:
        """Pass a stop signal on (the rank finishes its step and saves a checkpoint, as under torchrun)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
