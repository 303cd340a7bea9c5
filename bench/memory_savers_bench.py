"""Peak memory and tokens/s of ft's memory savers side by side, in one run: plain, chunked loss, bf16-pure,
activation offload, selective and full activation checkpointing.

Each column is one Plan, built by ft's planner from a job that sets the saver's key explicitly (every other saver off),
and runs ft's own loop (finetune/train.py setup and train_step), so the figures are what `ft train` would do. The job:
full fine-tuning of a small Llama built here (vocabulary 32k so that the logits matter, hidden 256, 4 layers), packed
rows of --seq-len tokens, --micro rows per micro-batch, one micro-batch per step, one thread.

Per column: one warm-up step (optimizer states exist after it) and one step measured for memory; then one untimed
and --steps timed rounds of one step of each column in turn (CPU time of this process on the CPU, wall time on a GPU).
Peak memory: on the CPU, torch has no max_memory_allocated, so the bytes of the column's live tensors at the step's
start (every tensor the garbage collector can reach, each storage once, less those that existed before the column's
setup) plus the highest running total of the CPU allocator's allocations during the step, read from torch.profiler's
memory events (profile_memory=True); on a GPU, torch.cuda.max_memory_allocated over the step, less what was allocated
before the column's setup. On the CPU, activation offload cannot lower the peak (the "host" is the same memory): its
column shows what the copies cost. Each column's step losses and gradient norms are compared with plain's (the same
rows, step by step).

    OMP_NUM_THREADS=1 python bench/memory_savers_bench.py [--steps 3] [--seq-len 512] [--micro 2]
    python bench/memory_savers_bench.py --device cuda --columns "plain,activation offload" \
        --expect-lower "activation offload" --loss-tolerance 2e-3       (scripts/gpu-check.sh, section savers)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402
from common import build_llama  # noqa: E402

torch.set_num_threads(1)

MiB = 2**20
# column: the train keys its job sets (on top of BASE) and the Plan fields it must get
COLUMNS = {
    "plain": ({}, {}),
    "chunked loss": ({"loss_implementation": "chunked"}, {"loss_implementation": "chunked"}),
    "bf16-pure": ({"precision": "bf16-pure"}, {"precision": "bf16", "pure_bf16": True}),
    "activation offload": ({"activation_offload": True}, {"activation_offload": True}),
    "checkpoint 2/4": (
        {"gradient_checkpointing": True, "checkpoint_layers": 2},
        {"gradient_checkpointing": True, "checkpoint_layers": 2},
    ),
    "checkpoint 4/4": (
        {"gradient_checkpointing": True, "checkpoint_layers": 4},
        {"gradient_checkpointing": True, "checkpoint_layers": 4},
    ),
}
BASE = {  # every saver off, stated explicitly so that no `auto` picks one (precision: per device, see run)
    "loss_implementation": "plain",
    "gradient_checkpointing": False,
    "checkpoint_layers": 0,
    "activation_offload": False,
    "optimizer_in_backward": False,
}
OFF = {
    "pure_bf16": False,
    "loss_implementation": "plain",
    "gradient_checkpointing": False,
    "checkpoint_layers": 0,
    "activation_offload": False,
    "optimizer_in_backward": False,
}


# ---------------------------------------------------------------- the model, the data, the jobs
def build_model(folder: Path, vocab: int, hidden: int, layers: int) -> int:
    """A Llama with ft-tiny's tokenizer and a `vocab`-row output head (the rows past the tokenizer's are never
    targets, but their logits are computed like any other); returns its parameter count."""
    return build_llama(folder, vocab, hidden, layers, tied=False, max_positions=4096)


def write_data(path: Path, rows: int) -> Path:
    rng = random.Random(0)
    words = "the model learns to add numbers and answer questions about text data while training".split()
    with path.open("w") as f:
        for _ in range(rows):
            user = " ".join(rng.choice(words) for _ in range(rng.randint(20, 80)))
            answer = " ".join(rng.choice(words) for _ in range(rng.randint(40, 160)))
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def job_text(tmp: Path, data: Path, seq_len: int, micro: int, train: dict) -> str:
    keys = ", ".join(f"{k}: {json.dumps(v)}" for k, v in {**BASE, **train}.items())
    return f"""
model: {{name: {tmp / "model"}, attn_implementation: sdpa}}
data: {{datasets: [{{path: {data}, format: chat}}], seq_len: {seq_len}, packing: true, cache_dir: {tmp / "cache"}}}
adapter: {{type: full}}
train: {{global_batch_size: {micro}, micro_batch_size: {micro}, max_steps: 1000, lr: 1.0e-4, warmup_steps: 0,
  {keys}}}
output: {{dir: {tmp / "run"}, save_steps: 0}}
"""


def column_plan(text: str, plain_text: str, want: dict, hardware, chunk_tokens: int, tokens: int):
    """The column's Config and Plan from ft's planner, and notes on anything the benchmark had to set itself (a
    saver the planner refused or planned otherwise here, a chunk that would hold the whole micro-batch)."""
    from finetune.config import loads
    from finetune.errors import FtError
    from finetune.plan import plan
    from finetune.workflow import model_facts

    notes = []
    try:
        config = loads(text)
        planned = plan(config, hardware, model_facts(config.model))
    except FtError as e:  # e.g. a check that keeps a GPU-only saver off the CPU
        config = loads(plain_text)
        planned = plan(config, hardware, model_facts(config.model))
        notes.append(f"planner refused the job ({str(e).splitlines()[0][:90]}); Plan fields set")
    fields = {**OFF, **want}
    differ = {k: v for k, v in fields.items() if getattr(planned, k) != v}
    if differ:
        notes.append("planner gave " + ", ".join(f"{k}={getattr(planned, k)!r}" for k in differ) + "; set")
        planned = dataclasses.replace(planned, **differ)
    if planned.loss_implementation == "chunked" and not 0 < planned.loss_chunk_tokens < tokens:
        notes.append(
            f"chunk {planned.loss_chunk_tokens} -> {chunk_tokens} tokens (the planner's holds the micro-batch)"
        )
        planned = dataclasses.replace(planned, loss_chunk_tokens=chunk_tokens)
    return config, planned, notes


# ---------------------------------------------------------------- measuring
def live_storages(device_type: str) -> dict[int, int]:
    """Every tensor storage on `device_type` that the garbage collector reaches: its address -> its bytes."""
    storages = {}
    with warnings.catch_warnings():  # isinstance on deprecated objects (torch.distributed.reduce_op) warns
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for t in tensors:
        if t.device.type == device_type and not t.is_meta:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return storages


def allocation_peak(prof) -> int:
    """The highest running total of CPU allocations during a profiled region, relative to its start (from the
    profiler's allocation events: each carries the allocator's running total)."""
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        todo.extend(node.children)
        fields = node.extra_fields
        if hasattr(fields, "total_allocated") and hasattr(fields, "alloc_size") and fields.device.type == "cpu":
            events.append((node.start_time_ns, fields.alloc_size, fields.total_allocated))
    if not events:
        return 0
    events.sort()
    start = events[0][2] - events[0][1]
    return max(total for _, _, total in events) - start


def step_peak(step, device: torch.device, others: dict[int, int]) -> int:
    """Peak bytes of tensors during one call of `step`, not counting the storages in `others` (the other columns'
    jobs); see the module's docstring for how, per device."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(device) - sum(others.values())
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    before = sum(n for ptr, n in live_storages("cpu").items() if ptr not in others)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return before + allocation_peak(prof)


def timed(step, device: torch.device) -> tuple[int, float]:
    """(tokens, seconds) of one step: CPU time of this process on the CPU (other processes' load does not count),
    wall time on a GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = step()["tokens"]
        torch.cuda.synchronize()
        return tokens, time.perf_counter() - start
    start = time.process_time()
    tokens = step()["tokens"]
    return tokens, time.process_time() - start


@dataclasses.dataclass
class Column:
    """One saver's job in ft's loop and what was measured of it."""

    name: str
    job: object
    notes: list[str]
    peak: int = 0
    losses: list[float] = dataclasses.field(default_factory=list)  # every step's loss and gradient norm, in order
    tokens: int = 0
    seconds: float = 0.0

    def step(self) -> dict:
        from finetune.train import train_step

        metrics = train_step(self.job)
        self.losses += [metrics["loss"], float(metrics["grad_norm"] or 0.0)]
        return metrics

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def start_column(name: str, config, planned, prepared, device: torch.device, notes: list[str]) -> Column:
    """ft's loop on this Plan, one warm-up step done (the optimizer's states exist from then on), one measured."""
    from finetune.train import setup

    gc.collect()
    others = {0: torch.cuda.memory_allocated(device)} if device.type == "cuda" else live_storages("cpu")
    column = Column(name, setup(config, planned, prepared, device=device), notes)
    column.step()
    column.peak = step_peak(column.step, device, others)
    return column


def time_columns(columns: list[Column], device: torch.device, steps: int) -> None:
    """`steps` rounds of one timed step of each column in turn (machine noise hits all alike), after one untimed."""
    for column in columns:
        column.step()  # the others' setups ran since its last step: what they freed is back in use
    for _ in range(steps):
        for column in columns:
            tokens, seconds = timed(column.step, device)
            column.tokens += tokens
            column.seconds += seconds


# ---------------------------------------------------------------- the table, and the checks scripts/gpu-check.sh asks
def table(columns: list[Column]) -> str:
    plain = columns[0]
    lines = [f"{'saver':<20} {'peak MiB':>9} {'x plain':>8} {'tokens/s':>9} {'x plain':>8} {'vs plain':>9}  notes"]
    for c in columns:
        ratios = f"{c.peak / plain.peak:8.2f} {c.tokens_per_s:9.0f} {c.tokens_per_s / plain.tokens_per_s:8.2f}"
        figures = f"{c.peak / MiB:9.1f} {ratios} {loss_difference(c, plain):9.1e}"
        lines.append(f"{c.name:<20} {figures}  {'; '.join(c.notes)}".rstrip())
    return "\n".join(lines)


def loss_difference(column: Column, plain: Column) -> float:
    """The largest relative difference of the column's step losses and gradient norms from plain's (the same rows,
    step by step)."""
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(column.losses, plain.losses))


def failed_checks(columns: list[Column], lower: list[str], loss_tolerance: float | None) -> list[str]:
    plain, failures = columns[0], []
    for c in columns[1:]:
        if c.name in lower and c.peak >= plain.peak:
            failures.append(f"{c.name}: peak {c.peak / MiB:.1f} MiB is not below plain's {plain.peak / MiB:.1f} MiB")
        if loss_tolerance is not None and c.name != "bf16-pure" and loss_difference(c, plain) > loss_tolerance:
            failures.append(
                f"{c.name}: losses or gradient norms differ from plain's by {loss_difference(c, plain):.1e}"
            )
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per column")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro", type=int, default=2, help="rows per micro-batch (one micro-batch per step)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--chunk-tokens", type=int, default=256, help="chunked loss, where the plan's chunk is larger")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--columns", default=",".join(COLUMNS), help="comma-separated, from: " + ", ".join(COLUMNS))
    parser.add_argument("--expect-lower", default="", help="columns whose peak must be below plain's (else exit 1)")
    parser.add_argument(
        "--loss-tolerance",
        type=float,
        help="exit 1 if a column's step losses or gradient norms (bf16-pure aside) differ more from plain's",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    names = [c.strip() for c in args.columns.split(",")]
    lower = [c.strip() for c in args.expect_lower.split(",") if c.strip()]
    unknown = [n for n in names + lower if n not in COLUMNS]
    if unknown or names[0] != "plain":
        parser.error(f"--columns: {unknown or names} (known: {', '.join(COLUMNS)}; the first must be plain)")
    device = torch.device(args.device)
    columns, params = run(args, names, device)
    report(args, columns, params, device)
    failures = failed_checks(columns, lower, args.loss_tolerance)
    for failure in failures:
        print(f"FAILED: {failure}")
    raise SystemExit(1 if failures else 0)


def run(args, names: list[str], device: torch.device) -> tuple[list[Column], int]:
    from finetune.data.preprocess import prepare
    from finetune.hardware import parse, probe

    hardware = probe() if device.type == "cuda" else parse("cpu")
    precision = "bf16" if device.type == "cuda" else "fp32"  # plain: mixed precision on GPUs, fp32 on the CPU
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        params = build_model(tmp / "model", args.vocab, args.hidden, args.layers)
        data = write_data(tmp / "chat.jsonl", 40 * args.micro * (args.steps + 3))
        columns, prepared = [], None
        for name in names:
            train, want = COLUMNS[name]
            plain_keys = {"precision": precision}
            text, plain = (job_text(tmp, data, args.seq_len, args.micro, {**plain_keys, **k}) for k in (train, {}))
            want = {**plain_keys, **want}
            config, planned, notes = column_plan(
                text, plain, want, hardware, args.chunk_tokens, args.micro * args.seq_len
            )
            prepared = prepared or prepare(config)  # the same data for every column
            columns.append(start_column(name, config, planned, prepared, device, notes))
            print(f"  {name}: peak {columns[-1].peak / MiB:.1f} MiB", flush=True)
        time_columns(columns, device, args.steps)
    return columns, params


def report(args, columns: list[Column], params: int, device: torch.device) -> None:
    print(
        f"\nfull fine-tuning of a {params / 1e6:.1f}M-parameter Llama (vocab {args.vocab}, hidden {args.hidden}, "
        f"{args.layers} layers), {args.micro} x {args.seq_len} tokens per step, {args.steps} timed steps each, "
        f"{device.type}, {torch.get_num_threads()} thread(s); tokens/s: per "
        + ("second" if device.type == "cuda" else "CPU-second of this process")
    )
    print(
        "peak memory: "
        + (
            "torch.cuda.max_memory_allocated over one step (less the other columns')"
            if device.type == "cuda"
            else "the column's live tensors at the step's start (gc scan) + the CPU allocator's highest running "
            "total during the step (torch.profiler memory events); offload on the CPU copies to the same memory"
        )
    )
    print("vs plain: the largest relative difference of the column's step losses and gradient norms from plain's")
    print(table(columns))
    if args.json:
        figures = [
            {
                "saver": c.name,
                "peak_bytes": c.peak,
                "tokens_per_s": c.tokens_per_s,
                "losses": c.losses,
                "notes": c.notes,
            }
            for c in columns
        ]
        args.json.write_text(json.dumps({"device": device.type, "columns": figures}, indent=1))


if __name__ == "__main__":
    main()
