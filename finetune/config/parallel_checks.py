"""What tensor and expert parallelism cannot run, as rules over plain numbers and a model's facts: the planner applies
them to a job (plan/parallel.py, plan/expert_parallel.py, with the catalog's facts), the rank to the model it built
(distributed/tp.py, distributed/ep.py, with the facts read from its config). Each problem is one sentence naming the
key and the fix. No torch import."""

from __future__ import annotations

TP = "distributed.tensor_parallel"
EP = "distributed.expert_parallel"
TP_RULES = {  # what each rule of `tensor_parallel_problems` says, after "distributed.tensor_parallel: N"
    "backend": "composes with FSDP2 only, not with distributed.backend {backend}; set distributed.backend: fsdp, or "
    "{fix}",
    "quantization": "cannot split {quantization} quantized weights (bitsandbytes weights are not plain tensors); train "
    "a bf16/fp32 base (quantization: {{type: none}}), or {fix}",
    "dora": "does not split DoRA magnitudes; set adapter.dora: false, or {fix}",
    "samples": "does not run methods that sample during training (GRPO's rollouts draw different samples on each rank, "
    "where a tensor-parallel group must compute on the same tokens); {fix}",
    "stochastic_rounding": "does not run bf16-pure training with stochastic rounding (its noise is laid out by each "
    "rank's rows of a weight, which a row-wise split cuts across); use train.compensation: kahan or none, or {fix}",
    "sharding": "with distributed.sharding: hybrid_shard is not supported; use full_shard, or {fix}",
    "processes_per_node": "must divide the processes per node ({processes}): a tensor-parallel group stays inside one "
    "node; choose a divisor of {processes}",
    "world": "must divide the number of processes ({world_size})",
}


def tensor_parallel_problems(
    facts,
    tp: int,
    *,
    backend: str,
    quantization: str = "none",
    processes_per_node: int,
    world_size: int | None = None,
    sharding: str | None = None,
    dora: bool = False,
    samples: bool = False,
    stochastic_rounding: bool = False,
) -> list[str]:
    """What keeps tensor parallelism of degree `tp` from running this job, one sentence each naming
    distributed.tensor_parallel and the fix (empty: it can run). `facts`: catalog.ModelFacts, or anything with its
    fields model_type, num_attention_heads, num_kv_heads, intermediate_size (and optionally fused_qkv,
    fused_gate_up, qk_norm, num_experts, mlp); None: the model's layout is not checked (the rank checks it from the
    model itself)."""
    if tp <= 1:
        return []
    broken = {
        "backend": backend != "fsdp",
        "quantization": quantization not in ("none", None),
        "dora": dora,
        "samples": samples,
        "stochastic_rounding": stochastic_rounding,
        "sharding": sharding == "hybrid_shard",
        "processes_per_node": processes_per_node % tp,
        "world": world_size is not None and world_size % tp,
    }
    values = dict(backend=backend, quantization=quantization, processes=processes_per_node, world_size=world_size)
    values["fix"] = f"set {TP}: 1"
    problems = [f"{TP}: {tp} {TP_RULES[rule].format(**values)}" for rule, wrong in broken.items() if wrong]
    return problems + (layout_problems(facts, tp) if facts is not None else [])


def layout_problems(facts, tp: int) -> list[str]:
    kind = getattr(facts, "model_type", "this model")
    unsupported = [
        what
        for what, present in (
            (
                "a fused qkv_proj / gate_up_proj",
                getattr(facts, "fused_qkv", False) or getattr(facts, "fused_gate_up", False),
            ),
            ("per-head q/k norms", getattr(facts, "qk_norm", False)),
            ("mixture-of-experts layers", getattr(facts, "num_experts", 0)),
            ("a non-gated MLP", getattr(facts, "mlp", "gated") != "gated"),
        )
        if present
    ]
    problems = [
        f"{TP}: {tp}: ft's tensor-parallel plan does not cover {kind}'s {what}; set {TP}: 1" for what in unsupported
    ]
    for name, value in (
        ("attention heads", facts.num_attention_heads),
        ("KV heads", facts.num_kv_heads),
        ("MLP intermediate size", facts.intermediate_size),
    ):
        if value % tp:
            problems.append(f"{TP}: {tp} must divide the model's {name} ({value}); choose a divisor of {value}")
    return problems


EP_RULES = {  # what each rule of `check` says, after "distributed.expert_parallel: N"; ", or set ...: 1" follows
    "backend": "composes with FSDP2 only, not with distributed.backend {backend}; set distributed.backend: fsdp",
    "world": "must divide the number of processes ({world_size})",
    "quantization": "does not split a {quantization} quantized base (bitsandbytes weights are not fused expert "
    "tensors); train a bf16/fp32 base (quantization: {{type: none}})",
    "tensor_parallel": "does not combine with distributed.tensor_parallel; set tensor_parallel: 1",
    "context_parallel": "does not combine with distributed.context_parallel; set context_parallel: 1",
    "sharding": "with distributed.sharding: hybrid_shard is not supported; use full_shard",
    "offload": "keeps each rank's experts on its device (offload: all is not supported); set offload: none",
    "lora": "cannot split LoRA adapters of the routed experts: peft wraps fused expert weights in a ParamWrapper that "
    "adds B·A to the whole expert stack through a parametrization, which the expert-split forward bypasses; adapt the "
    "attention only (adapter.target_modules: [q_proj, k_proj, v_proj, o_proj]; the experts stay frozen)",
    "samples": "does not run methods that sample during training (a rank that stops generating early would leave the "
    "others waiting in the all-to-all)",
    "compile": "does not compile layers (the dispatch reads each layer's split sizes on the host); set train.compile: "
    "false",
}


def expert_parallel_problems(
    facts,
    ep: int,
    *,
    backend: str,
    world_size: int,
    quantization: str = "none",
    tensor_parallel: int = 1,
    context_parallel: int = 1,
    sharding: str | None = None,
    offload: str = "none",
    lora_on_experts: bool = False,
    samples: bool = False,
    compile: bool = False,
) -> list[str]:
    """What keeps expert parallelism of degree `ep` from running this job, one sentence each naming
    distributed.expert_parallel and the fix (empty: it can run). `facts`: catalog.ModelFacts, or anything with its
    fields model_type and num_experts; None: the model is not checked (the rank checks it from the model itself)."""
    if ep <= 1:
        return []
    broken = {
        "backend": backend != "fsdp",
        "world": world_size % ep,
        "quantization": quantization not in ("none", None),
        "tensor_parallel": tensor_parallel > 1,
        "context_parallel": context_parallel > 1,
        "sharding": sharding == "hybrid_shard",
        "offload": offload == "all",
        "lora": lora_on_experts,
        "samples": samples,
        "compile": compile,
    }
    values = dict(backend=backend, world_size=world_size, quantization=quantization)
    fix = f"set {EP}: 1"
    problems = [f"{EP}: {ep} {EP_RULES[rule].format(**values)}, or {fix}" for rule, wrong in broken.items() if wrong]
    return problems + (expert_model_problems(facts, ep, fix) if facts is not None else [])


def expert_model_problems(facts, ep: int, fix: str) -> list[str]:
    kind, experts = getattr(facts, "model_type", "this model"), getattr(facts, "num_experts", 0)
    if not experts:
        return [
            f"{EP}: {ep}: {kind} has no mixture-of-experts layers (expert parallelism splits routed experts); {fix}"
        ]
    if experts % ep:
        return [f"{EP}: {ep} must divide the model's {experts} experts per layer; choose a divisor of {experts}"]
    if not has_ep_plan(kind):
        return [
            f"{EP}: {ep}: transformers gives {kind} no expert-parallel plan (base_model_ep_plan), so its experts "
            f"cannot be split; {fix}"
        ]
    return []


def has_ep_plan(model_type: str) -> bool:
    """Whether transformers declares `base_model_ep_plan` for this model type (read from its config class; an unknown
    type is left to the rank, which reads the model's own plan)."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return True
    return bool(getattr(CONFIG_MAPPING[model_type], "base_model_ep_plan", None))
