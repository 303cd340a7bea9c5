"""ft and a plain torch + peft loop side by side on one tiny LoRA SFT job, as a user comparing tools would run them.

The job: a 5.3M-parameter Llama built here (ft-tiny's tokenizer, 6 layers of width 256, untied head), 2,000 alpaca
records generated here (instruction / optional input / output), micro-batch 4, seq_len 256, LoRA r 8 on every linear
projection, fp32, one thread (OMP_NUM_THREADS=1). Each tool trains in a process of its own:
- ft: `ft train JOB --hardware cpu` with `data.template: alpaca`, a fresh data cache each run (`--warm-cache`: one
  cache for all rounds); its FT_STEP_HOOK (`ft_hook` below) stamps the start of every step.
- plain loop: `python bench/peers.py --child plain ...`: the loop one writes by hand (the alpaca prompt by f-string,
  prompt tokens masked, micro-batches padded to their longest row, forward with the model's own loss, backward,
  AdamW; no clipping, no schedule). With packing it concatenates the samples into rows of seq_len, so samples see
  each other; ft packs them into rows where each sample attends only to itself.
- peers (axolotl, LLaMA-Factory, trl): reported as installed or not; this script does not run them.

Figures: real (non-padding) tokens per CPU-second of the process over steps 2..N-1 (CPU time read at the start of
each step), as a ratio to the plain loop without packing of the same round; startup: seconds from starting the
process to the start of its first step (imports, tokenizing, model loading; for ft also planning), wall-clock and
the process's CPU time (the wall-clock figure grows on a busy machine, the CPU figure much less); exit: seconds from
the last file the tool wrote (ft: anything in its run folder) to the end of its process. Rounds run every
tool in turn, so machine noise hits them alike; the table shows each round's ratios and then their medians. Under the
tables: the plain loop's padded positions per real token, which bounds what packing gains where every position costs
the same (ft's unpacked rows already run padding-free on a CPU).

The job's shape is an option, each taking a comma-separated list; every combination is a job of its own with its
own table: --vocab (rows of the embeddings and the head: 0 keeps the tokenizer's; more pads both), --layers, --width,
--seq-len (data.seq_len: rows cut there, packed rows that long),
--format (instruction: alpaca records through data.template alpaca, and the prompt written out by hand in the plain
loop; chat: the same records as user/assistant messages through ChatML, written out by hand in the plain loop),
--template (builtin: the built-in's name; file: the same Jinja in a file that data.template names), and --dropout
(LoRA dropout, in both tools).

    python bench/peers.py [--rounds 3] [--steps 30] [--records 2000] [--warm-cache]
    python bench/peers.py --vocab 512,4096,32768 --layers 4 --width 256 --format instruction,chat --template file
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MICRO, RANK, ALPHA, LR = 4, 8, 16, 1.0e-4
TIMELINE = "PEERS_TIMELINE"  # the file the step stamps go to
PEERS = {"axolotl": "axolotl", "LLaMA-Factory": "llamafactory", "trl": "trl"}
WORDS = (
    "the a model data answer question number list write explain short story city river people time water "
    "give three reasons why how what make plan small large first next last good new old simple example text "
    "summary sentence word letter color tree house book music learn train add count sort name describe"
).split()


# ---------------------------------------------------------------- the data, and the prompt as a user writes it
def alpaca_records(n: int, seed: int = 0) -> list[dict]:
    """n alpaca-style records: an instruction, an input for about 40% of them, an output."""
    rng = random.Random(seed)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    out = []
    for _ in range(n):
        extra = words(2, 8) if rng.random() < 0.4 else ""
        out.append({"instruction": words(3, 8).capitalize() + ".", "input": extra, "output": words(2, 20) + "."})
    return out


def alpaca_prompt(record: dict) -> str:
    """The classic alpaca prompt, written out by hand as a plain loop's author would."""
    if record["input"]:
        return (
            "Below is an instruction that describes a task, paired with an input that provides further context. "
            "Write a response that appropriately completes the request.\n\n"
            f"### Instruction:\n{record['instruction']}\n\n### Input:\n{record['input']}\n\n### Response:\n"
        )
    return (
        "Below is an instruction that describes a task. Write a response that appropriately completes the request."
        f"\n\n### Instruction:\n{record['instruction']}\n\n### Response:\n"
    )


def chat_messages(record: dict) -> list[dict]:
    """The record as a conversation: the instruction (and its input) from the user, the output from the assistant."""
    user = record["instruction"] + (f"\n\n{record['input']}" if record["input"] else "")
    return [{"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]


def chatml_prompt(messages: list[dict]) -> str:
    """ChatML up to the assistant's reply, written out by hand as a plain loop's author would."""
    return f"<|im_start|>user\n{messages[0]['content']}<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class Shape:
    """One job shape: the model's size and how the data reaches it."""

    vocab: int = 0
    layers: int = 6
    width: int = 256
    format: str = "instruction"  # instruction (alpaca) | chat (ChatML)
    template: str = "builtin"  # builtin | file
    dropout: float = 0.0
    seq_len: int = 256

    def title(self) -> str:
        vocab = self.vocab or "the tokenizer's"
        return (
            f"vocabulary {vocab}, {self.layers} layers of width {self.width}, {self.format} records through "
            f"{'a template file' if self.template == 'file' else 'the built-in template'}, "
            f"LoRA dropout {self.dropout}, seq_len {self.seq_len}"
        )


# ---------------------------------------------------------------- step stamps (both tools)
def stamp(step: int) -> None:
    with open(os.environ[TIMELINE], "a") as f:
        f.write(f"{step} {time.time()} {time.process_time()}\n")


def ft_hook(rank: int, step: int) -> None:
    """FT_STEP_HOOK: ft calls it at the start of every step."""
    stamp(step)


def read_stamps(path: Path) -> dict[int, tuple[float, float]]:
    rows = [line.split() for line in path.read_text().splitlines()]
    return {int(s): (float(wall), float(cpu)) for s, wall, cpu in rows}


# ---------------------------------------------------------------- the plain loop (a child process)
def plain_batches(rows: list[tuple[list[int], list[int]]], pad: int, packing: bool, seq_len: int):
    """Micro-batches (ids, labels, mask) forever: padded rows, or the samples concatenated into seq_len rows."""
    import torch

    if packing:
        ids = [t for r in rows for t in r[0]]
        labels = [t for r in rows for t in r[1]]
        rows = [(ids[i : i + seq_len], labels[i : i + seq_len]) for i in range(0, len(ids) - seq_len + 1, seq_len)]
    while True:
        for k in range(0, len(rows) - MICRO + 1, MICRO):
            chunk = rows[k : k + MICRO]
            width = max(len(r[0]) for r in chunk)
            yield (
                torch.tensor([r[0] + [pad] * (width - len(r[0])) for r in chunk]),
                torch.tensor([r[1] + [-100] * (width - len(r[1])) for r in chunk]),
                torch.tensor([[1] * len(r[0]) + [0] * (width - len(r[0])) for r in chunk]),
            )


def plain_child(
    model_dir: str, data: str, steps: int, packing: bool, out: str, chat: bool, dropout: float, seq_len: int
) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    for line in Path(data).read_text().splitlines():
        record = json.loads(line)
        if chat:  # the records file holds the conversations ft reads (bench below)
            prompt = tok(chatml_prompt(record["messages"]), add_special_tokens=False)["input_ids"]
            reply = tok(record["messages"][1]["content"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
        else:
            prompt = tok(alpaca_prompt(record), add_special_tokens=False)["input_ids"]
            reply = tok(record["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(((prompt + reply)[:seq_len], ([-100] * len(prompt) + reply)[:seq_len]))
    random.Random(0).shuffle(rows)
    batches = plain_batches(rows, tok.pad_token_id, packing, seq_len)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    lora = LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=dropout, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    model = get_peft_model(model, lora)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    tokens, positions = [], []
    for step in range(1, steps + 1):
        stamp(step)
        ids, labels, mask = next(batches)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens.append(int(mask.sum()))
        positions.append(ids.numel())
    Path(out).write_text(json.dumps({"tokens": tokens, "positions": positions}))


# ---------------------------------------------------------------- one run of each tool (parent side)
def ft_job(folder: Path, model: Path, data: Path, packing: bool, steps: int, cache: Path, shape: Shape) -> Path:
    from finetune.templates import BUILTIN

    job = folder / "job.yaml"
    name = "chatml" if shape.format == "chat" else "alpaca"
    template = name
    if shape.template == "file":
        template = folder / f"{name}.jinja"
        template.write_text(BUILTIN[name].jinja)
    job.write_text(f"""
model: {{name: {model}}}
data: {{datasets: [{{path: {data}, format: {shape.format}}}], template: {template}, seq_len: {shape.seq_len},
  packing: {str(packing).lower()}, cache_dir: {cache}}}
adapter: {{type: lora, r: {RANK}, alpha: {ALPHA}, dropout: {shape.dropout}, target_modules: all-linear}}
train: {{global_batch_size: {MICRO}, micro_batch_size: {MICRO}, max_steps: {steps}, lr: {LR},
  gradient_checkpointing: false, precision: fp32}}
output: {{dir: {folder / "run"}, log_steps: 1, save_steps: 0}}
""")
    return job


def child(command: list[str], folder: Path) -> tuple[float, float, dict[int, tuple[float, float]]]:
    """Start a tool's process; its start time, the time it ended, and its step stamps."""
    timeline = folder / "timeline.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.update({TIMELINE: str(timeline), "FT_STEP_HOOK": f"{Path(__file__).resolve()}:ft_hook"})
    with open(folder / "output.txt", "w") as log:
        started = time.time()
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=folder).returncode
        ended = time.time()
    if code:
        raise SystemExit(f"{' '.join(command)} failed ({code}):\n{(folder / 'output.txt').read_text()[-3000:]}")
    return started, ended, read_stamps(timeline)


def figures(started: float, stamps: dict, tokens: dict[int, int], ended: float, last_write: float) -> dict:
    """Tokens per CPU-second over steps 2..N-1 (they end at the stamp of step N); the startup in wall-clock and in
    CPU seconds (the process's CPU time at its first step); the exit: seconds from the last file the tool wrote to the
    end of its process."""
    last = max(stamps)
    cpu = stamps[last][1] - stamps[2][1]
    tps = sum(tokens[s] for s in range(2, last)) / cpu
    return {"tps": tps, "startup": stamps[1][0] - started, "startup_cpu": stamps[1][1], "exit": ended - last_write}


def newest_write(folder: Path) -> float:
    """The modification time of the newest file under `folder`."""
    return max(p.stat().st_mtime for p in folder.rglob("*") if p.is_file())


def run_ft(folder: Path, model: Path, data: Path, packing: bool, steps: int, cache: Path, shape: Shape) -> dict:
    ft = Path(sys.executable).with_name("ft")
    command = [str(ft)] if ft.exists() else [sys.executable, "-m", "finetune"]
    job = ft_job(folder, model, data, packing, steps, cache, shape)
    started, ended, stamps = child([*command, "train", str(job), "--hardware", "cpu"], folder)
    rows = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    tokens = {r["step"]: r["tokens"] for r in rows if "tokens" in r}
    return figures(started, stamps, tokens, ended, newest_write(folder / "run"))


def run_plain(folder: Path, model: Path, data: Path, packing: bool, steps: int, shape: Shape) -> dict:
    out = folder / "tokens.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "plain", "--model", str(model)]
    command += ["--data", str(data), "--steps", str(steps), "--out", str(out)] + (["--packing"] if packing else [])
    command += ["--format", shape.format, "--dropout", str(shape.dropout), "--seq-len", str(shape.seq_len)]
    started, ended, stamps = child(command, folder)
    written = json.loads(out.read_text())
    tokens = dict(enumerate(written["tokens"], start=1))
    measured = range(1, max(stamps) - 1)  # steps 2..N-1, as figures counts them
    bound = sum(written["positions"][i] for i in measured) / sum(written["tokens"][i] for i in measured)
    return {**figures(started, stamps, tokens, ended, out.stat().st_mtime), "positions_per_token": bound}


# ---------------------------------------------------------------- the table
TOOLS = {"plain": "plain torch+peft loop", "ft": "ft"}


def row(name: str, rounds: list[dict], k: int | None) -> str:
    """One table row: round k's figures, or (k None) the medians over the rounds."""

    def pick(key: str) -> float:
        values = [r[key] for r in rounds] if k is None else [rounds[k][key]]
        return statistics.median(values)

    startup = f"{pick('startup'):.1f} ({pick('startup_cpu'):.1f} CPU)"
    return f"| {TOOLS[name]} | {pick('no packing'):.2f} | {pick('packing'):.2f} | {startup} | {pick('exit'):.2f} |"


def table(results: dict[str, list[dict]], k: int | None) -> str:
    title = "medians of all rounds" if k is None else f"round {k + 1}"
    head = (
        f"{title}\n| tool | no packing (x plain loop) | packing (x plain loop without packing) | startup s | exit s |\n"
    )
    return head + "|---|---|---|---|---|\n" + "\n".join(row(name, rounds, k) for name, rounds in results.items())


def ratios(runs: dict[tuple[str, bool], dict]) -> dict[str, dict]:
    base = runs[("plain", False)]["tps"]
    return {
        name: {
            "no packing": runs[(name, False)]["tps"] / base,
            "packing": runs[(name, True)]["tps"] / base,
            "startup": runs[(name, False)]["startup"],
            "startup_cpu": runs[(name, False)]["startup_cpu"],
            "exit": runs[(name, False)]["exit"],
        }
        for name in TOOLS
    }


def shapes(args) -> list[Shape]:
    """Every combination of the shape options' values."""

    def values(text: str, kind):
        return [kind(v) for v in str(text).split(",") if v.strip()]

    return [
        Shape(vocab, layers, width, fmt, template, dropout, seq_len)
        for vocab, layers, width, fmt, template, dropout, seq_len in itertools.product(
            values(args.vocab, int),
            values(args.layers, int),
            values(args.width, int),
            values(args.format, str),
            values(args.template, str),
            values(args.dropout, float),
            values(args.seq_len, int),
        )
    ]


def bench_shape(args, shape: Shape, tmp: Path, data: Path) -> None:
    from common import build_llama

    model = tmp / "model"
    params = build_llama(
        model, vocab=shape.vocab, hidden=shape.width, layers=shape.layers, tied=False, max_positions=shape.seq_len
    )
    print(
        f"\n## {shape.title()}\nmodel: {params / 1e6:.1f}M parameters; {args.records} records; micro-batch {MICRO}, "
        f"seq_len {shape.seq_len}, LoRA r {RANK} on all linear projections, fp32, 1 thread; {args.steps} steps per run",
        flush=True,
    )
    results: dict[str, list[dict]] = {name: [] for name in TOOLS}
    bounds = []
    for k in range(args.rounds):
        runs = {}
        for packing in (False, True):
            for name in TOOLS:
                folder = tmp / f"round{k}-{name}-{'packed' if packing else 'padded'}"
                folder.mkdir()
                if name == "plain":
                    runs[(name, packing)] = run_plain(folder, model, data, packing, args.steps, shape)
                else:
                    cache = tmp / ("cache" if args.warm_cache else f"cache{k}")
                    runs[(name, packing)] = run_ft(folder, model, data, packing, args.steps, cache, shape)
        for name, figures_ in ratios(runs).items():
            results[name].append(figures_)
        bounds.append(runs[("plain", False)]["positions_per_token"])
        print(table(results, k), flush=True)
    print(table(results, None), flush=True)
    print(
        f"the plain loop's padded micro-batches hold {statistics.median(bounds):.2f} positions per real token: what "
        "leaving the padding out gains where every position costs the same",
        flush=True,
    )


def bench(args) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    for name, module in PEERS.items():
        found = importlib.util.find_spec(module) is not None
        print(f"{name}: {'installed, but not run by this script' if found else 'not installed'}")
    for shape in shapes(args):
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            records = alpaca_records(args.records)
            if shape.format == "chat":
                records = [{"messages": chat_messages(r)} for r in records]
            data = tmp / "records.jsonl"
            data.write_text("".join(json.dumps(r) + "\n" for r in records))
            bench_shape(args, shape, tmp, data)
    print(
        "\nratios: real tokens per CPU-second over steps 2..N-1; startup: process start to its first step without "
        "packing, wall-clock (the process's CPU seconds); exit: the last file written to the end of the process"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--warm-cache", action="store_true", help="ft: one data cache for all rounds")
    parser.add_argument("--vocab", default="0", help="rows of the embeddings and head (0: the tokenizer's), a list")
    parser.add_argument("--layers", default="6", help="decoder layers, a list")
    parser.add_argument("--width", default="256", help="hidden size, a list")
    parser.add_argument("--format", default="instruction", help="instruction (alpaca) | chat (ChatML), a list")
    parser.add_argument("--template", default="builtin", help="builtin | file (the same Jinja in a file), a list")
    parser.add_argument("--dropout", default="0.0", help="LoRA dropout in both tools, a list")
    parser.add_argument("--seq-len", default="256", help="data.seq_len (rows are cut there and packed to it), a list")
    parser.add_argument("--child", choices=["plain"], help=argparse.SUPPRESS)
    for flag in ("--model", "--data", "--out"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    parser.add_argument("--packing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        plain_child(
            args.model,
            args.data,
            args.steps,
            args.packing,
            args.out,
            args.format == "chat",
            float(args.dropout),
            int(args.seq_len),
        )
    else:
        bench(args)


if __name__ == "__main__":
    main()
