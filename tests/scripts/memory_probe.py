"""Measure the peak host memory that training adds, next to the planner's estimate, for several jobs of one model.

python tests/scripts/memory_probe.py 'full|' 'full|loss_implementation: chunked' 'lora|' ...
  -> one JSON line per job, in the order given: adapter, keys, measured, estimated, breakdown

Each job is ADAPTER|TRAIN_KEYS: full or lora, then more `train:` keys in YAML flow style (the memory savers). The
imports, the model and its data file are made once here; each job then prepares its data (a cache of its own) and
trains in a child forked from this process, all side by side. A child's peak resident memory starts from what it
inherits (its peak mark is reset when it starts), so each job's growth is measured alone, as in a fresh process.
"""

import json
import os
import resource
import sys
import tempfile
import traceback
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the children are forked after the tokenizer ran
from transformers import LlamaConfig, LlamaForCausalLM

from finetune.config import loads
from finetune.data.preprocess import prepare
from finetune.hardware import parse
from finetune.plan import plan
from finetune.tiny import build_tokenizer, write_jsonl
from finetune.train import setup, train_step
from finetune.workflow import model_facts

tmp = Path(tempfile.mkdtemp())
tok = build_tokenizer()
cfg = LlamaConfig(
    vocab_size=32768,  # logits matter, and the chunked loss's chunk (256 MiB of fp32 logits) is half a micro-batch
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    pad_token_id=tok.pad_token_id,
    eos_token_id=tok.eos_token_id,
)
LlamaForCausalLM(cfg).save_pretrained(tmp / "model")
tok.save_pretrained(tmp / "model")
long = [
    {
        "messages": [
            {"role": "user", "content": "word " * 20},
            {"role": "assistant", "content": "the model learns " * 25},
        ]
    }
    for _ in range(64)
]
data = write_jsonl(long, tmp / "d.jsonl")


def rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(adapter: str, keys: str, index: int) -> dict:
    extra = f", {keys}" if keys else ""
    if "checkpoint" not in extra:
        extra = ", gradient_checkpointing: false" + extra
    text = f"""
model: {{name: {tmp / "model"}}}
data: {{datasets: [{{path: {data}, format: chat}}], seq_len: 256, cache_dir: {tmp / f"cache-{index}"}, packing: true}}
adapter: {{type: {adapter}}}
train: {{global_batch_size: 16, micro_batch_size: 16, max_steps: 2{extra}}}
output: {{dir: {tmp / f"run-{index}"}}}
"""
    config = loads(text)
    prepared = prepare(config)  # planned as ft train plans once the data is prepared: with the rows' trained share
    p = plan(config, parse("cpu"), model_facts(config.model), trained_share=prepared.summary["most_trained_share"])
    base = rss()
    job = setup(config, p, prepared)
    # the optimizer state is created at the end of the first step: the second is the first to peak with it
    for _ in range(2):
        train_step(job)
    top = peak()
    return {
        "adapter": adapter,
        "keys": keys,
        "measured": top - base,
        "estimated": p.estimate.device_bytes,
        "breakdown": p.estimate.device,
        "base": base,
        "peak": top,
    }


children = []
for index, job_spec in enumerate(sys.argv[1:]):
    adapter, _, keys = job_spec.partition("|")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one job, its figures down the pipe
        os.close(read)
        status = 1
        try:
            try:
                Path("/proc/self/clear_refs").write_text("5")  # reset the peak mark to the memory in use now
            except OSError:
                pass  # kernels before 4.0: the peak inherited from the parent (below the training's peak)
            with os.fdopen(write, "w") as out:
                out.write(json.dumps(measure(adapter, keys, index)))
            status = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(status)
    os.close(write)
    children.append((pid, os.fdopen(read)))
failed = 0
for pid, pipe in children:
    text = pipe.read()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        failed += 1
        print(f"a job's child failed with status {status}", file=sys.stderr)
    else:
        print(text)
sys.exit(1 if failed else 0)
