"""A rank of tests/test_vocab_rows.py (started by torchrun, 2 gloo ranks): the row-sharded embeddings and head
(finetune/distributed/vocab.py) against one unsharded copy of the same model.

python tests/scripts/vocab_probe.py OUT  -> OUT/result.json (rank 0): per case, what the ends became and the largest
differences in logits and gradients, and the loss before and after a few optimizer steps.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from finetune.distributed import fsdp, vocab

VOCAB = 301  # odd: the last rank holds fewer rows, and the last chunk of each shard is partial


SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
)


def model(tied: bool, family: str = "llama"):
    torch.manual_seed(0)
    if family == "gemma3":  # scaled embeddings (Gemma3TextScaledWordEmbedding), tied to the head
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        return Gemma3ForCausalLM(Gemma3TextConfig(**SHAPE, head_dim=8, sliding_window=8)).train()
    return LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=tied)).train()


def batch(rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(10 + rank))


def case(tied: bool, frozen_ends: bool, family: str = "llama") -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    one, sharded = model(tied, family), model(tied, family)
    for m in (one, sharded):
        if frozen_ends:  # as under LoRA: the tables take no gradient
            m.get_input_embeddings().weight.requires_grad_(False)
            m.get_output_embeddings().weight.requires_grad_(False)
    fsdp.wrap(sharded, "fp32", "full_shard", 1, world, torch.device("cpu"))
    ends = vocab.sharded_ends(sharded)
    layout = ends[0].layout if ends else None
    # one process sees every rank's batch; FSDP2 averages the ranks' gradients: the same mean
    ids = [batch(r) for r in range(world)]
    for x in ids:
        (one(input_ids=x, labels=x).loss / world).backward()
    out = sharded(input_ids=ids[rank], labels=ids[rank])
    out.loss.backward()
    with torch.no_grad():
        logits = one(input_ids=ids[rank]).logits
    grads = {}
    for (name, p), (_, q) in zip(one.named_parameters(), sharded.named_parameters()):
        if p.grad is not None:
            g = q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad
            grads[name] = (p.grad - g).abs().max().item()
    optimizer = torch.optim.AdamW([p for p in sharded.parameters() if p.requires_grad], lr=1e-2)
    x = ids[rank]
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = sharded(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with fsdp.unsharded(sharded, True), torch.no_grad():  # generation's path: the tables gathered whole once
        whole = sharded(input_ids=ids[rank]).logits
    state = fsdp.full_state_dict(sharded, trainable_only=False)
    return {
        "ends": sorted(type(m).__name__ for m in ends),
        "chunks": layout.chunks if layout else 0,
        "placements": sorted({str(m.weight.placements) for m in ends}),
        "logits": (out.logits.detach() - logits).abs().max().item(),
        "grads": grads,
        "losses": losses,
        "whole_vs_chunked": (whole - sharded(input_ids=ids[rank]).logits.detach()).abs().max().item(),
        "state_shapes": {k: list(v.shape) for k, v in state.items() if "embed" in k or "lm_head" in k},
    }


def main() -> None:
    dist.init_process_group("gloo")
    result = {f"tied={t},frozen={f}": case(t, f) for t in (False, True) for f in (False, True)}
    result["gemma3"] = case(True, False, "gemma3")
    if dist.get_rank() == 0:
        (Path(sys.argv[1]) / "result.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    from finetune.errors import exit_process

    # ends as ft's ranks do, after a barrier and without the interpreter's teardown, where gloo's threads can abort a
    # finished rank
    exit_process(main)
