"""The launcher's side of one `placement: ray` job while it runs: the connection to the cluster, the placement group,
the actors, and the wait for the first of them to end (rollout/ray_layout.py says how the job is laid out)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

from finetune.artifacts.run import RunFolder
from finetune.errors import FtError
from finetune.rollout.ray_actors import EngineServer, RankProcess
from finetune.rollout.ray_layout import (
    NODE_LABEL,
    READY_TIMEOUT_S,
    STOP_GRACE_S,
    STOP_SIGNALS,
    Node,
    actor_env,
    address,
    assign,
    bundles,
    ended,
    new_token,
    rank_environment,
    stopped,
    write_engines,
)

POLL_S = 1.0
CONNECT_TIMEOUT_S = 10.0  # the cluster's address must answer within this
SERVER_EXIT_WAIT_S = 5.0  # after a rank failed: time for a server's exit to reach the launcher


def run_on_ray(config, plan, run_dir: Path, resume_from: Path | None) -> dict:
    """Place, start and follow the job's actors until its ranks end (rollout/ray_layout.py says how)."""
    with RayRun(config, plan, Path(run_dir).absolute()) as run:
        run.start_engines()
        return run.train(resume_from)


class RayRun:
    def __init__(self, config, plan, run_dir: Path):
        self.config, self.plan, self.run_dir, self.folder = config, plan, run_dir, RunFolder(run_dir)
        self.where = address(config.method.rollout)
        self.engines: list = []  # (actor, url, node address, log path, the call that returns when it exits)
        self.engine_gpus: list[str] = []  # CUDA_VISIBLE_DEVICES of each server's actor (GPUs)
        self.ranks: list = []
        self.group = None
        self.signum = 0
        self.secrets: dict[str, str] = {}  # for the actors' processes, never their runtime environment (ray_layout)

    # ---------------------------------------------------------------- the cluster and the placement group
    def __enter__(self) -> RayRun:
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # every rank's lines as they are
        import logging

        import ray

        reachable(self.where)
        try:
            public, self.secrets = actor_env(new_token())
            ray.init(address=self.where, runtime_env={"env_vars": public}, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError) as e:
            raise FtError(
                f"method.rollout.placement: ray: cannot join the Ray cluster at {self.where} ({e}).\n    fix: start "
                "one (`ray start --head` on the first node, `ray start --address HEAD:6379` on the others), then set "
                "method.rollout.ray_address or RAY_ADDRESS to its address"
            ) from None
        try:
            self._place(ray)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _place(self, ray) -> None:
        from ray.util.placement_group import placement_group

        here = ray.get_runtime_context().get_node_id()
        live = [n for n in ray.nodes() if n.get("Alive")]
        live.sort(key=lambda n: (n["NodeID"] != here, n["NodeManagerAddress"], n["NodeID"]))
        nodes = [
            Node(n["NodeID"], n["NodeManagerAddress"], n["Resources"].get("CPU", 0), n["Resources"].get("GPU", 0))
            for n in live
        ]
        self.layout = bundles(self.plan)
        self.nodes = assign(self.layout, nodes, self.where)
        self.group = placement_group(
            [b.resources() for b in self.layout],
            strategy="PACK",
            bundle_label_selector=[{NODE_LABEL: self.nodes[b.node].id} for b in self.layout],
        )
        try:
            ray.get(self.group.ready(), timeout=READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise FtError(
                f"method.rollout.placement: ray: the Ray cluster at {self.where} did not reserve the job's "
                f"{len(self.layout)} bundles within {READY_TIMEOUT_S} s (other jobs hold its CPUs or GPUs?)"
            ) from None
        sys.stderr.write("Ray placement: " + self.describe() + "\n")

    def describe(self) -> str:
        parts = []
        for k, node in sorted(self.nodes.items()):
            ranks = [b.index for b in self.layout if b.node == k and b.role == "rank"]
            engines = [b for b in self.layout if b.node == k and b.role == "engine"]
            held = ([f"ranks {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"rank {ranks[0]}"] if ranks else []) + [
                f"vLLM server {b.index}" for b in engines
            ]
            parts.append(f"node {k} = {node.address} ({node.id[:8]}): {', '.join(held)}")
        return "; ".join(parts)

    def _actor(self, cls, index: int):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        b = self.layout[index]
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index)
        remote = ray.remote(cls).options(
            num_cpus=1, num_gpus=b.gpus, max_concurrency=2, scheduling_strategy=strategy, max_restarts=0
        )
        return remote.remote()

    # ---------------------------------------------------------------- the servers
    def start_engines(self) -> None:
        import ray

        from finetune.rollout.factory import engine_spec

        c, r = self.config, self.plan.rollout
        spec = engine_spec(self.plan, c.model, c.adapter, c.train.seed, c.method)
        gpu = self.plan.device == "GPU"
        calls = []
        for i, b in enumerate(self.layout):
            if b.role != "engine":
                continue
            actor = self._actor(EngineServer, i)
            dp = max(1, r.engines // (r.engine_nodes or 1)) if gpu else 1
            log = str(self.folder.rollout_engine_log_path(b.index))
            calls.append(
                (
                    actor,
                    b,
                    log,
                    actor.start.remote(spec, c.method.rollout.command, gpu, dp, log, READY_TIMEOUT_S, self.secrets),
                )
            )
        for actor, b, log, call in calls:
            try:
                url = ray.get(call)
            except ray.exceptions.RayError as e:
                raise FtError(
                    f"the vLLM rollout server {b.index} on {self.nodes[b.node].address} did not start: "
                    f"{_cause(e)}; its log ({log}) ends:\n{_tail(Path(log))}"
                ) from None
            self.engines.append((actor, url, self.nodes[b.node].address, log, actor.wait.remote()))
        pids = ray.get([actor.pid.remote() for actor, *_ in self.engines])
        engines = [b for b in self.layout if b.role == "engine"]
        self._check_nodes(engines, ray.get([actor.node.remote() for actor, *_ in self.engines]))
        write_engines(self.run_dir, [(url, node, pid) for (_, url, node, _, _), pid in zip(self.engines, pids)])
        self.engine_gpus = ray.get([actor.gpus.remote() for actor, *_ in self.engines]) if gpu else []

    # ---------------------------------------------------------------- the ranks
    def train(self, resume_from: Path | None) -> dict:
        import ray

        actors = [(i, b) for i, b in enumerate(self.layout) if b.role == "rank"]
        self.ranks = [self._actor(RankProcess, i) for i, _ in actors]
        places = ray.get([a.where.remote() for a in self.ranks])
        self._check_nodes([b for _, b in actors], [p["node"] for p in places])
        if self.plan.device == "GPU":  # each node numbers its own GPUs
            ranks = ", ".join(f"rank {b.index} = {p['gpus'][0]}" for (_, b), p in zip(actors, places))
            servers = ", ".join(f"vLLM server {i} = {g}" for i, g in enumerate(self.engine_gpus))
            sys.stderr.write(f"Ray GPUs (as each node numbers them): {ranks}; {servers}\n")
        argv = ["-m", "finetune.rank", str(self.run_dir), *(["--resume-from", str(resume_from)] if resume_from else [])]
        running = {}
        for (_, b), actor in zip(actors, self.ranks):
            env = rank_environment(self.plan, b, places, self.run_dir)
            running[actor.run.remote(argv, env, os.getcwd(), self.secrets)] = ("rank", b.index)
        for _, url, node, log, waiting in self.engines:
            running[waiting] = ("engine", (url, node, log))
        with _catching_stop_signals(self):
            return self._follow(running)

    def _check_nodes(self, placed: list, ids: list[str]) -> None:
        """Each actor runs on the node its bundle's label selector names: a Ray that ignores the selectors (before
        2.50) would let a placement group pack bundles elsewhere, breaking the plan's split."""
        for b, got in zip(placed, ids):
            want = self.nodes[b.node]
            if got != want.id:
                raise FtError(
                    f"method.rollout.placement: ray: Ray placed {b.role} {b.index} on node {got[:8]}, not on "
                    f"{want.address} ({want.id[:8]}) as its bundle's label selector asks.\n    fix: pip install "
                    "'ray>=2.50' on every node (earlier versions ignore placement groups' label selectors)"
                )

    def _follow(self, running: dict) -> dict:
        """Wait for every rank to end; the first failure (a rank, a server, an actor's node) ends the job."""
        import ray

        ranks = sum(1 for kind, _ in running.values() if kind == "rank")
        failure, asked = None, 0
        while ranks and failure is None:
            if self.signum and not asked:
                asked = self.signum
                for actor in self.ranks:
                    actor.signal.remote(asked)  # each rank finishes its step and saves a checkpoint
            done, _ = ray.wait(list(running), num_returns=1, timeout=POLL_S)
            for ref in done:
                kind, what = running.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayError as e:
                    failure = f"the Ray actor of {kind} {what} was lost ({_cause(e)})"
                    break
                if kind == "engine":
                    failure = None if asked else _server_exited(what, result)
                    continue
                ranks -= 1
                code, tail = result
                if code:
                    lines = "\n".join("    " + line for line in tail)
                    failure = f"training failed: rank {what} exited with code {code}; its last lines:\n{lines}"
                    failure = self._server_first(running, failure)
        if failure is not None:
            self._stop_ranks(running)
            raise ended(failure, self.run_dir)
        if asked:
            raise stopped(asked, self.run_dir)
        return {"steps": None, "launched": "ray"}

    def _server_first(self, running: dict, failure: str) -> str:
        """A rank failed: where a server exited too (a rank that lost it may notice before the launcher does), the
        server is the cause, named with its log; the rank's lines follow."""
        import ray

        engines = [ref for ref, (kind, _) in running.items() if kind == "engine"]
        done, _ = ray.wait(engines, num_returns=len(engines), timeout=SERVER_EXIT_WAIT_S) if engines else ([], [])
        for ref in done:
            _, what = running.pop(ref)
            with contextlib.suppress(ray.exceptions.RayError):
                return f"{_server_exited(what, ray.get(ref))}\nthen {failure}"
        return failure

    def _stop_ranks(self, running: dict) -> None:
        """The ranks still running: a stop signal (a rank that can finish its step saves a checkpoint), then killed."""
        import ray

        for actor in self.ranks:
            actor.signal.remote(signal.SIGTERM)
        pending = [ref for ref, (kind, _) in running.items() if kind == "rank"]
        if pending:
            ray.wait(pending, num_returns=len(pending), timeout=STOP_GRACE_S)
        for actor in self.ranks:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(actor.kill.remote(), timeout=30)

    # ---------------------------------------------------------------- the end, however it comes
    def __exit__(self, *exc) -> None:
        import ray

        self.folder.rollout_engines_path.unlink(missing_ok=True)  # the addresses of servers that no longer run
        for actor, *_ in self.engines:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(actor.stop.remote(), timeout=60)
        for actor in [*self.ranks, *(e[0] for e in self.engines)]:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.group)
        ray.shutdown()


def reachable(where: str) -> None:
    """Refuse a cluster address nothing answers at, before ray.init: Ray's driver retries an unreachable cluster
    without end (2.60: "Failed to connect to GCS" every 5 s). Ray connects to this machine's own address for a
    loopback one (ray._private.services.resolve_ip_for_localhost), and so does the check. `auto` is left to Ray,
    which refuses at once where no cluster runs on this machine."""
    import socket

    host, sep, port = where.rpartition(":")
    if not sep or not port.isdigit() or "://" in where:
        return  # auto, or a ray:// client address: Ray's own errors
    host = host.strip("[]")
    if host in ("localhost", "127.0.0.1", "::1"):  # Ray's is_localhost (2.60)
        import ray

        host = ray.util.get_node_ip_address()
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise FtError(
            f"method.rollout.placement: ray: nothing answers at the Ray cluster address {where} ({host}:{port}: "
            f"{e.strerror or e}).\n    fix: start the cluster (`ray start --head` on the first node prints its "
            "address; `ray start --address HEAD:6379` on the others), then set method.rollout.ray_address or "
            "RAY_ADDRESS to it"
        ) from None


@contextlib.contextmanager
def _catching_stop_signals(run: RayRun):
    """A first SIGTERM/SIGINT is passed on to the ranks (by the wait loop); a second SIGINT stops at once."""

    def handler(signum, _frame):
        if run.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt
        run.signum = run.signum or signum

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _server_exited(what: tuple, code: int) -> str:
    url, node, log = what
    return (
        f"the vLLM rollout server at {url} (Ray node {node}) exited with code {code} while the job ran; its log "
        f"({log}) ends:\n{_tail(Path(log))}"
    )


def _cause(e: Exception) -> str:
    cause = getattr(e, "cause", None)
    return str(cause) if cause is not None else str(e).splitlines()[-1] if str(e) else type(e).__name__


def _tail(path: Path) -> str:
    from finetune.rollout.pool import log_tail

    return log_tail(path) if path.is_file() else "    (no log)"
