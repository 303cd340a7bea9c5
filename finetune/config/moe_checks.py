"""What a LoRA adapter and the loss can do on a mixture-of-experts model, known before the model is loaded.

Rules that need the model's facts (is it MoE, which family), so `ft validate` (where the facts are at hand) and
`ft plan` run them, not the config-only rules of checks.py. The rank side applies the same rules to the loaded
model (adapters.lora_targets, methods/router.py), so what is refused here never fails at step 1.

- peft adapts the fused 3-D expert weights of transformers 5 through lora.ParamWrapper (`target_parameters`), which
  has no input dropout and no DoRA. `all-linear`, or a list naming the experts or the MLP projections (which peft
  0.21 maps onto the fused experts in the families whose checkpoints transformers converts), reaches them: the
  dropout is 0 there (ft's default 0.05 is replaced, with the reason in the plan) and an explicit one is refused.
- The router's load-balancing loss exists where transformers defines one for the family (`load_balancing_loss_func`
  in its modeling module); `train.router_aux_loss_coef` set to a number elsewhere is refused.
"""

from __future__ import annotations

from finetune.errors import Problem

# names in an explicit target list that reach fused expert weights (or, through peft's conversion, map onto them)
EXPERT_NAMES = frozenset({"experts", "gate_up_proj", "down_proj", "gate_proj", "up_proj", "w1", "w2", "w3"})
_DROPOUT = ("adapter", "dropout")
_DORA = ("adapter", "dora")
_COEF = ("train", "router_aux_loss_coef")
_ATTENTION_ONLY = "adapter.target_modules: [q_proj, k_proj, v_proj, o_proj] (attention only, no experts)"


def reaches_experts(adapter) -> bool:
    """The adapter's targets include fused expert weights on an MoE model (or may, through peft's name mapping)."""
    if adapter.type == "full":
        return False
    wanted = adapter.target_modules
    return wanted == "all-linear" or any(name.rsplit(".", 1)[-1] in EXPERT_NAMES for name in wanted)


def dropout_problem(adapter) -> Problem | None:
    """An explicit adapter.dropout above 0 where the adapter reaches the fused experts."""
    if not (adapter.explicit("dropout") and adapter.dropout > 0):
        return None
    return Problem(
        (_DROPOUT,),
        f"{adapter.dropout} cannot apply to this mixture-of-experts model's fused expert weights: peft adapts them "
        "through lora.ParamWrapper, which adds the low-rank update to the weight itself, leaving no adapter input "
        "to drop out (peft refuses lora_dropout != 0 there); ft trains MoE adapters with dropout 0",
        f"remove adapter.dropout (ft then uses 0), or set {_ATTENTION_ONLY} to keep the dropout",
    )


def dora_problem(adapter) -> Problem | None:
    """DoRA where the adapter reaches the fused experts."""
    if not adapter.dora:
        return None
    return Problem(
        (_DORA,),
        "peft adapts this mixture-of-experts model's fused expert weights through lora.ParamWrapper, which does not "
        "do DoRA",
        f"set adapter.dora: false, or {_ATTENTION_ONLY}",
    )


def family_aux_loss(model_type: str) -> bool | None:
    """Whether transformers defines a load-balancing loss for the family (its modeling module's
    `load_balancing_loss_func`, which the model's forward calls); None when the module cannot be imported."""
    import importlib

    try:
        from transformers.models.auto.configuration_auto import model_type_to_module_name

        name = model_type_to_module_name(model_type)
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except (ImportError, ValueError, KeyError):
        return None
    return hasattr(module, "load_balancing_loss_func")


def aux_problem(train, facts) -> Problem | None:
    """An explicit router_aux_loss_coef above 0 on a model without a load-balancing loss."""
    coef = train.router_aux_loss_coef
    if coef == "auto" or coef == 0:
        return None
    fix = "remove train.router_aux_loss_coef (or set it to 0)"
    if not facts.is_moe:
        return Problem((_COEF,), f"{facts.name} is a dense model: it has no router to balance", fix)
    if family_aux_loss(facts.model_type) is False:
        return Problem(
            (_COEF,),
            f"transformers defines no load-balancing loss for {facts.model_type} (it balances its experts without "
            "one: a routing bias, or none)",
            fix,
        )
    return None


def moe_problems(config, facts) -> list[Problem]:
    """Every problem of the adapter and the loss on this model, all at once."""
    out = [aux_problem(config.train, facts)]
    if facts.is_moe and reaches_experts(config.adapter):
        out += [dropout_problem(config.adapter), dora_problem(config.adapter)]
    return [p for p in out if p is not None]


def lora_dropout(section, facts, adapter: str) -> float:
    """The LoRA dropout trained with (Plan.lora_dropout) for the chosen `adapter`: adapter.dropout (`section`), or 0
    where it reaches an MoE model's fused experts (an explicit one is refused by `moe_problems`); 0 for full
    fine-tuning. The rank side gives peft the same (adapters.lora_targets)."""
    if adapter == "full" or (facts.is_moe and reaches_experts(section)):
        return 0.0
    return float(section.dropout)


def moe_notes(config, facts, adapter: str, quantization: str) -> list[tuple[str, str, str]]:
    """(key, value, reason) of what ft does on an MoE model with the chosen adapter and quantization, for the plan."""
    if not facts.is_moe:
        return []
    out = [_aux_note(config.train, facts)]
    a = config.adapter
    if adapter == "full" or not reaches_experts(a):
        return out
    value = "attention, dense MLPs, shared and routed experts" if a.target_modules == "all-linear" else "as listed"
    out.append(
        (
            "adapter.target_modules",
            f"{a.target_modules if a.target_modules == 'all-linear' else list(a.target_modules)}: {value}",
            "the routed experts' fused weights through peft's target_parameters; routers and the gates beside the "
            "experts are never adapted: they decide where each token goes (and Llama 4's router returns a tuple "
            "that peft's LoRA layer cannot wrap)",
        )
    )
    if a.dropout > 0 and lora_dropout(a, facts, adapter) == 0:
        out.append(
            (
                "adapter.dropout",
                "0",
                "peft's lora.ParamWrapper, which adapts the fused experts, cannot drop out its input",
            )
        )
    if quantization in ("nf4", "int8"):
        out.append(
            (
                "expert weights",
                f"16-bit (the {quantization} base quantizes linear layers)",
                "bitsandbytes quantizes nn.Linear layers only: the fused expert weights stay 16-bit, and so does "
                "any linear layer the installed peft adapts only through target_parameters, which cannot wrap a 4-bit "
                "weight (peft 0.21 does so for the dense MLPs and shared experts of converted MoE families)",
            )
        )
    return out


def _aux_note(train, facts) -> tuple[str, str, str]:
    coef, has = train.router_aux_loss_coef, family_aux_loss(facts.model_type)
    logged = "expert use (tokens per expert, min/max share) is logged as experts/* every output.log_steps"
    if has is False or coef == 0:
        why = "set to 0" if coef == 0 else f"transformers defines no load-balancing loss for {facts.model_type}"
        return "train.router_aux_loss_coef", "off", f"{why}; {logged}"
    value = "auto: the model's own" if coef == "auto" else str(coef)
    return (
        "train.router_aux_loss_coef",
        value,
        "coef × the router's load-balancing loss (transformers' load_balancing_loss_func over each micro-batch's "
        f"non-padding tokens) is added to the loss and logged as aux_loss; {logged}",
    )
