"""Tensor parallelism (torch DTensor) of each decoder layer, under FSDP2 on a 2-D (dp × tp) mesh.

Per decoder layer, found by module names (Llama, Qwen2, Mistral, Gemma, Gemma2 and other families with the same
layer: `self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`, and norms that are direct children of the layer):
- q, k, v, gate and up projections are split column-wise (each rank computes its own heads and its own slice of the
  MLP's intermediate features); o and down projections row-wise, their partial sums reduce-scattered over the
  sequence (`Shard(1)`). The attention's local heads need no change: transformers 5.24 reshapes the projections with
  -1 heads of `head_dim` (modeling_llama.py `hidden_shape = (*input_shape, -1, self.head_dim)`), and the query/key
  group ratio is the same on every shard (heads and KV heads are both divided by tp).
- the layer's norms run sequence-parallel (`SequenceParallel`: each rank normalises its share of the positions);
  the attention and the MLP all-gather the sequence on entry. Between layers the hidden states are DTensors
  sharded on the sequence; the first layer's input (the embeddings' replicated output) is split there, the last
  layer's output all-gathered back, so the embeddings, the final norm and the output head see plain whole tensors.
- The embeddings, the final norm and the output head are not tensor-parallel: FSDP2 shards them over dp only.
- LoRA (peft `lora.Linear` around `base_layer`): for a column-wise base, lora_A stays whole on every rank and lora_B
  is split column-wise like the base (each rank adds its slice of B·A·x to its slice of the output); for a row-wise
  base, lora_A is split row-wise like the base (its partial products all-reduced) and lora_B is whole, its output
  split over the sequence like the base's. So the adapter's output and gradients equal one process's.
The data: the ranks of a tp group train on the same rows (runtime.data_rank). The loss normaliser needs no change:
summed over all ranks the trained tokens count tp times, divided by the world size (tp × dp) that is the step's tokens
over dp, what FSDP2's average over dp expects (methods/loss.py); token counts are summed once per tp group
(Runtime.distinct_sum); gradient clipping adds each mesh's norm (engine._global_norm).
What tensor parallelism cannot run is config/parallel_checks.py's (the planner applies it; `parallelize` again on the
rank).
"""

from __future__ import annotations

from types import SimpleNamespace

from finetune.config.parallel_checks import TP as KEY
from finetune.config.parallel_checks import tensor_parallel_problems
from finetune.errors import FtError
from finetune.quiet import quiet_tensor_parallel

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
_ATTENTION, _MLP = "self_attn", "mlp"


def facts_of(hf_config) -> SimpleNamespace:
    """The fields config.parallel_checks reads, from a transformers config (on the rank, where no catalog facts are at
    hand)."""
    c = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = c.num_attention_heads
    return SimpleNamespace(
        model_type=c.model_type,
        num_attention_heads=heads,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        intermediate_size=c.intermediate_size,
    )


def parallelize(model, tp_mesh, layers: list) -> None:
    """Split each decoder layer of `model` over `tp_mesh` (in place; before FSDP2 shards it over dp)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module

    tp = tp_mesh.size()
    dora = any(".lora_magnitude_vector." in n for layer in layers for n, _ in layer.named_parameters())
    problems = tensor_parallel_problems(facts_of(model.config), tp, backend="fsdp", processes_per_node=tp, dora=dora)
    if problems:
        raise FtError(". ".join(problems))
    quiet_tensor_parallel()
    kind = model.config.model_type
    for layer in layers:
        frozen = {n for n, p in layer.named_parameters() if not p.requires_grad}
        parallelize_module(layer, tp_mesh, layer_plan(layer, kind))
        for n, p in layer.named_parameters():  # SequenceParallel registers new parameters, trainable by default
            p.requires_grad_(n not in frozen)
    # the first layer splits its replicated input over the sequence; the last gathers its output back
    parallelize_module(
        layers[0], tp_mesh, PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),))
    )
    parallelize_module(
        layers[-1],
        tp_mesh,
        PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True),
    )


def layer_plan(layer, model_type: str) -> dict:
    """The parallel style of every module of one decoder layer that holds parameters, by its name in the layer;
    an FtError naming the model type where a parameter is left uncovered (a layer of another shape)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    children = dict(layer.named_children())
    for part in (_ATTENTION, _MLP):
        if part not in children:
            raise FtError(f"{KEY}: a {model_type} decoder layer has no `{part}` module; set {KEY}: 1")
    plan = {
        _ATTENTION: PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True,
        ),
        _MLP: PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
    }
    for part in (_ATTENTION, _MLP):
        for name, module in children[part].named_children():
            if name in COLUMN or name in ROW:
                plan.update(_linear_plan(f"{part}.{name}", module, name in COLUMN))
    for name in children:
        if name not in (_ATTENTION, _MLP) and "norm" in name.lower():
            plan[name] = SequenceParallel()
    _covers_every_parameter(layer, plan, model_type)
    return plan


def _linear_plan(name: str, module, column: bool) -> dict:
    """A projection's styles: the plain linear, or a LoRA layer's base and adapter matrices."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    base = ColwiseParallel() if column else RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    if not hasattr(module, "base_layer"):
        return {name: base}
    out = {f"{name}.base_layer": base}
    for adapter in getattr(module, "lora_A", {}):
        a, b = f"{name}.lora_A.{adapter}", f"{name}.lora_B.{adapter}"
        if column:  # A whole on every rank (its input and output are whole), B split like the base
            out[b] = ColwiseParallel()
        else:  # A split like the base (partial products all-reduced), B whole, its output split over the sequence
            out[a] = RowwiseParallel(output_layouts=Replicate(), use_local_output=False)
            out[b] = Replicated(output_layout=Shard(1))
    return out


def _covers_every_parameter(layer, plan: dict, model_type: str) -> None:
    """Every parameter of the layer belongs to a module the plan splits, replicates or runs sequence-parallel; a lora_A
    of a column-wise projection stays whole on purpose (see the module docstring)."""
    uncovered, splitting = [], [k for k in plan if k not in (_ATTENTION, _MLP)]  # those two only lay out inputs
    for pname, _ in layer.named_parameters():
        owner = pname.rsplit(".", 1)[0]
        covered = any(owner == k or owner.startswith(k + ".") for k in splitting) or (
            ".lora_A." in pname and any(owner.split(".lora_A.")[0].endswith(c) for c in COLUMN)
        )
        if not covered:
            uncovered.append(pname)
    if uncovered:
        raise FtError(
            f"{KEY}: ft's tensor-parallel plan does not cover {len(uncovered)} parameter(s) of a {model_type} decoder "
            f"layer ({', '.join(uncovered[:4])}): its layer differs from the Llama/Qwen2/Mistral/Gemma layout; set "
            f"{KEY}: 1"
        )


def Replicated(output_layout):  # noqa: N802 (a parallel style, named like torch's)
    """A module whose parameters are whole on every rank of the mesh (DTensors, so that their gradients are reduced
    where they come out partial), taking replicated input and handing its output on in `output_layout`."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class _Replicated(ParallelStyle):
        def _apply(self, module, mesh):
            def partition(name, mod, mesh):
                for pname, param in list(mod.named_parameters(recurse=False)):
                    whole = DTensor.from_local(param, mesh, [Replicate()], run_check=False)
                    mod.register_parameter(pname, torch.nn.Parameter(whole, requires_grad=param.requires_grad))

            def inputs(mod, args, mesh):
                x = args[0]
                x = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                return (x, *args[1:])

            def outputs(mod, out, mesh):
                return out.redistribute(mesh, [output_layout])

            return distribute_module(module, mesh, partition, inputs, outputs)

    return _Replicated()
