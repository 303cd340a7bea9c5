"""run(): load -> adapt -> loop -> save. The one training loop of ft, for every method and backend.

The loop never branches on the method (methods supply micro-batches and a loss) nor on the backend
(backends wrap the model). Per step: the step's rows from the data stream, the normaliser for the
whole step's trained tokens, forward/backward per micro-batch, clipping, optimizer and schedule,
then logging, evaluation, checkpoints, and a clean stop on SIGTERM/SIGINT.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from finetune import checkpoint
from finetune.activations import offloading
from finetune.artifacts.run import RunFolder
from finetune.config.schema import Config
from finetune.data.collate import to_device
from finetune.data.stream import Stream, steps_for
from finetune.distributed import lifecycle
from finetune.distributed.runtime import Runtime, activity, start
from finetune.errors import FtError, Stopped
from finetune.methods import Method
from finetune.methods.loss import host_values, step_normaliser  # host_values: the step's one read of the device
from finetune.methods.router import Routing
from finetune.plan.plan import Plan
from finetune.progress import method_fields


@dataclass
class Job:
    """Everything the loop works with, built once by `setup`."""

    config: Config
    plan: Plan
    engine: object  # the wrapped model with its optimizer and schedule (distributed/engine.py)
    method: Method
    train: object
    validation: object | None
    stream: Stream
    total_steps: int
    device: torch.device
    runtime: Runtime
    routing: Routing = field(default_factory=Routing)  # an MoE model's routers (methods/router.py); inert if dense

    @property
    def model(self):
        """The model as the backend wrapped it: what forward passes run on."""
        return self.engine.model

    @property
    def inner(self):
        """The model without its data-parallel wrapper (for saving, generation)."""
        return self.engine.inner


class SignalStop:
    """Turns SIGTERM/SIGINT/SIGUSR1 into a request to stop after the current step.

    Copies of one signal that arrive within lifecycle.REPEAT_WINDOW_S count as one: a terminal's Ctrl-C, a
    scheduler that signals every process, the launcher's request and the parent's death can all deliver the
    same stop. After that a deliberate second Ctrl-C (SIGINT) stops at once (KeyboardInterrupt), unless a
    checkpoint is being written (`saving`); a scheduler's repeated SIGTERM/SIGUSR1 is ignored, so that the stop
    under way ends with its checkpoint. Outside the loop a rank follows lifecycle.start_rank: stop at once while
    setting up, finish the final save after it."""

    def __init__(self):
        self.signum = 0
        self._received = False
        self._saving = False
        self._old = {}

    def __enter__(self):
        lifecycle.reset_signals()
        for sig in lifecycle.STOP_SIGNALS:
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if lifecycle.note(signum) == "repeat":
            if signum == signal.SIGINT and self._received:  # a person's Ctrl-C, also forwarded as SIGTERM by the
                self.signum = signal.SIGINT  # launcher, which may arrive first: the stop is the person's
            return
        if self._received and (self._saving or signum != signal.SIGINT):
            # a checkpoint is written, or a scheduler signals again (cgroup tracking): the stop under way goes on
            doing = "while the checkpoint is written" if self._saving else "while this rank stops after its step"
            sys.stderr.write(f"ft: {lifecycle.signal_name(signum)} ignored {doing}\n")
            return
        if self._received:  # a person's second Ctrl-C: stop now
            raise KeyboardInterrupt
        self._received = True
        self.signum = self.signum or signum

    @contextlib.contextmanager
    def saving(self):
        """While a checkpoint is written: a second signal is ignored (the launcher is told, too)."""
        self._saving = True
        lifecycle.mark_saving(True)
        try:
            yield
        finally:
            lifecycle.mark_saving(False)
            self._saving = False

    def __exit__(self, exc_type, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        if exc_type is None:
            lifecycle.loop_finished()  # a rank now finishes saving the final weights on a first signal


def setup(config: Config, plan: Plan, prepared, device: torch.device | None = None, deepspeed_config=None) -> Job:
    """The job's model, engine and method on this rank. `deepspeed_config`: the run folder's deepspeed.json (a caller
    without a run folder, a test's, gets what ft train would write there)."""
    from finetune import methods
    from finetune.distributed import engine
    from finetune.models import runtime_attention

    if plan.backend == "deepspeed" and deepspeed_config is None:
        from finetune.distributed.deepspeed import config_for

        deepspeed_config = config_for(plan, config.train, config.distributed)

    with activity("joining the process group"):
        runtime = start(config.distributed.timeout_minutes) if plan.process_group else Runtime()
        # the ranks of a tp × cp block share rows
        runtime = runtime.with_parallel(plan.tensor_parallel, plan.context_parallel)
    torch.manual_seed(config.train.seed)
    device = device or (torch.device("cuda", runtime.local_rank) if torch.cuda.is_available() else torch.device("cpu"))
    attn = runtime_attention(config.model, plan.attn_implementation, plan.context_parallel, plan.flash_upgrade)
    if device.type == "cpu":  # CPU training allocates and frees the same large buffers every step
        from finetune.distributed.hostmem import keep_freed_memory, return_freed_memory

        if plan.process_group:  # ranks sharing a host hand freed buffers back: their peaks add up
            return_freed_memory()
        else:  # one process keeps them for the next step
            keep_freed_memory()
    with activity(f"creating the model ({plan.loading})"):
        model = engine.create_model(engine.ModelSpec(config, plan, prepared.tokenizer, attn, device, deepspeed_config))
    model.train()
    rows = config.method.rows_per_step(plan.global_batch_size)
    total = steps_for(
        len(prepared.train), rows, config.train.max_steps, config.train.epochs, config.method.steps_per_batch()
    )
    with activity(f"wrapping the model ({plan.backend})"):
        wrapped = engine.build(model, plan, config.train, deepspeed_config, device, total, config.method.summed_loss)
    stream = Stream(
        len(prepared.train),
        rows,
        config.train.seed,
        runtime.data_rank,
        runtime.data_world,
        repeat=config.method.steps_per_batch(),
    )
    with activity(f"setting up {config.method.name}"):
        method = methods.build(
            config, plan, prepared, attn, wrapped, device, runtime, lambda: autocast_for(plan.precision, device), stream
        )
    validation = prepared.validation if method.validates else None
    routing = Routing.attach(wrapped.model, config.train.router_aux_loss_coef)
    return Job(config, plan, wrapped, method, prepared.train, validation, stream, total, device, runtime, routing)


def autocast_for(precision: str, device: torch.device):
    """Mixed precision for the forward pass: fp32 weights (full) or a half-precision base, computing in the plan's
    precision."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def autocast(job: Job):
    return autocast_for(job.plan.precision, job.device)


def train_step(job: Job) -> dict:
    """One optimizer step over the global batch; returns its metrics."""
    rt = job.runtime
    # each rank's part of every micro-batch (its share of each sequence under context parallelism) before counting
    batches = [job.engine.local(b) for b in job.method.micro_batches(job.train, job.stream.next_step())]
    with activity("summing the step's trained tokens over ranks"):
        counts = [job.method.tokens(b) for b in batches]
        normaliser = step_normaliser(sum(counts), rt.world_size, rt.sum)
    loss_total, tokens, reported = 0.0, 0, [batches[0].pop("metrics", {})]  # the rollout's metrics (GRPO)
    for i, batch in enumerate(batches):
        tokens += batch.pop("num_tokens", 0)
        batch = to_device(batch, job.device)  # tensors and per-layer-type masks
        with (
            activity(f"forward/backward of micro-batch {i + 1} of {len(batches)}"),
            job.engine.accumulating(last=i == len(batches) - 1),
        ):
            # saved activations in host memory if planned; an MoE model's routers recorded (methods/router.py)
            with autocast(job), offloading(job.plan.activation_offload), job.routing.recording(batch):
                loss, metrics = job.method.loss(job.model, batch, normaliser)
                loss = job.routing.add_loss(loss, counts[i] / normaliser)  # its load-balancing loss, if any
            job.engine.backward(loss)
        loss_total = loss_total + loss.detach().double()  # summed on the device (float64): read once, after the step
        reported.append(metrics)
    with activity("optimizer step (gradient reduction, clipping, update)"):
        grad_norm = job.engine.step()
        sums, counts = _summed_metrics(reported)  # the method's metrics, summed on the device
        loss_total, grad_norm, aux_total, *values = host_values(
            loss_total, grad_norm, job.routing.step_total(), *sums.values()
        )
        # each rank's share is scaled by world size (see methods/loss.py)
        loss_total = rt.sum(loss_total) / rt.world_size
    with activity("averaging the method's metrics over ranks"):
        extra = rt.mean({k: v / counts[k] for k, v in zip(sums, values)})  # each over the micro-batches reporting it
    if job.routing.coef:  # the load-balancing loss, before its coefficient (trl's aux_loss)
        extra["aux_loss"] = rt.sum(aux_total) / rt.world_size
    tokens = int(rt.distinct_sum(tokens))  # a tensor-parallel group's ranks all hold the same tokens: counted once
    return {"loss": loss_total, "grad_norm": grad_norm, "lr": job.engine.lr(), "tokens": tokens, **extra}


def _summed_metrics(reported: list[dict]) -> tuple[dict, dict[str, int]]:
    """Each metric summed over the micro-batches that report it (0-dim device tensors stay there; numbers, such as a
    rollout's, stay numbers), and how many report it."""
    keys = dict.fromkeys(k for m in reported for k in m)
    return {k: sum(m[k] for m in reported if k in m) for k in keys}, {k: sum(k in m for m in reported) for k in keys}


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def save_checkpoint(job: Job, run_dir: Path, step: int, extra: dict) -> Path:
    """Every rank takes part; the engine writes its own format (shards, or one copy from rank 0)."""
    # this step's data position, never an older one carried in `extra`
    state = {**extra, "position": job.stream.position, "served": job.stream.served}
    return checkpoint.save(
        run_dir, step, job.engine, state, job.config.output.keep_checkpoints, job.runtime, method=job.method
    )


def run(
    job: Job, run_dir: Path, resume_from: Path | None = None, on_step=None, stop: SignalStop | None = None, hooks=()
) -> dict:
    """Train from step 0 or from a checkpoint; save checkpoints, the final weights; return a summary.

    `hooks` (tests and debugging; rank.step_hooks): each is called as hook(rank, step) at the start of every step.
    A hook may raise (a failing rank), sleep (a rank that stops responding) or return True (stop after this step,
    as if SIGTERM had arrived)."""
    from finetune.evaluate import validation_metrics
    from finetune.metrics import MetricsWriter

    out = job.config.output
    start, state = 0, {"tokens": 0, "seconds": 0.0}
    if resume_from is not None:
        saved = checkpoint.load(resume_from, job.engine, job.runtime, method=job.method)
        start, job.stream.position = saved["step"], saved["position"]
        job.stream.served = saved.get("served", job.stream.repeat)  # older checkpoints: at a batch boundary
        # running totals only: position and stop cause are per checkpoint
        state = {"tokens": saved["tokens"], "seconds": saved["seconds"]}
    # From step 0 too: a fresh start in a folder an earlier attempt wrote to (resume: auto before any checkpoint) starts
    # a fresh log.
    metrics = (
        MetricsWriter(RunFolder(run_dir).metrics_path, resume_from_step=start) if job.runtime.is_main else _NoMetrics()
    )
    stop = stop or SignalStop()
    last = {}
    with stop:
        for step in range(start + 1, job.total_steps + 1):
            t0 = time.perf_counter()
            with activity(f"step {step} of {job.total_steps}"):
                stop_after = any([hook(job.runtime.rank, step) is True for hook in hooks])  # a list: every hook runs
                last = train_step(job)
            seconds = time.perf_counter() - t0
            state["tokens"] += last["tokens"]
            state["seconds"] += seconds
            row = {
                **last,
                "tokens_per_s": last["tokens"] / max(seconds, 1e-9),
                "epoch": job.stream.epoch,
                "memory_gib": peak_memory_gib(job.device),
            }
            if step % out.log_steps == 0 or step == job.total_steps:
                row.update(job.routing.utilisation(job.runtime))  # every rank: expert use since the last log
                metrics.log(step, **row)
            # the last: below
            if job.validation is not None and out.eval_steps and step % out.eval_steps == 0 and step < job.total_steps:
                with activity(f"validation at step {step}"):
                    metrics.log(
                        step,
                        **validation_metrics(job.model, job.method, job.validation, job.device, lambda: autocast(job)),
                    )
            if on_step is not None:
                on_step(step, job.total_steps, row)
            if out.save_steps and step % out.save_steps == 0 and step < job.total_steps:
                with activity(f"saving the checkpoint of step {step}"), stop.saving():
                    save_checkpoint(job, run_dir, step, state)
            if stop_after:
                stop.signum = stop.signum or signal.SIGTERM
            with activity(f"agreeing after step {step} whether to stop"):
                # the signal itself, not only whether one came: a rank that has not yet heard it (its watchdog
                # reads the launcher's request between polls) stops after the same step, for the same reason
                signum = job.runtime.largest(int(stop.signum))
            if signum:  # every rank stops after the same step
                with activity(f"saving the checkpoint of step {step}"), stop.saving():
                    path = save_checkpoint(job, run_dir, step, {**state, "stopped_by": signal.Signals(signum).name})
                metrics.close()
                raise Stopped(
                    f"stopped by {signal.Signals(signum).name} after step {step} of {job.total_steps}; "
                    f"checkpoint saved to {path}. Resume with: ft train CONFIG --resume",
                    signum,
                )
    result = {
        "steps": job.total_steps,
        "final_loss": last.get("loss"),
        # what the method's progress lines show (GRPO: rewards, KL, completion length; DPO: margin, accuracy)
        "final_metrics": dict(method_fields(job.config.method.progress_metrics, last)),
        "seconds": state["seconds"],
        "tokens": state["tokens"],
    }
    if job.validation is not None:
        final = validation_metrics(job.model, job.method, job.validation, job.device, lambda: autocast(job))
        result["final_eval_loss"] = final["eval_loss"]
        result.update({f"final_{k}": v for k, v in final.items() if k != "eval_loss"})
        metrics.log(job.total_steps, **final)
    metrics.close()
    return result


def save_final(job: Job, run_dir: Path, tokenizer) -> Path:
    """The trained adapter (peft format) or model (safetensors, in output.save_dtype), with the tokenizer, in RUN/final
    (rank 0 writes)."""
    from finetune.artifacts.weights import final_dtype, record_dtype, saved_state

    final, full = RunFolder(run_dir).final, job.plan.adapter == "full"
    dtype = final_dtype(job.config.output, job.plan)
    with activity("gathering the final weights"):
        state = job.engine.full_state_dict(trainable_only=not full, dtype=dtype)  # a collective where sharded
    failed = None
    if job.runtime.is_main:
        try:
            if state is None and full:  # whole on this rank: cast tensor by tensor into host memory
                state = saved_state(job.inner, dtype)
            # a full disk leaves no half-written final/
            with checkpoint.atomic_folder(final, "the final weights") as tmp:
                job.inner.save_pretrained(str(tmp), **({"state_dict": state} if state is not None else {}))
                if full:
                    record_dtype(tmp, dtype)
                tokenizer.save_pretrained(str(tmp))
            if job.plan.head == "score" and job.plan.adapter != "full":
                merge_reward_adapter(job.config.model, final, job.plan.adapter == "qlora")
        except FtError as e:
            failed = e
    job.runtime.barrier()  # every rank, also when rank 0 failed (it raises after this, the others end)
    if failed is not None:
        raise failed
    return final


def merge_reward_adapter(model_section, final: Path, qlora: bool) -> None:
    """A reward model trained with an adapter: final/ becomes the base with the adapter merged in, a folder that
    transformers loads as AutoModelForSequenceClassification (and GRPO as a reward), as `ft merge-lora` would write
    it (its card, final/README.md, records the largest score difference of the merge). The adapter moves to
    final/adapter/."""
    from finetune.merge import merge_lora, read_record, write_record
    from finetune.models import model_path

    adapter = final.with_name(final.name + ".adapter")
    if adapter.exists():  # left by an interrupted save of this run
        shutil.rmtree(adapter)
    final.rename(adapter)
    merge_lora(adapter, final, base=model_path(model_section), trust_remote_code=model_section.trust_remote_code)
    adapter.rename(final / "adapter")
    report = read_record(final)
    report.update(adapter=str(final / "adapter"), tokenizer=str(final / "adapter"), qlora=qlora)
    if qlora:
        report["notes"] = [*report["notes"], "merged into the unquantized base; training saw the 4-bit base"]
    write_record(final, report)


class _NoMetrics:
    """What ranks other than 0 log to."""

    def log(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass
