"""The process group of a multi-process job: start it, reduce scalars over it, and know who is rank 0.

A single-process job gets a `Runtime` with world size 1 whose operations do nothing, so the training
loop calls the same functions whatever the backend.

Every collective has the job's timeout (distributed.timeout_minutes). Each rank records what it is
doing (`activity`); a collective that times out, or whose peer went away, becomes an error that names
this rank, the collective, and that activity, instead of a hang or a bare backend message.

On GPUs that error cannot reach Python: NCCL's watchdog thread aborts the process when a collective of CUDA
tensors outlives the timeout. So a rank that uses NCCL also runs `watch_for_stalls`: when its activity has not
changed for a little less than the timeout (every collective of an activity is started after the activity
began, so it has waited no longer than the activity has lasted), it prints the same explanation (rank, step,
what it was doing) before the watchdog's abort.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import time
from dataclasses import dataclass, replace

import torch

from finetune.errors import LostPeers

# Read by torch's NCCL process group when it starts, so set before any process exists (ft train's launcher, the
# Slurm script, the K8s pods); values the user exported win.
NCCL_ENV = (
    # a collective that fails or times out ends the rank (exit 134) without ncclCommAbort, which can itself hang on a
    # dead peer: 3 (SkipCleanUp), torch's own default (ProcessGroupNCCL's constructor: getCvarInt(
    # TORCH_NCCL_ASYNC_ERROR_HANDLING, 3); the modes are ErrorHandlingMode in ProcessGroupNCCL.hpp); 1 (TearDown)
    # aborts the communicators first. Set explicitly: torchrun gives its workers 1 unless its own environment has a
    # value (torch 2.13 distributed/elastic/agent/server/local_elastic_agent.py:430-432).
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"),
    # each rank's last collectives, dumped when one times out (where: nccl_environment)
    ("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"),
    ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
)

_doing = ["setting up"]
_failed_during: list[str] = []  # what the rank was doing when an error first left an activity
_changed = [time.monotonic()]  # when the activity last changed (watch_for_stalls)


@contextlib.contextmanager
def activity(what: str):
    """Record what this rank is doing, for the message of a collective that fails during it."""
    _doing.append(what)
    _changed[0] = time.monotonic()
    try:
        yield
    except BaseException:
        if not _failed_during:
            _failed_during.append(doing())
        raise
    finally:
        _doing.pop()
        _changed[0] = time.monotonic()


def stall_message(rank: int, timeout_minutes: float, waited_s: float) -> str:
    return (
        f"rank {rank} has waited {waited_s / 60:.1f} min during {doing()} without progress: another rank is stuck or "
        "died (its output says which), or a step takes longer than distributed.timeout_minutes "
        f"({timeout_minutes:g}); raise it if the job is only slow. NCCL's watchdog stops this rank when a "
        f"collective has waited {timeout_minutes:g} min."
    )


def watch_for_stalls(rank: int, timeout_minutes: float, out=None) -> threading.Event:
    """A daemon thread that says `stall_message` once per activity that lasts a little less than the timeout (one
    minute less, or a tenth of it when shorter), ahead of NCCL's watchdog. Setting the returned event ends it."""
    limit = timeout_minutes * 60 - min(60.0, timeout_minutes * 6)
    out, done = out or sys.stderr, threading.Event()

    def watch() -> None:
        said = None
        while not done.wait(min(10.0, limit / 10)):
            changed, waited = _changed[0], time.monotonic() - _changed[0]
            if waited > limit and said != changed:
                said = changed
                out.write(stall_message(rank, timeout_minutes, waited) + "\n")
                out.flush()

    threading.Thread(target=watch, name="ft-stall-watch", daemon=True).start()
    return done


def doing() -> str:
    """What this rank is doing, outermost first (e.g. "step 12 of 100: forward/backward of micro-batch 2 of 4")."""
    return ": ".join(_doing[1:]) or _doing[0]


def failed_during() -> str:
    """What this rank was doing when an exception (an error, a Ctrl-C) first left an activity; else what it does now."""
    return (_failed_during or [doing()])[0]


@dataclass(frozen=True)
class Runtime:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    # plan.tensor_parallel and plan.context_parallel: consecutive ranks of one tp × cp block train on the same rows
    # (distributed/mesh.py); those of one tp group also compute on the same tokens
    tensor_parallel: int = 1
    context_parallel: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def replicas(self) -> int:
        """How many consecutive ranks train on the same rows (one tp × cp block)."""
        return self.tensor_parallel * self.context_parallel

    @property
    def data_rank(self) -> int:
        """Which share of each step's rows this rank trains on (the same for every rank of a tp × cp block)."""
        return self.rank // self.replicas

    @property
    def data_world(self) -> int:
        """How many shares each step's rows are dealt into (data-parallel groups)."""
        return self.world_size // self.replicas

    @property
    def leads_replicas(self) -> bool:
        """The first rank of its tp × cp block: where a value all ranks of the block hold alike is counted once."""
        return self.rank % self.replicas == 0

    def with_parallel(self, tensor_parallel: int, context_parallel: int) -> Runtime:
        """This runtime with the plan's tensor- and context-parallel degrees (a single process keeps 1 and 1)."""
        if self.world_size == 1:
            return self
        if self.world_size % (tensor_parallel * context_parallel):
            raise ValueError(
                f"world size {self.world_size} is not divisible by tensor_parallel {tensor_parallel} × "
                f"context_parallel {context_parallel}"
            )
        return replace(self, tensor_parallel=tensor_parallel, context_parallel=context_parallel)

    def distinct_sum(self, value: float) -> float:
        """Sum over ranks of a count that the ranks of one tensor-parallel group hold alike (they compute on the same
        tokens; context-parallel ranks each count their own part of a sequence): each tp group counted once."""
        return self.sum(value if self.rank % self.tensor_parallel == 0 else 0.0)

    def sum(self, value: float) -> float:
        """Sum of a number over all ranks."""
        if self.world_size == 1:
            return value
        t = torch.tensor([float(value)], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return float(t.item())

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        """Each value averaged over ranks (every rank reports the same keys), in one collective."""
        if self.world_size == 1 or not values:
            return dict(values)
        t = torch.tensor(list(values.values()), dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return {k: float(v) / self.world_size for k, v in zip(values, t.tolist())}

    def largest(self, value: int) -> int:
        """The largest of an integer over all ranks (e.g. the stop signal one rank received, 0 on the others)."""
        if self.world_size == 1:
            return int(value)
        t = torch.tensor([int(value)], dtype=torch.int64)  # host memory: gloo's half of the group (`backend`)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on one (e.g. a rank whose checkpoint write failed)."""
        return self.largest(1 if flag else 0) > 0

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()


def data_share(runtime) -> tuple[int, int, bool]:
    """(data rank, data world, leads its block) of a Runtime, or of any record with only `rank` and `world_size`
    (plain data parallelism: every rank its own share)."""
    if isinstance(runtime, Runtime):
        return runtime.data_rank, runtime.data_world, runtime.leads_replicas
    return runtime.rank, runtime.world_size, True


def launched() -> bool:
    """True inside a process started by torchrun (or another launcher that sets the standard variables)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def start(timeout_minutes: float) -> Runtime:
    """Join the process group torchrun set up (see `backend`), a group of one too (the plan asks for one where the
    backend needs it: FSDP2, DeepSpeed). A process no launcher started gets a no-op Runtime."""
    if not launched():
        return Runtime()
    rank, local, world = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        # ft's launchers set them for the whole process; here for a rank started without torchrun (a torchrun
        # started by hand has already given it TORCH_NCCL_ASYNC_ERROR_HANDLING=1 unless its own environment had one)
        for name, value in NCCL_ENV:
            os.environ.setdefault(name, value)
    if not torch.distributed.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        store = _all_started(rank, world, max(timeout_minutes, STARTUP_MINUTES))
        store.set_timeout(timeout)
        # what init_process_group does with env:// itself, on a store whose ranks have all arrived
        store = torch.distributed.PrefixStore("default_pg", store)
        torch.distributed.init_process_group(backend(), store=store, rank=rank, world_size=world, timeout=timeout)
    if torch.cuda.is_available() and world > 1:  # NCCL aborts a stuck rank itself: explain it first
        watch_for_stalls(rank, timeout_minutes)
    return Runtime(rank, local, world)


STARTUP_MINUTES = 10.0  # how long ranks wait for one another to start (imports, a slow node), at least


def _all_started(rank: int, world: int, minutes: float):
    """The launcher's store once every rank has reached it. Ranks start seconds apart (imports, a loaded node); the
    job's collective timeout (distributed.timeout_minutes, which may be short) is for the collectives, so the ranks
    first meet here with STARTUP_MINUTES, and the group's own connection then finds them all present."""
    wait = datetime.timedelta(minutes=minutes)
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    round_ = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun keeps its store across restarts
    keys = [f"ft/started/{round_}/{r}" for r in range(world)]
    store = None
    try:
        store, _, _ = next(torch.distributed.rendezvous("env://", rank, world, timeout=wait))
        store.set(keys[rank], "1")
        store.wait(keys, wait)
    except RuntimeError:  # torch's DistStoreError: the store or a rank did not come within the wait
        missing = "" if store is None else f" (ranks {[r for r, k in enumerate(keys) if not store.check([k])]})"
        raise LostPeers(
            f"rank {rank} waited {minutes:g} min for the job's {world} ranks to start and meet at {where}; not all "
            f"did{missing}: a node that did not come up, or a rank that failed before joining (see its output)"
        ) from None
    return store


def nccl_environment(run_dir) -> dict[str, str]:
    """The NCCL/torch variables for the ranks of a run (each unless already set): NCCL_ENV, with the collective
    traces of a timeout dumped into RUN/nccl-traces/."""
    from finetune.artifacts.run import RunFolder

    traces = RunFolder(run_dir).nccl_traces_dir
    env = {k: os.environ.get(k, v) for k, v in NCCL_ENV}
    for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):  # the newer name, the older one
        env[name] = os.environ.get(name, str(traces / "rank-"))
    return env


def backend() -> str:
    """One process group for both kinds of tensor: NCCL takes only CUDA tensors, so CPU tensors (ft's scalar
    reductions, offloaded gradients, tables kept in host RAM) go over gloo in the same group (torch's
    "device:backend" form, which ProcessGroup dispatches on each tensor's device)."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


_TIMEOUT = ("timed out", "timeout", "deadline")
_PEER_GONE = ("connection closed", "connection reset", "broken pipe", "connection refused", "peer")


@contextlib.contextmanager
def explained_failures(timeout_minutes: float):
    """Turn a failed collective into an error naming this rank, the collective's timeout and what the rank was
    doing (LostPeers: another attempt may succeed)."""
    try:
        yield
    except RuntimeError as e:  # torch.distributed's backend errors are RuntimeErrors
        text = str(e).lower()
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            raise
        rank, during = torch.distributed.get_rank(), failed_during()
        if any(k in text for k in _TIMEOUT):
            raise LostPeers(
                f"rank {rank} waited {timeout_minutes:g} min for the other ranks during {during} and gave up: "
                "another rank is "
                "stuck or died (its output above says which), or a step takes longer than distributed.timeout_minutes; "
                f"raise it if the job is only slow. ({str(e).strip().splitlines()[0][:200]})"
            ) from None
        if any(k in text for k in _PEER_GONE):
            raise LostPeers(
                f"rank {rank} lost its connection to another rank during {during}: that rank exited or crashed "
                f"(its error is above). ({str(e).strip().splitlines()[0][:200]})"
            ) from None
        raise
