"""Rollout throughput of one vLLM server (`vllm serve`, started as ft train starts it) serving two trainer ranks:
every request of both ranks in flight at once (what ft's client does: vLLM's continuous batching batches them),
against the ranks served one after the other (each rank's prompts batched, the other rank waiting: what ft's former
rollout server did, with one engine call at a time behind a lock), and (--one-at-a-time) against one request at a
time.

    OMP_NUM_THREADS=1 python bench/rollout_server_bench.py [--prompts 64] [--max-new-tokens 32] [--rounds 3] \
        [--hidden 256] [--layers 4] [--command "vllm serve"] [--one-at-a-time]

Run it in an environment with vLLM (scripts/setup-vllm.sh makes .venv-vllm), or give --command (how vLLM starts
elsewhere). A Llama built here (--hidden 256, --layers 4, ft-tiny's tokenizer), fp32 on CPU; each rank (a thread with
its own client) asks for --prompts completions (8 prompts x 8 samples) of up to --max-new-tokens tokens, sampled
(temperature 1, no stop token of ft's; the tokenizer's end of sequence still ends one). Generated tokens per second of
wall time, the median over --rounds (one round one at a time: it takes minutes); the ratio column is against the
serialised row. On a 2-core machine the server shares the cores with the clients: compare ratios within one run, not
absolute figures across machines.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

from common import build_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.rollout.serve import server_command, server_env  # noqa: E402
from finetune.rollout.server import Http, RemoteRollout, wait_ready  # noqa: E402
from finetune.rollout.vllm import EngineSpec  # noqa: E402

RANKS = 2


def prompts_of(rank: int, count: int) -> list[list[int]]:
    """8 samples of each prompt, as a GRPO group (the token ids of ft-tiny's vocabulary)."""
    return [[20 + rank, 30 + (i // 8) % 40, 40 + (i // 8) % 50, 9] for i in range(count)]


def timed(clients, count: int, mode: str) -> tuple[float, int]:
    """(seconds, generated tokens) for one rollout of both ranks."""
    lock = threading.Lock()

    def rank(r: int):
        if mode == "serialised":
            with lock:  # the other rank waits until this rank's whole batch is generated
                return clients[r].generate(prompts_of(r, count), seed=r * 1000)
        return clients[r].generate(prompts_of(r, count), seed=r * 1000)

    started = time.perf_counter()
    with ThreadPoolExecutor(RANKS) as pool:
        outs = list(pool.map(rank, range(RANKS)))
    return time.perf_counter() - started, sum(len(c.ids) for out in outs for c in out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64, help="completions per rank")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--command", default=None, help="how vLLM's server starts (default: this environment's)")
    parser.add_argument("--one-at-a-time", action="store_true", help="also time one request at a time")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        build_llama(model, hidden=args.hidden, layers=args.layers)
        spec = EngineSpec(model=str(model), tokenizer=str(model), dtype="fp32", max_model_len=96)
        port, log = 18000 + os.getpid() % 1000, open(Path(tmp) / "server.log", "wb")  # noqa: SIM115
        command = server_command(spec, "127.0.0.1", port, args.command, gpu=False)
        server = subprocess.Popen(command, env=server_env(os.environ, None, gpu=False), stdout=log, stderr=log)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(Http(url, None, 60), 600, server)
            section = SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens)
            clients = [RemoteRollout(url, section, stop=[]) for _ in range(RANKS)]
            timed(clients, 8, "batched")  # warm-up
            results = {}
            modes = ("batched", "serialised") + (("one at a time",) if args.one_at_a_time else ())
            for mode in modes:
                if mode == "one at a time":
                    for c in clients:
                        c.pool = ThreadPoolExecutor(1)
                    lock = threading.Lock()
                    for c in clients:  # one request in flight across both ranks
                        c.generate = _locked(c.generate, lock)
                rounds = 1 if mode == "one at a time" else args.rounds
                runs = [timed(clients, args.prompts, mode) for _ in range(rounds)]
                results[mode] = statistics.median(tokens / seconds for seconds, tokens in runs)
        finally:
            server.terminate()
            server.wait(timeout=60)
            log.close()
    print(f"one vLLM server, {RANKS} trainer ranks x {args.prompts} completions x {args.max_new_tokens} tokens")
    print(f"{'requests':<16}{'tokens/s':>10}{'x serialised':>14}")
    for mode, rate in results.items():
        print(f"{mode:<16}{rate:>10.0f}{rate / results['serialised']:>14.2f}")


def _locked(generate, lock):
    def one_at_a_time(prompts, seed):
        with lock:
            return generate(prompts, seed)

    return one_at_a_time


if __name__ == "__main__":
    main()
