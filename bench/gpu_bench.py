"""ft on GPUs with a ~1B-parameter Llama built offline: loading memory per rank against the plan, throughput, and
scaling from one GPU to all of them.

    python bench/gpu_bench.py build      --model DIR [--size 1b|small]
    python bench/gpu_bench.py memory     --model DIR [--work DIR] [--json FILE] [--steps 3] [--hardware DESC]
    python bench/gpu_bench.py throughput --model DIR [--work DIR] [--json FILE] [--steps 20] [--hardware DESC]
    python bench/gpu_bench.py scaling    --model DIR [--work DIR] [--json FILE] [--steps 20] [--hardware DESC]
                                         [--adapter full|lora] [--tensor-parallel K]
    python bench/gpu_bench.py summary    [--memory FILE] [--throughput FILE] [--scaling FILE]

build: a LlamaForCausalLM with random weights (hidden 2048, 16 layers, 32 heads, MLP 5632, vocab 32000:
~0.95B parameters), saved with save_pretrained as bf16 safetensors, with ft's tiny tokenizer (its ~500
tokens fit in the 32000-row embedding; no resize). Built on the GPU when there is one (seconds).

memory: `ft train` of the model with LoRA under FSDP2 full_shard on every visible GPU (one GPU: a process
group of one), a few steps. A hook (a sitecustomize.py put on the ranks' PYTHONPATH, active only when
FT_GPU_MEMORY_DIR is set) records on each rank torch.cuda.max_memory_allocated / max_memory_reserved
after `finetune.train.setup` (model loaded, adapted, sharded, optimizer built) and after every step.
Printed next to the plan's memory.per_device_gib (plan.json); fails when a rank's peak reaches the GPU's
memory. metrics.jsonl's memory_gib (rank 0) is shown as a cross-check.

throughput: `ft train` (bench/common.py) of the model, LoRA and full fine-tuning, bf16, one GPU, packed
sequences, no gradient checkpointing: real tokens/s over the steps after the first few, MFU and peak
memory against the plan. MFU = 6 N tokens/s / the GPU's dense bf16 peak (N: all parameters; attention
FLOPs not counted; LoRA does less work than 6N, about 4N: no weight gradients for frozen weights, so its
6N figure is "model FLOPs" as if fully trained). Peaks are NVIDIA's datasheet figures (below), and an
8192^3 bf16 matmul measured here is shown beside them.

scaling: the same job (full fine-tuning by default, bf16, packed sequences, one micro-batch of the same size per
device and step, no accumulation: every device does the same work) with `ft train` on one device, then on all N
visible devices with the plan's backend (`--tensor-parallel K`: `--set distributed.tensor_parallel=K`, each tp group
of K devices on the same rows). Measured efficiency = tokens/s on N / (N x tokens/s on one), after the warm-up steps,
next to the plan's predicted `scaling.efficiency` (the N-device run's plan.json) with its compute and communication
seconds per step. With fewer than 2 devices it says so and exits 0. `--hardware cpu:2` runs 2 CPU processes (gloo)
against `--hardware cpu`.

On CPU (`--hardware cpu`, `--size small`) every step runs too, to check the pipeline without a GPU (its figures say
nothing about GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, train_metrics  # noqa: E402

GiB = 1024**3
SIZES = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
}
# Dense bf16 tensor-core peaks in TFLOP/s, from NVIDIA's datasheets (H100/H200 "Tensor Core GPU" datasheets,
# A100 datasheet, L40S, L40 and L4 datasheets), which print them "with sparsity": halved here. Checked in order
# against torch.cuda.get_device_name() (the more specific names first).
PEAK_BF16_TFLOPS = [
    ("H200", 989.5),
    ("H100 PCIe", 756.5),
    ("H100 NVL", 835.5),
    ("H100", 989.5),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
]
WORDS = (
    "the model learns to add numbers and answer questions about text data while training on small examples "
    "user assistant system you are a helpful what is how many please"
).split()


# ---------------------------------------------------------------- the model
def build(folder: Path, size: str = "1b", seed: int = 0) -> int:
    """Save a random-weight Llama of `size` as bf16 safetensors with ft's tiny tokenizer; returns its parameter count.
    Reuses a folder that already holds the same configuration."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.tiny import build_tokenizer

    spec = SIZES[size]
    folder = Path(folder)
    done = folder / "ft-gpu-bench.json"
    if done.exists() and json.loads(done.read_text()).get("spec") == spec:
        return json.loads(done.read_text())["params"]
    tok = build_tokenizer()
    if len(tok) > spec["vocab_size"]:
        raise SystemExit(f"the tokenizer has {len(tok)} tokens, more than the model's vocab of {spec['vocab_size']}")
    cfg = LlamaConfig(
        **spec,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    start = time.perf_counter()
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    params = sum(p.numel() for p in model.parameters())
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))  # safetensors, bf16
    tok.save_pretrained(str(folder))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    done.write_text(json.dumps({"spec": spec, "params": params}))
    print(
        f"built {size} Llama ({params / 1e9:.3f} B parameters, bf16) in {folder} on {device} in "
        f"{time.perf_counter() - start:.1f} s",
        flush=True,
    )
    return params


def write_data(path: Path, records: int = 1500, seed: int = 0) -> Path:
    """Plain-text records (format completion: every token trained) of 100 to 300 words, for packed sequences."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _ in range(records):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(100, 300)))}) + "\n")
    return path


def job_yaml(
    model: Path,
    data: Path,
    run: Path,
    cache: Path,
    *,
    adapter: str,
    precision: str,
    seq_len: int,
    micro: int,
    batch: int,
    steps: int,
    distributed: str = "{backend: auto}",
) -> str:
    adapters = {"lora": "{type: lora, r: 16, alpha: 32, dropout: 0.0}", "full": "{type: full}"}
    return f"""
model: {{name: {model}}}
data: {{datasets: [{{path: {data}, format: completion}}], seq_len: {seq_len}, packing: true, cache_dir: {cache}}}
adapter: {adapters[adapter]}
train: {{global_batch_size: {batch}, micro_batch_size: {micro}, max_steps: {steps}, lr: 1.0e-5,
  warmup_steps: 0, gradient_checkpointing: false, precision: {precision}}}
distributed: {distributed}
output: {{dir: {run}, log_steps: 1, save_steps: 0}}
"""


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def steady_rate(steps: list[dict], warmup: int) -> tuple[float, float, int]:
    """(real tokens/s, ms per step, steps timed) over metrics.jsonl step rows after the first `warmup` (the last step
    is always timed); each row's seconds are its tokens / tokens_per_s."""
    timed = steps[min(warmup, max(0, len(steps) - 1)) :]
    seconds = sum(r["tokens"] / r["tokens_per_s"] for r in timed)
    return sum(r["tokens"] for r in timed) / seconds, 1000 * seconds / len(timed), len(timed)


# ---------------------------------------------------------------- memory per rank
HOOK = r'''
"""Written by bench/gpu_bench.py: with FT_GPU_MEMORY_DIR set, every process that imports finetune.train records
torch.cuda memory after finetune.train.setup and after each train_step into FT_GPU_MEMORY_DIR/rank<RANK>.json."""
import importlib.abc
import os
import sys


def _patch(T):
    import json
    import resource
    from pathlib import Path

    import torch

    out, rank = Path(os.environ["FT_GPU_MEMORY_DIR"]), int(os.environ.get("RANK", "0"))
    rec = {"rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "device": None,
      "after_load": None, "steps": []}
    setup, train_step = T.setup, T.train_step

    def snap(device):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            g = 1024 ** 3
            return {"max_allocated_gib": torch.cuda.max_memory_allocated(device) / g,
              "allocated_gib": torch.cuda.memory_allocated(device) / g,
                    "max_reserved_gib": torch.cuda.max_memory_reserved(device) / g,
                    "capacity_gib": torch.cuda.get_device_properties(device).total_memory / g}
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # host peak (KiB -> GiB)
        return {"max_allocated_gib": rss, "allocated_gib": rss, "max_reserved_gib": rss, "capacity_gib": None}

    def write():
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{rank}.json").write_text(json.dumps(rec))

    def setup_(*args, **kwargs):
        job = setup(*args, **kwargs)
        rec["device"] = str(job.device)
        rec["after_load"] = snap(job.device)
        write()
        return job

    def train_step_(job):
        result = train_step(job)
        rec["steps"].append(snap(job.device))
        write()
        return result

    T.setup, T.train_step = setup_, train_step_


class _Finder(importlib.abc.MetaPathFinder):
    """Patches finetune.train once it is imported (each rank, `python -m finetune.rank`, imports it and calls
    finetune.train.setup/run)."""

    def find_spec(self, name, path, target=None):
        if name != "finetune.train":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                exec_module = spec.loader.exec_module

                def patched(module, exec_module=exec_module):
                    exec_module(module)
                    _patch(module)

                spec.loader.exec_module = patched
                return spec
        return None


if os.environ.get("FT_GPU_MEMORY_DIR"):
    sys.meta_path.insert(0, _Finder())
'''


def memory(args) -> int:
    import shutil

    work = Path(args.work)
    ranks_dir, run = work / "ranks", work / "run"
    shutil.rmtree(ranks_dir, ignore_errors=True)
    shutil.rmtree(run, ignore_errors=True)
    (work / "hook").mkdir(parents=True, exist_ok=True)
    (work / "hook" / "sitecustomize.py").write_text(HOOK)
    params = build(Path(args.model), args.size)
    world = 1 if args.hardware and args.hardware.lower().startswith("cpu") else max(1, gpu_count())
    cpu = world == 1 and gpu_count() == 0
    data = write_data(work / "data.jsonl", records=400 if args.size == "small" else 1500)
    config = work / "memory.yaml"
    config.write_text(
        job_yaml(
            Path(args.model),
            data,
            run,
            work / "cache",
            adapter="lora",
            precision="fp32" if cpu else "bf16",
            seq_len=args.seq_len,
            micro=args.micro,
            batch=args.micro * world,
            steps=args.steps,
            distributed="{backend: fsdp, sharding: full_shard, offload: none}",
        )
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "FT_GPU_MEMORY_DIR": str(ranks_dir),
        "PYTHONPATH": os.pathsep.join([str(work / "hook"), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    if cpu:
        env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [
        sys.executable,
        "-m",
        "finetune",
        "train",
        str(config),
        *(["--hardware", args.hardware] if args.hardware else []),
    ]
    print(
        f"memory: {' '.join(cmd)}  ({world} rank{'s' if world > 1 else ''}, LoRA, FSDP2 full_shard, {args.micro} "
        f"x {args.seq_len} tokens per rank)",
        flush=True,
    )
    start = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    (work / "train.log").write_text(r.stdout + r.stderr)
    problems = [] if r.returncode == 0 else [f"ft train exited with {r.returncode}:\n{r.stderr[-4000:]}"]
    plan = json.loads((run / "plan.json").read_text()) if (run / "plan.json").exists() else {}
    planned = plan.get("memory", {}).get("per_device_gib")
    planned_allocated = plan.get("memory", {}).get("per_device_allocated_gib", planned)
    ranks = [json.loads(p.read_text()) for p in sorted(ranks_dir.glob("rank*.json"))]
    metrics = [row for row in rows_of(run / "metrics.jsonl") if "memory_gib" in row]
    if not ranks:
        problems.append("no rank recorded its memory (the hook in sitecustomize.py did not run)")
    for rec in ranks:
        if rec["after_load"] is None or not rec["steps"]:
            problems.append(f"rank {rec['rank']}: no memory recorded after loading or after a step")
            continue
        peak = max(s["max_reserved_gib"] for s in [rec["after_load"], *rec["steps"]])
        rec["peak_allocated_gib"] = max(s["max_allocated_gib"] for s in [rec["after_load"], *rec["steps"]])
        rec["peak_reserved_gib"] = peak
        capacity = rec["after_load"]["capacity_gib"]
        if capacity is not None and peak >= capacity:
            problems.append(f"rank {rec['rank']}: peak {peak:.2f} GiB reserved reaches the device's {capacity:.2f} GiB")
    result = {
        "params": params,
        "world_size": world,
        "seconds": seconds,
        "returncode": r.returncode,
        "plan_backend": plan.get("backend"),
        "plan_sharding": plan.get("sharding"),
        "plan_loading": plan.get("loading"),
        "planned_per_device_gib": planned,
        "planned_allocated_gib": planned_allocated,
        "plan_device_capacity_gib": plan.get("memory", {}).get("device_capacity_gib"),
        "plan_breakdown_gib": plan.get("memory", {}).get("per_device_breakdown_gib"),
        "ranks": ranks,
        "metrics_memory_gib": [row["memory_gib"] for row in metrics],
        "problems": problems,
    }
    print(memory_report(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    for p in problems:
        print(f"FAIL: {p}", file=sys.stderr)
    return 1 if problems else 0


def memory_report(m: dict) -> str:
    planned = m.get("planned_allocated_gib") or m.get("planned_per_device_gib")
    lines = [
        f"loading memory: {m['params'] / 1e9:.2f} B-parameter Llama, LoRA, {m.get('plan_backend')} "
        f"{m.get('plan_sharding')}, "
        f"{m['world_size']} rank(s), loading={m.get('plan_loading')}; ft train took {m['seconds']:.0f} s",
        f"  plan: {m.get('planned_per_device_gib')} GiB per device, {planned} GiB of it allocated by tensors "
        f"(capacity {m.get('plan_device_capacity_gib')} GiB): "
        f"{m.get('plan_breakdown_gib')}",
        f"  {'rank':>4}  {'after load':>10}  {'after step 1':>12}  {'peak alloc':>10}  {'peak reserved':>13}  "
        f"{'device':>8}  {'peak/plan':>9}",
    ]
    for rec in m["ranks"]:
        if rec.get("after_load") is None or not rec.get("steps"):
            lines.append(f"  {rec['rank']:>4}  (incomplete)")
            continue
        cap = rec["after_load"]["capacity_gib"]
        ratio = f"{rec['peak_allocated_gib'] / planned:.2f}" if planned else "-"
        lines.append(
            f"  {rec['rank']:>4}  {rec['after_load']['max_allocated_gib']:>10.2f}  "
            f"{rec['steps'][0]['max_allocated_gib']:>12.2f}  {rec['peak_allocated_gib']:>10.2f}  "
            f"{rec['peak_reserved_gib']:>13.2f}  {(f'{cap:.1f}' if cap else 'host'):>8}  {ratio:>9}"
        )
    lines.append(
        "  (GiB; torch.cuda.max_memory_allocated / max_memory_reserved since the rank started; peak/plan = peak "
        "allocated / the plan's allocated estimate)"
    )
    if m.get("metrics_memory_gib"):
        lines.append(
            f"  metrics.jsonl memory_gib (rank 0) per step: {', '.join(f'{v:.2f}' for v in m['metrics_memory_gib'])}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- throughput
def peak_tflops(name: str) -> tuple[float | None, str]:
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in name.lower():
            return tflops, f"{key} datasheet, dense bf16"
    return None, "unknown GPU: pass --peak-tflops"


def measured_matmul_tflops(n: int = 8192, reps: int = 10) -> float:
    import torch

    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    tflops = 2 * n**3 * reps / (time.perf_counter() - start) / 1e12
    del a, b
    torch.cuda.empty_cache()
    return tflops


def hardware_description() -> str:
    """The ft hardware preset of GPU 0 (the plan's memory capacity), or a described GPU of its size."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    props = torch.cuda.get_device_properties(0)
    name, gb = props.name.upper().replace(" ", ""), props.total_memory / 1e9
    for key, preset in (
        ("H200", "H200"),
        ("H100NVL", "H100NVL"),
        ("H100", "H100-94GB" if gb > 90 else "H100-80GB"),
        ("A100", "A100-80GB" if gb > 50 else "A100-40GB"),
        ("L40S", "L40S"),
        ("L4", "L4"),
    ):
        if key in name and not (key == "L4" and not name.endswith("L4")):
            return f"1x{preset}"
    return f"1xGPU-{int(gb)}GB"


def throughput(args) -> int:
    import shutil

    import torch

    work = Path(args.work)
    build(Path(args.model), args.size)
    hardware = args.hardware or hardware_description()
    cpu = hardware.lower().startswith("cpu")
    name = "CPU" if cpu else torch.cuda.get_device_name(0)
    peak, source = (
        (args.peak_tflops, "--peak-tflops") if args.peak_tflops else peak_tflops(name) if not cpu else (None, "CPU")
    )
    measured = measured_matmul_tflops() if not cpu else None
    data = write_data(work / "data.jsonl", records=400 if args.size == "small" else 1500)
    runs, problems = [], []
    for adapter in args.adapters.split(","):
        run = work / f"run-{adapter}"
        shutil.rmtree(run, ignore_errors=True)
        config = work / f"{adapter}.yaml"
        config.write_text(
            job_yaml(
                Path(args.model),
                data,
                run,
                work / "cache",
                adapter=adapter,
                precision="fp32" if cpu else "bf16",
                seq_len=args.seq_len,
                micro=args.micro,
                batch=args.micro,
                steps=args.steps,
            )
        )
        print(
            f"throughput: ft train {config} --hardware {hardware} ({adapter}, {args.steps} steps of {args.micro} "
            f"x {args.seq_len} tokens)",
            flush=True,
        )
        start = time.perf_counter()
        try:
            rows = train_metrics(config, hardware, run)
        except SystemExit as e:
            problems.append(f"{adapter}: ft train failed:\n{e}")
            continue
        plan = json.loads((run / "plan.json").read_text())
        steps = [r for r in rows if "tokens_per_s" in r]
        tps, step_ms, timed = steady_rate(steps, args.warmup)
        n = plan["params"]["total"]
        mfu = 6 * n * tps / (peak * 1e12) if peak else None
        runs.append(
            {
                "adapter": adapter,
                "params": n,
                "trainable": plan["params"]["trainable"],
                "steps": len(steps),
                "timed_steps": timed,
                "step_ms": step_ms,
                "tokens_per_s": tps,
                "mfu": mfu,
                "mfu_measured_peak": 6 * n * tps / (measured * 1e12) if measured else None,
                "peak_memory_gib": max(r["memory_gib"] for r in steps),
                "planned_gib": plan["memory"]["per_device_gib"],
                "backend": plan["backend"],
                "attn": plan["attn_implementation"],
                "wall_s": time.perf_counter() - start,
                "loss_first_last": [steps[0]["loss"], steps[-1]["loss"]],
            }
        )
        shutil.rmtree(run / "final", ignore_errors=True)  # the full model's weights: GBs
    result = {
        "gpu": name,
        "hardware": hardware,
        "peak_tflops": peak,
        "peak_source": source,
        "measured_matmul_tflops": measured,
        "seq_len": args.seq_len,
        "micro_batch": args.micro,
        "runs": runs,
        "problems": problems,
    }
    print(throughput_report(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    for p in problems:
        print(f"FAIL: {p}", file=sys.stderr)
    return 1 if problems or not runs else 0


def throughput_report(b: dict) -> str:
    peak = f"{b['peak_tflops']:.0f} TFLOP/s ({b['peak_source']})" if b.get("peak_tflops") else b.get("peak_source")
    measured = (
        f"; 8192^3 bf16 matmul measured here: {b['measured_matmul_tflops']:.0f} TFLOP/s"
        if b.get("measured_matmul_tflops")
        else ""
    )
    lines = [
        f"throughput on {b['gpu']} (plan for {b['hardware']}), {b['micro_batch']} x {b['seq_len']} packed tokens "
        f"per step; peak {peak}{measured}",
        f"  {'run':<5} {'params':>7} {'trainable':>10} {'backend':>8} {'step ms':>8} {'tokens/s':>10} "
        f"{'MFU(6N)':>8} {'MFU meas.':>9} "
        f"{'peak GiB':>9} {'plan GiB':>9} {'peak/plan':>9}",
    ]
    for r in b["runs"]:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        mfu_m = f"{100 * r['mfu_measured_peak']:.1f}%" if r.get("mfu_measured_peak") is not None else "-"
        lines.append(
            f"  {r['adapter']:<5} {r['params'] / 1e9:>6.2f}B {r['trainable'] / 1e6:>9.1f}M {r['backend']:>8} "
            f"{r['step_ms']:>8.1f} {r['tokens_per_s']:>10,.0f} {mfu:>8} {mfu_m:>9} {r['peak_memory_gib']:>9.2f} "
            f"{r['planned_gib']:>9.2f} {r['peak_memory_gib'] / r['planned_gib']:>9.2f}"
        )
    lines.append(
        "  tokens/s: real tokens over the steps after the first few; MFU(6N): 6 x all parameters x tokens/s / peak "
        "(LoRA really does ~4N; attention FLOPs not counted); peak GiB: max_memory_allocated (metrics.jsonl memory_gib)"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------- scaling: N devices against one
def scaling_devices(hardware: str | None) -> tuple[int, str | None, bool]:
    """(N, the one-device run's --hardware, on CPU?): the GPUs this process sees (ft probes those it is shown), or a
    described single machine (`cpu:2`: 2 processes against `cpu`; `2xH200`: 2 GPUs against `1xH200`)."""
    if hardware is None:
        return gpu_count(), None, gpu_count() == 0
    import re

    from finetune.hardware import parse

    hw = parse(hardware)
    if hw.nodes > 1:
        raise SystemExit(f"--hardware {hardware}: scaling runs on one machine; describe one node")
    return hw.world_size, "cpu" if hw.is_cpu else "1x" + re.sub(r"^\s*\d+\s*x\s*", "", hardware, flags=re.I), hw.is_cpu


def shown(devices: int, cpu: bool) -> dict:
    """The environment of an `ft train` that sees the first `devices` of this process's GPUs (one thread per rank)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    if not cpu:  # ft probes only the GPUs CUDA_VISIBLE_DEVICES shows and starts one rank per GPU, on cuda:LOCAL_RANK
        seen = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(seen[:devices] if seen else map(str, range(devices)))
    return env


def scaling_run(args, work: Path, data: Path, devices: int, hardware: str | None, cpu: bool) -> dict:
    """`ft train` of the job on `devices` devices (each one micro-batch of args.micro sequences a step, no
    accumulation), with the plan's backend; its plan and its tokens/s after the warm-up steps."""
    import shutil

    tp = args.tensor_parallel if devices > 1 else 1
    run, config = work / f"run-{devices}", work / f"scaling-{devices}.yaml"
    shutil.rmtree(run, ignore_errors=True)
    text = job_yaml(Path(args.model), data, run, work / "cache", adapter=args.adapter, seq_len=args.seq_len,
                    precision="fp32" if cpu else "bf16", micro=args.micro, batch=args.micro * devices // tp,
                    steps=args.steps)  # fmt: skip
    config.write_text(text)
    cmd = [sys.executable, "-m", "finetune", "train", str(config), *(["--hardware", hardware] if hardware else [])]
    cmd += ["--set", f"distributed.tensor_parallel={tp}"] if tp > 1 else []
    print(f"scaling: ft {' '.join(cmd[3:])}  ({devices} device{'s' if devices > 1 else ''})", flush=True)
    start = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, env=shown(devices, cpu), capture_output=True, text=True)
    (work / f"train-{devices}.log").write_text(r.stdout + r.stderr)
    if r.returncode:
        raise RuntimeError(f"ft train on {devices} device(s) exited with {r.returncode}:\n{r.stderr[-4000:]}")
    plan = json.loads((run / "plan.json").read_text())
    steps = [row for row in rows_of(run / "metrics.jsonl") if "tokens_per_s" in row]
    tps, step_ms, timed = steady_rate(steps, args.warmup)
    shutil.rmtree(run / "final", ignore_errors=True)  # the full model's weights: GBs
    return {
        "devices": devices,
        "world_size": plan["world_size"],
        "backend": plan["backend"],
        "sharding": plan.get("sharding"),
        "tensor_parallel": plan.get("tensor_parallel", 1),
        "micro_batch_size": plan["micro_batch_size"],
        "gradient_accumulation_steps": plan["gradient_accumulation_steps"],
        "steps": len(steps),
        "timed_steps": timed,
        "tokens_per_step": sum(row["tokens"] for row in steps) / len(steps),
        "step_ms": step_ms,
        "tokens_per_s": tps,
        "plan_step_seconds": plan.get("step_seconds_estimate"),
        "plan_scaling": plan.get("scaling") or {},
        "wall_s": time.perf_counter() - start,
        "loss_first_last": [steps[0]["loss"], steps[-1]["loss"]],
    }


def scaling_problems(runs: list[dict], micro: int) -> list[str]:
    """What makes the two runs incomparable: a device count other than asked, or unequal per-device work."""
    problems = []
    for r in runs:
        if r["world_size"] != r["devices"]:
            problems.append(f"the {r['devices']}-device run was planned for {r['world_size']} processes")
        if (r["micro_batch_size"], r["gradient_accumulation_steps"]) != (micro, 1):
            problems.append(
                f"the {r['devices']}-device run has micro-batch {r['micro_batch_size']} x "
                f"{r['gradient_accumulation_steps']} accumulation steps, not {micro} x 1"
            )
    if len(runs) == 2 and not runs[1]["plan_scaling"]:
        problems.append(f"the {runs[1]['devices']}-device plan.json has no scaling figures")
    return problems


def scaling(args) -> int:
    devices, one, cpu = scaling_devices(args.hardware)
    result = {"devices": devices, "hardware": args.hardware, "adapter": args.adapter, "seq_len": args.seq_len,
              "micro_batch": args.micro, "tensor_parallel": args.tensor_parallel, "steps": args.steps,
              "warmup": args.warmup}  # fmt: skip
    if devices < 2:
        what = f"--hardware {args.hardware} describes" if args.hardware else "this machine shows"
        plural = "s" if devices != 1 else ""
        result["skipped"] = f"{what} {devices} device{plural}: the scaling check needs at least 2"
    elif devices % args.tensor_parallel:
        raise SystemExit(f"--tensor-parallel {args.tensor_parallel} does not divide the {devices} devices")
    else:
        import torch

        result["device"] = "CPU process" if cpu else torch.cuda.get_device_name(0)
        result["precision"] = "fp32" if cpu else "bf16"
        work = Path(args.work)
        build(Path(args.model), args.size)
        data = write_data(work / "data.jsonl", records=400 if args.size == "small" else 1500)
        runs, problems = [], []
        for n, hardware in ((1, one), (devices, args.hardware)):
            try:
                runs.append(scaling_run(args, work, data, n, hardware, cpu))
            except RuntimeError as e:
                problems.append(str(e))
                break
        problems += scaling_problems(runs, args.micro)
        result.update(runs=runs, problems=problems)
        if len(runs) == 2:
            predicted = runs[1]["plan_scaling"]
            result["measured_efficiency"] = runs[1]["tokens_per_s"] / (devices * runs[0]["tokens_per_s"])
            result["predicted_efficiency"] = predicted.get("efficiency")
            result["predicted"] = {k: v for k, v in predicted.items() if k != "efficiency"}
    print(scaling_report(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    for p in result.get("problems", []):
        print(f"FAIL: {p}", file=sys.stderr)
    return 1 if result.get("problems") or not (result.get("skipped") or "measured_efficiency" in result) else 0


def scaling_report(b: dict) -> str:
    if b.get("skipped"):
        return f"scaling: skipped ({b['skipped']})"
    n = b["devices"]
    lines = [
        f"scaling of {b['adapter']} fine-tuning ({b.get('precision')}) on {n} x {b.get('device')} against one: "
        f"{b['micro_batch']} x {b['seq_len']} packed tokens per device and step, {b['steps']} steps, the first "
        f"{b['warmup']} untimed",
        f"  {'devices':>7} {'backend':>9} {'sharding':>13} {'tp':>3} {'tokens/step':>11} {'step ms':>9} "
        f"{'tokens/s':>11} {'per device':>11} {'plan step s':>11}",
    ]
    for r in b.get("runs", []):
        planned = sum((r.get("plan_step_seconds") or {}).values())
        lines.append(
            f"  {r['devices']:>7} {r['backend']:>9} {str(r['sharding'] or '-'):>13} {r['tensor_parallel']:>3} "
            f"{r['tokens_per_step']:>11,.0f} {r['step_ms']:>9.1f} {r['tokens_per_s']:>11,.0f} "
            f"{r['tokens_per_s'] / r['devices']:>11,.0f} {planned:>11.4g}"
        )
    if "measured_efficiency" not in b:
        return "\n".join(lines + ["  (no efficiency: a run failed)"])
    one, many = b["runs"]
    ideal_ms = many["tokens_per_step"] / (n * one["tokens_per_s"]) * 1000  # every device at one device's rate
    lost_ms = many["step_ms"] - ideal_ms
    p = b["predicted"]
    lines.append(
        f"  measured efficiency:  {b['measured_efficiency']:7.1%}  tokens/s on {n} / ({n} x tokens/s on 1); a step "
        f"takes {many['step_ms']:.1f} ms against {ideal_ms:.1f} ms at one device's rate: {lost_ms:.1f} ms lost"
    )
    if b.get("predicted_efficiency") is None:
        return "\n".join(lines + [f"  predicted efficiency: none (the {n}-device plan.json has no scaling figures)"])
    lines += [
        f"  predicted efficiency: {b['predicted_efficiency']:7.1%}  plan.json of the {n}-device run: compute "
        f"{p['compute_seconds']:.4g} s, communication {p['communication_seconds']:.4g} s per step, of which "
        f"{p['overlapped_seconds']:.4g} s overlaps compute and {p['exposed_seconds']:.4g} s is exposed",
    ]
    for name, c in p.get("collectives", {}).items():
        lines.append(f"    {name}: {c['seconds']:.4g} s ({c['hidden_seconds']:.4g} s hidden), {c['link']}")
    return "\n".join(lines)


# ---------------------------------------------------------------- summary for scripts/gpu-check.sh
def summary(args) -> int:
    reports = ((args.memory, memory_report), (args.throughput, throughput_report), (args.scaling, scaling_report))
    for path, report in reports:
        if path and Path(path).exists():
            print(report(json.loads(Path(path).read_text())))
        elif path:
            print(f"({path}: not written)")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", required=True, help="model folder (built if it does not hold this size)")
    common.add_argument("--size", choices=sorted(SIZES), default="1b")
    sub.add_parser("build", parents=[common], help="build the model folder (random bf16 weights, tiny tokenizer)")
    m = sub.add_parser(
        "memory", parents=[common], help="per-rank memory of LoRA under FSDP2 full_shard against the plan"
    )
    m.add_argument("--work", default="/tmp/ft-gpu-bench/memory")
    m.add_argument("--json", help="write the figures here")
    m.add_argument("--steps", type=int, default=3)
    m.add_argument("--seq-len", type=int, default=2048)
    m.add_argument("--micro", type=int, default=4, help="micro-batch (sequences per rank per step)")
    m.add_argument("--hardware", help="ft --hardware (default: ft probes the visible GPUs)")
    t = sub.add_parser(
        "throughput", parents=[common], help="tokens/s, MFU and peak memory of LoRA and full fine-tuning"
    )
    t.add_argument("--work", default="/tmp/ft-gpu-bench/throughput")
    t.add_argument("--json", help="write the figures here")
    t.add_argument("--steps", type=int, default=20)
    t.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    t.add_argument("--seq-len", type=int, default=1024)
    t.add_argument("--micro", type=int, default=8)
    t.add_argument("--adapters", default="lora,full")
    t.add_argument("--hardware", help="ft --hardware (default: GPU 0's preset, e.g. 1xH200)")
    t.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, if not in the table")
    c = sub.add_parser("scaling", parents=[common], help="tokens/s on all visible devices against one: efficiency")
    c.add_argument("--work", default="/tmp/ft-gpu-bench/scaling")
    c.add_argument("--json", help="write the figures here")
    c.add_argument("--steps", type=int, default=20)
    c.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    c.add_argument("--seq-len", type=int, default=1024)
    c.add_argument("--micro", type=int, default=8, help="micro-batch (sequences per device per step)")
    c.add_argument("--adapter", choices=["full", "lora"], default="full")
    c.add_argument("--tensor-parallel", type=int, default=1, help="distributed.tensor_parallel of the N-device run")
    c.add_argument("--hardware", help="ft --hardware of the N-device run, e.g. cpu:2 (default: the visible GPUs)")
    s = sub.add_parser("summary", help="print the figures of earlier memory/throughput/scaling runs")
    s.add_argument("--memory")
    s.add_argument("--throughput")
    s.add_argument("--scaling")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if args.command == "build":
        build(Path(args.model), args.size)
        sys.exit(0)
    commands = {"memory": memory, "throughput": throughput, "scaling": scaling, "summary": summary}
    sys.exit(commands[args.command](args))


if __name__ == "__main__":
    main()
