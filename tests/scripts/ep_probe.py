"""One rank of the expert-parallel probe (tests/test_expert_parallel.py): a tiny mixture-of-experts model of each
family whole in this process, and a copy wrapped by finetune/distributed/fsdp.py with its routed experts split over the
ranks (distributed/ep.py, FSDP2 for the rest). Each rank runs the split copy on its own rows; the mean of the ranks'
losses and every gradient (made whole) must equal the whole model's on all the rows. Writes OUT/probe-rank{R}.json.
Then each run folder named (run=RUN_DIR[@resume=CHECKPOINT]) is trained in turn in the same ranks, as
`python -m finetune.rank` trains it (probe_common.train_run_folders): one launch for every job of the test file.
Usage: ep_probe.py OUT [FAMILY...] [run=RUN_DIR[@resume=CHECKPOINT]...]"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_common import RUN, train_run_folders  # noqa: E402

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
FAMILIES = {
    "qwen3_moe": dict(
        num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    ),
    "mixtral": dict(num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(
        n_routed_experts=4,
        num_key_value_heads=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=0,
        n_group=1,
        topk_group=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    ),
}


def tiny(kind: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **SHAPE, **FAMILIES[kind]))
    with torch.no_grad():  # decisive routing: router logits far from ties that rounding could flip
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return model


def compare(kind: str, rank: int, world: int) -> dict:
    from finetune.distributed import fsdp

    whole = tiny(kind)
    split = copy.deepcopy(whole)
    ids = torch.randint(0, 96, (2 * world, 12), generator=torch.Generator().manual_seed(1))
    ref = whole(input_ids=ids, labels=ids)
    ref.loss.backward()
    fsdp.wrap(split, "fp32", "full_shard", 1, world, torch.device("cpu"), expert_parallel=world)
    mine = ids[2 * rank : 2 * rank + 2]
    out = split(input_ids=mine, labels=mine)  # equal tokens per rank: the mean of the ranks' means is the whole mean
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    grads = {n: p.grad for n, p in whole.named_parameters()}
    errors, local = {}, {}
    for name, p in split.named_parameters():
        errors[name] = float((p.grad.full_tensor() - grads[name]).abs().max() / grads[name].abs().max())
        if name.endswith("mlp.experts.gate_up_proj"):
            local[name] = list(p.to_local().shape)
    return {"loss": [float(ref.loss), float(loss) / world], "grad_errors": errors, "local_experts": local}


def main() -> None:
    out = Path(sys.argv[1])
    kinds = [a for a in sys.argv[2:] if not a.startswith(RUN)]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if kinds:
        report = {kind: compare(kind, rank, world) for kind in kinds}
        (out / f"probe-rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    train_run_folders([a for a in sys.argv[2:] if a.startswith(RUN)])


if __name__ == "__main__":
    from finetune.errors import exit_process

    # ends as ft's ranks do, after a barrier and without the interpreter's teardown, where gloo's threads can abort a
    # finished rank
    exit_process(main)
