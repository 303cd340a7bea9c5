"""Expert parallelism of mixture-of-experts layers, under FSDP2: transformers' own expert-parallel styles on ft's mesh.

Each MoE layer's routed experts (fused 3-D parameters, `experts.gate_up_proj` / `experts.down_proj`) are split by
expert over `ep` data-parallel ranks; every rank routes its own tokens, sends each (token, expert) pair to the rank
that holds the expert and gets the expert's output back: two all-to-alls forward, two backward (their autograd
versions), and a tiny all-to-all of the per-expert counts. The styles are transformers 5.24's, named by each model's
`base_model_ep_plan` (`grouped_gemm` shards an expert parameter by expert, `ep_dispatch_experts` replaces the experts'
forward by the all-to-all dispatch, transformers/distributed/expert_parallel.py `AllToAllEP`): ft applies them
(`apply_expert_parallelism`) to its meta-device model on ft's expert mesh (mesh.expert_mesh), instead of letting
`from_pretrained(distributed_config=...)` build, wrap and load the model, so that ft keeps its own loading (each rank
reads only its experts' rows), adapters, FSDP2 policy and checkpoints.

FSDP2 composes as transformers' own fsdp.py does: each experts module is its own FSDP unit over the efsdp ranks that
hold the same experts (world / ep), every other module is sharded over all ranks as without expert parallelism. The
gradient of an expert sums every rank's tokens routed to it (the all-to-all's backward brings them home), so it is
divided by the data-parallel degree, not by the efsdp group: with ft's loss normaliser (methods/loss.py) that is one
process's gradient. The sum is forced where efsdp > 1 (FSDP2 applies another divide factor through PREMUL_SUM, which
gloo rejects); a one-rank efsdp mesh divides locally (torch _fsdp_collectives.foreach_reduce), a forced sum would
divide twice. Clipping adds each mesh's norm (engine._global_norm); DCP checkpoints hold each rank's experts.

What expert parallelism cannot run is config/parallel_checks.py's (the planner applies it; `parallelize` checks
the model itself).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

from finetune.config.parallel_checks import EP as KEY
from finetune.config.parallel_checks import expert_model_problems, expert_parallel_problems
from finetune.errors import FtError

DISPATCH = "ep_dispatch_experts"  # transformers' style of a module whose forward exchanges tokens with all-to-all


def facts_of(hf_config) -> SimpleNamespace:
    """The fields config.parallel_checks reads, from a transformers config (on the rank)."""
    c = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    experts = next(
        (getattr(c, k) for k in ("num_experts", "num_local_experts", "n_routed_experts") if getattr(c, k, 0)), 0
    )
    return SimpleNamespace(model_type=c.model_type, num_experts=experts)


# ---------------------------------------------------------------- on the rank
def expert_plan(model) -> dict[str, str]:
    """transformers' expert-parallel plan of `model` (a PreTrainedModel) for its own module and parameter names: each
    expert parameter's style listed before its module's (sharding a parameter sets the module's local expert count,
    which the dispatch reads when it is installed), as transformers expands it (DistributedMixin._expand_parallel_plan).
    """
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    wild = dict(getattr(model, "ep_plan", None) or {})
    plan = {}
    for name, module in model.named_modules():
        generic = replace_layer_number_by_wildcard(name)
        for pname, _ in module.named_parameters(recurse=False):
            if f"{generic}.{pname}" in wild:
                plan[f"{name}.{pname}"] = wild[f"{generic}.{pname}"]
        if generic in wild:
            plan[name] = wild[generic]
    return plan


def parallelize(model, grid) -> list:
    """Split the routed experts of `model` (the transformers model, on the meta device, before FSDP2) over the `ep`
    dimension of `grid` (mesh.expert_mesh); returns the experts modules (each to be its own FSDP unit)."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    from finetune.distributed.mesh import EP, ETP

    facts = facts_of(model.config)
    problems = expert_model_problems(facts, grid[EP].size(), f"set {KEY}: 1")
    plan = expert_plan(model)
    if not problems and DISPATCH not in plan.values():
        problems.append(f"{KEY}: {facts.model_type} has no expert-dispatch module in its plan; set {KEY}: 1")
    adapted = [n for n, p in model.named_parameters() if ".lora_" in n and _in_experts(n, plan)]
    if adapted:
        problems += expert_parallel_problems(
            None, grid[EP].size(), backend="fsdp", world_size=grid.size(), lora_on_experts=True
        )
    if problems:
        raise FtError(". ".join(problems))
    # GPUs: the parameters are split on meta without communication (distribute_tensor with src_data_rank=None), and the
    # dispatch keeps its counts and tokens on the hidden states' device (AllToAllEP._dispatch_tokens: send_counts on
    # hidden_states.device), CUDA tensors that the NCCL side of the "cpu:gloo,cuda:nccl" group exchanges
    apply_expert_parallelism(model, grid[EP], grid[ETP], plan)  # transformers 5.24's styles (module docstring)
    return [model.get_submodule(n) for n, style in plan.items() if style == DISPATCH]


def _in_experts(name: str, plan: dict[str, str]) -> bool:
    return any(style == DISPATCH and re.match(rf"{re.escape(m)}(\.|$)", name) for m, style in plan.items())


def shard(experts: list, grid, data_parallel: int, **fsdp_kwargs) -> None:
    """Make each experts module its own FSDP unit over the efsdp ranks, its gradients divided by the data-parallel
    degree (see the module docstring); before the decoder layers are sharded (FSDP2 wraps children first)."""
    from torch.distributed.fsdp import fully_shard

    from finetune.distributed.mesh import EFSDP

    holders = grid[EFSDP]
    for module in experts:
        fully_shard(module, mesh=holders, **fsdp_kwargs)
        module.set_gradient_divide_factor(float(data_parallel))
        if holders.size() > 1:  # GPUs too: NCCL's PREMUL_SUM zeroes bf16 up to torch 2.13 (transformers fsdp.py)
            module.set_force_sum_reduction_for_comms(True)
