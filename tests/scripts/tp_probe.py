"""One rank of the tensor-parallel probe (tests/test_tensor_parallel.py): a tiny model of each family, whole in this
process and split over the ranks by finetune/distributed/tp.py, with and without LoRA; the split one's logits, loss
and every gradient (made whole) must equal the whole one's. Writes OUT/probe-rank{R}.json. Then each run folder named
(run=RUN_DIR[@resume=CHECKPOINT]) is trained in turn in the same ranks, as `python -m finetune.rank` trains it
(probe_common.train_run_folders): one launch for the test file's jobs of this world size.
Usage: tp_probe.py OUT [FAMILY...] [run=RUN_DIR[@resume=CHECKPOINT]...]"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_common import RUN, train_run_folders  # noqa: E402


def tiny(kind: str):
    import transformers

    shape = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attn_implementation="eager",
    )
    cfg = getattr(transformers, f"{kind}Config")(**shape)
    return getattr(transformers, f"{kind}ForCausalLM")(cfg)


def compare(kind: str, lora: bool, tp_mesh) -> dict:
    from peft import LoraConfig, get_peft_model

    from finetune.distributed import fsdp, tp

    torch.manual_seed(0)
    whole = tiny(kind)
    if lora:
        whole = get_peft_model(whole, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        with torch.no_grad():  # B starts at zero: give the adapter an output, so that every gradient is non-zero
            for name, p in whole.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    split = copy.deepcopy(whole)
    ids = torch.randint(0, 96, (2, 11))  # 11 positions: an uneven split of the sequence over 2 ranks
    ref = whole(input_ids=ids, labels=ids)
    ref.loss.backward()
    tp.parallelize(split, tp_mesh, fsdp.decoder_layers(split))
    out = split(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad for n, p in whole.named_parameters() if p.grad is not None}
    errors, trainable = {}, set()
    for name, p in split.named_parameters():
        if p.requires_grad:
            trainable.add(name)
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            errors[name] = float((g - grads[name]).abs().max())
    return {
        "loss": [float(ref.loss), float(out.loss)],
        "logits": float((ref.logits - out.logits).abs().max()),
        "grad_errors": errors,
        "same_trainable": trainable == {n for n, p in whole.named_parameters() if p.requires_grad},
        "sharded": sorted(n for n, p in split.named_parameters() if "Shard" in str(getattr(p, "placements", ""))),
    }


def main() -> None:
    out = Path(sys.argv[1])
    kinds = [a for a in sys.argv[2:] if not a.startswith(RUN)]
    dist.init_process_group("gloo")
    from finetune.distributed import mesh

    if kinds:
        grid = mesh.device_mesh("cpu", dist.get_world_size(), dist.get_world_size(), 1)
        report = {
            f"{kind}-{'lora' if lora else 'full'}": compare(kind, lora, grid[mesh.TP])
            for kind in kinds
            for lora in (False, True)
        }
        (out / f"probe-rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.barrier()
    train_run_folders([a for a in sys.argv[2:] if a.startswith(RUN)])


if __name__ == "__main__":
    from finetune.errors import exit_process

    # ends as ft's ranks do, after a barrier and without the interpreter's teardown, where gloo's threads can abort a
    # finished rank
    exit_process(main)
