"""ft's memory estimate against published, measured peaks (tests/data/memory_calibration.yaml).

Each row's settings become the estimator's Setup; the estimate is compared with what the source measured:
max_memory_allocated with what tensors occupy, max_memory_reserved (and `unknown`) with what the caching allocator
holds, nvidia-smi with all of it (CUDA context included). The training peak is compared: every source measured after
the model was loaded.

    python -m tests.calibration        prints the table, the median and p90 of |error|, and the refused rows
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import yaml

from finetune.catalog import lookup
from finetune.hardware import parse
from finetune.plan.memory import GiB, Setup, estimate
from finetune.plan.savers import CHUNK_BYTES

TABLE = Path(__file__).parent / "data" / "memory_calibration.yaml"
PAGED = ("paged_adamw_8bit", "paged_adamw_32bit")  # states in CUDA unified memory: outside torch's allocator stats
# FSDP1 runs (fsdp_qlora's train.py, accelerate's FSDP plugin in PEFT's guides) wrap the decoder layers only: the
# embeddings and the output head stay in the root unit, gathered for the whole step (ft's FSDP2 shards them apart)
FSDP1_SOURCES = ("https://github.com/AnswerDotAI/fsdp_qlora/", "https://github.com/huggingface/peft/")
# How each source's code differs from ft's where the estimate can say so (Setup's fields for published runs):
# torchtune: LoRA dropout 0.0 (its configs and builders; modules/peft/lora.py then uses nn.Identity, no saved copy);
# NF4 is torchao's NF4Tensor (scalers sharded with the data); lora_finetune_distributed.py shards `layers.i` and the
# root only (embeddings and output in the root, gathered all step under FSDP2), full_finetune_distributed.py also
# shards the configs' custom_sharded_layers [tok_embeddings, output] apart.
TORCHTUNE_SOURCE = "https://github.com/pytorch/torchtune/"
# transformers <= 4.44 (these runs' dates) upcast the logits in the model and shifted an fp32 copy for the loss;
# fsdp_qlora's train.py keeps the model's output through loss.backward() (`output = None` after it), the Trainer
# (PEFT's guides) keeps only the loss. Both train LoRA with dropout 0.1 (train.py's default, PEFT's scripts).
LOSS_COPIES = {"https://github.com/AnswerDotAI/fsdp_qlora/": "kept", "https://github.com/huggingface/peft/": "shifted"}
# What an `unknown` measure was, where the source shows it: PEFT's guides read "the memory consumed per GPU" off the
# run's GPU-memory chart ("64 GB (80%) as seen in the screenshot below", docs/source/accelerate/deepspeed.md): the
# device's whole use as NVML reports it, like nvidia-smi (its example scripts call no torch.cuda memory statistic).
MEASURED_AS = {"https://github.com/huggingface/peft/": "nvidia-smi"}


@dataclass(frozen=True)
class Row:
    id: str
    measured_gib: float
    estimated_gib: float
    capacity_gib: float
    compiled: bool

    @property
    def error(self) -> float:
        return (self.estimated_gib - self.measured_gib) / self.measured_gib


def rows(path: Path = TABLE) -> list[dict]:
    return yaml.safe_load(path.read_text())["rows"]


def setup_of(row: dict) -> Setup:
    s = row["settings"]
    m = lookup(row["model"])
    world = s["world_size"]
    sharding = None if s["sharding"] in ("none", None) else s["sharding"]
    adapter = s["adapter"]
    targets = s.get("lora_targets") or "all-linear"
    fields = dict(
        adapter=adapter,
        quantization=s["quantization"],
        precision="bf16" if s["precision"] == "bf16-pure" else s["precision"],
        pure_bf16=s["precision"] == "bf16-pure",
        optimizer=s["optimizer"],
        micro_batch_size=s["micro_batch_size"],
        seq_len=s["seq_len"],
        gradient_checkpointing=bool(s["gradient_checkpointing"]),
        sharding=sharding,
        shard_size=world if sharding else 1,
        offload=s["offload"],
        lora_r=s.get("lora_r") or 16,
        lora_targets=targets if isinstance(targets, str) else tuple(targets),
        loss={"plain": "plain", "chunked": "chunked"}.get(s["loss"], "fused"),
        loss_chunk_tokens=max(1, CHUNK_BYTES // (4 * m.vocab_size)),
        activation_offload=bool(s["activation_offload"]),
        optimizer_in_backward=bool(s["optimizer_in_backward"]),
        accumulation=int(s.get("gradient_accumulation") or 1),
    )
    return Setup(**{**fields, **source_setup(row)})


def source_setup(row: dict) -> dict:
    """Setup's fields for what the row's source code does differently from ft (see TORCHTUNE_SOURCE, LOSS_COPIES)."""
    source, s = row["source"], row["settings"]
    if source.startswith(TORCHTUNE_SOURCE):
        lora_distributed = s["adapter"] != "full" and s["world_size"] > 1
        return {"lora_dropout": 0.0, "nf4_library": "torchao", "fsdp_end_units": not lora_distributed}
    copies = next((v for k, v in LOSS_COPIES.items() if source.startswith(k)), "none")
    return {"lora_dropout": 0.1, "loss_copies": copies, "fsdp_end_units": not source.startswith(FSDP1_SOURCES)}


def compare(row: dict) -> Row:
    m = lookup(row["model"])
    s = setup_of(row)
    hw = parse(row["gpu"])
    est = estimate(m, s, hw.devices_per_node)
    training = dict(est.device)
    if s.optimizer in PAGED:
        training.pop("optimizer", None)
    measure = row["measure"]
    if measure == "unknown":
        measure = next((v for k, v in MEASURED_AS.items() if row["source"].startswith(k)), measure)
    total = sum(v for k, v in training.items() if not k.startswith("while loading"))
    if measure == "max_memory_allocated":
        total -= training.get("allocator reserve (fragmentation)", 0) + training.get("CUDA context", 0)
    elif measure in ("max_memory_reserved", "unknown"):
        total -= training.get("CUDA context", 0)
    return Row(
        row["id"],
        row["measured_gib"],
        total / GiB,
        hw.device_memory_bytes / GiB,
        bool(row["settings"].get("compile")),
    )


def summary(results: list[Row]) -> tuple[float, float]:
    errors = sorted(abs(r.error) for r in results)
    p90 = errors[min(len(errors) - 1, int(round(0.9 * (len(errors) - 1))))]
    return statistics.median(errors), p90


def main() -> None:
    results = [compare(r) for r in rows()]
    print(f"{'run':58} {'measured':>9} {'estimate':>9} {'error':>7}")
    for r in results:
        mark = " (torch.compile)" if r.compiled else ""
        print(f"{r.id[:58]:58} {r.measured_gib:9.2f} {r.estimated_gib:9.2f} {100 * r.error:+6.0f}%{mark}")
    med, p90 = summary(results)
    print(f"\n{len(results)} runs: median |error| {100 * med:.1f}%, p90 {100 * p90:.1f}%")


if __name__ == "__main__":
    main()


def config_of(row: dict):
    """The job file a user would write for this run: every setting the source states, pinned."""
    from finetune.config import loads

    s = row["settings"]
    world, mb = s["world_size"], s["micro_batch_size"]
    targets = s.get("lora_targets") or "all-linear"
    adapter = {"type": s["adapter"]}
    if s["adapter"] != "full":
        adapter.update(r=s.get("lora_r") or 16, target_modules=targets)
    backend = {"single": "single", "ddp": "ddp", "fsdp": "fsdp", "deepspeed": "deepspeed"}[s["backend"]]
    distributed = {"backend": backend, "offload": s["offload"]}
    if s["sharding"] not in ("none", None):
        distributed["sharding"] = s["sharding"]
    job = {
        "model": {"name": row["model"]},
        "data": {"datasets": [{"path": "data/train.jsonl", "format": "chat"}], "seq_len": s["seq_len"]},
        "adapter": adapter,
        "quantization": {"type": s["quantization"]},
        "train": {
            "global_batch_size": mb * int(s.get("gradient_accumulation") or 1) * world,
            "micro_batch_size": mb,
            "gradient_checkpointing": bool(s["gradient_checkpointing"]),
            "activation_offload": bool(s["activation_offload"]),
            "optimizer_in_backward": bool(s["optimizer_in_backward"]),
            "max_grad_norm": 0 if s["optimizer_in_backward"] else 1.0,
            "loss_implementation": {"plain": "plain", "chunked": "chunked"}.get(s["loss"], "liger"),
            "optimizer": s["optimizer"],
            "precision": s["precision"],
            "max_steps": 10,
        },
        "distributed": distributed,
        "output": {"dir": "runs/calibration"},
    }
    return loads(yaml.safe_dump(job), environ={})
