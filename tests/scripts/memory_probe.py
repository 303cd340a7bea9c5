"""Measure the peak host memory that training adds, next to the planner's estimate (run in a fresh process).

python tests/scripts/memory_probe.py full|lora [TRAIN_KEYS]  -> prints one JSON line: measured, estimated, breakdown

TRAIN_KEYS: more `train:` keys in YAML flow style, e.g. "loss_implementation: chunked" (the memory savers).
"""

import json
import os
import resource
import sys
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
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
adapter = sys.argv[1]  # full | lora
extra = f", {sys.argv[2]}" if len(sys.argv) > 2 and sys.argv[2] else ""
if "checkpoint" not in extra:
    extra = ", gradient_checkpointing: false" + extra
text = f"""
model: {{name: {tmp / "model"}}}
data: {{datasets: [{{path: {data}, format: chat}}], seq_len: 256, cache_dir: {tmp / "cache"}, packing: true}}
adapter: {{type: {adapter}}}
train: {{global_batch_size: 16, micro_batch_size: 16, max_steps: 2{extra}}}
output: {{dir: {tmp / "run"}}}
"""
config = loads(text)
p = plan(config, parse("cpu"), model_facts(config.model))
prepared = prepare(config)


def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024


base = rss()
job = setup(config, p, prepared)
# the optimizer state is created at the end of the first step: the second is the first to peak with it
for _ in range(2):
    train_step(job)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(
    json.dumps(
        {
            "measured": peak - base,
            "estimated": p.estimate.device_bytes,
            "breakdown": p.estimate.device,
            "base": base,
            "peak": peak,
        }
    )
)
