"""scripts/gpu-check.sh's first-contact checks (issue 31): each GPU-marked test or command under its own timeout, then
one line a check, `check NAME: PASS|FAIL|SKIP <figure>`, the figure being the last line the test printed.

    python bench/gpu_first_contact.py check NAME TIMEOUT [--figure TEXT] [--ids FILE] -- CMD...
    python bench/gpu_first_contact.py compile [--max-recompiles N]    FSDP2 LoRA of ft-tiny, train.compile=true
    python bench/gpu_first_contact.py figures [--memory JSON] [--savers JSON]   measured vs estimated memory lines

Each `check` line is also appended to $OUT/checks.txt (the summary prints that file)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FRAMEWORK = re.compile(
    r"^(=+|-+|_+|platform |cachedir|rootdir|configfile|plugins|collect|collected|tests/\S+::\S+\s*$|PASSED|FAILED|"
    r"SKIPPED|ERROR|XFAIL|short test summary|\d+ (passed|failed|skipped|deselected)|\[gw\d|created: |timeout: )"
)


def emit(line: str) -> None:
    print(line, flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        with open(Path(out) / "checks.txt", "a") as f:
            f.write(line + "\n")


def figure_of(text: str, pattern: str | None) -> str:
    """The last line the test printed that contains `pattern` (else the last one that is not pytest's own)."""
    lines = []
    for raw in text.splitlines():
        line = re.sub(r"\s*(PASSED|FAILED|SKIPPED|ERROR)\s*$", "", re.sub(r"^tests/\S+::\S+\s*", "", raw)).strip()
        if line and not FRAMEWORK.match(line):
            lines.append(line)
    hits = [x for x in lines if pattern and pattern in x]
    return (hits or lines or ["-"])[-1][:200]


def verdict(rc: int, text: str) -> str:
    tail = text.strip().splitlines()[-1] if text.strip() else ""
    if rc == 5 or "no tests ran" in tail:
        return "FAIL"  # the selection took no test: a renamed test must not pass unnoticed
    if rc != 0:
        return "FAIL"
    if re.search(r"\d+ passed", tail) or "skipped" not in tail:
        return "PASS"
    return "SKIP"


def check(args, cmd: list[str]) -> int:
    print(f"--- check {args.name} (timeout {args.timeout} s): {' '.join(cmd)}", flush=True)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=REPO, start_new_session=True)
        rc, text = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(out, flush=True)
        emit(f"check {args.name}: FAIL timed out after {args.timeout} s")
        return 1
    print(text, flush=True)
    result = verdict(rc, text)
    figure = figure_of(text, args.figure)
    if result == "SKIP":
        reasons = [x for x in text.splitlines() if x.startswith("SKIPPED")]
        figure = reasons[-1][:200] if reasons else figure
    elif result == "FAIL" and rc == 5:
        figure = "the selection collected no test"
    emit(f"check {args.name}: {result} {figure}")
    if args.ids and rc != 5:
        ids = [m.group(0) for m in re.finditer(r"tests/\S+\.py::\S+", text)]
        with open(args.ids, "a") as f:
            f.write("".join(i.rstrip(":") + "\n" for i in dict.fromkeys(ids)))
    return 0 if result != "FAIL" else 1


def compile_check(args) -> int:
    """FSDP2 (full_shard, one rank) LoRA of ft-tiny with train.compile=true under TORCH_LOGS=recompiles: the decoder
    layers share one code object, so more than a few 'Recompiling function' lines is a regression."""
    sys.path.insert(0, str(REPO))
    from tests.helpers import ft_train, job, losses, visible_gpus

    tmp = Path(tempfile.mkdtemp(prefix="ft-compile-", dir=os.environ.get("WORK")))
    sets = [
        "adapter={type: lora, r: 8, alpha: 16, dropout: 0.0}",
        "train.precision=bf16",
        "train.compile=true",
        "train.lr=2.0e-3",
        "distributed.backend=fsdp",
        "distributed.sharding=full_shard",
    ]
    argv = [a for s in sets for a in ("--set", s)]
    env = {**visible_gpus(1), "TORCH_LOGS": "recompiles"}
    r = ft_train(job(tmp, "compile", steps=args.steps), *argv, env=env, timeout=args.timeout)
    log = r.stdout + r.stderr
    recompiles = log.count("Recompiling function")
    for line in log.splitlines():
        if "Recompiling function" in line or "triggered by" in line or "guard" in line.lower():
            print(line)
    plan = json.loads((tmp / "compile" / "plan.json").read_text()) if (tmp / "compile" / "plan.json").exists() else {}
    trace = losses(tmp / "compile") if (tmp / "compile").exists() else []
    print(
        f"compile under FSDP2 LoRA: {recompiles} recompiles (at most {args.max_recompiles}), plan compile "
        f"{plan.get('compile')}, backend {plan.get('backend')}, losses {trace[:1]} -> {trace[-1:]}"
    )
    if r.returncode != 0:
        print(r.stderr[-4000:])
        return 1
    return 0 if recompiles <= args.max_recompiles and plan.get("backend") == "fsdp" else 1


def figures(args) -> int:
    """measured vs estimated memory: the FSDP2 1B run (memory.json) and each activation saver (savers.json)."""
    if args.memory and Path(args.memory).exists():
        m = json.loads(Path(args.memory).read_text())
        rows = m.get("ranks") or m.get("per_rank") or [m]
        rows = rows if isinstance(rows, list) else list(rows.values())
        planned = m.get("planned_allocated_gib") or m.get("planned_per_device_gib")
        for rank, rec in enumerate(rows):
            peak = rec.get("peak_allocated_gib") if isinstance(rec, dict) else None
            ratio = f", measured/estimated {peak / planned:.2f}" if peak and planned else ""
            emit(f"check memory rank {rank}: max_memory_allocated {peak} GiB vs estimate {planned} GiB{ratio}")
    if args.savers and Path(args.savers).exists():
        s = json.loads(Path(args.savers).read_text())
        for c in s.get("columns", []):
            est = c.get("estimated_bytes") or c.get("estimate_bytes")
            ratio = f" vs estimate {est / 2**20:.1f} MiB, measured/estimated {c['peak_bytes'] / est:.2f}" if est else ""
            emit(
                f"check saver {c['saver']}: max_memory_allocated {c['peak_bytes'] / 2**20:.1f} MiB{ratio}"
                f"{'' if est else ' (no estimate in savers.json)'}, {c.get('tokens_per_s') or 0:.0f} tokens/s"
            )
    return 0


def main() -> int:
    argv = sys.argv[1:]
    cmd = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("check")
    c.add_argument("name")
    c.add_argument("timeout", type=int)
    c.add_argument("--figure", help="the figure is the last printed line containing this")
    c.add_argument("--ids", help="append the node ids the check ran to this file")
    k = sub.add_parser("compile")
    k.add_argument("--max-recompiles", type=int, default=4)
    k.add_argument("--steps", type=int, default=4)
    k.add_argument("--timeout", type=int, default=120)
    f = sub.add_parser("figures")
    f.add_argument("--memory")
    f.add_argument("--savers")
    args = p.parse_args(argv)
    if args.what == "check":
        return check(args, cmd)
    return compile_check(args) if args.what == "compile" else figures(args)


if __name__ == "__main__":
    raise SystemExit(main())
