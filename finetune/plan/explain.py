"""The reasons for the memory savers a plan turns on (or leaves off), and the runners-up it did not choose.

Each reason quotes the estimate with that one saver undone, at the same micro-batch, so a user sees what the saver
buys; runners-up are the best fit of every other candidate setup, fastest first, with their estimates.
"""

from __future__ import annotations

from dataclasses import replace

from finetune.catalog import ModelFacts
from finetune.config.schema import Config
from finetune.hardware import Hardware
from finetune.plan import parallel
from finetune.plan.comm import Links
from finetune.plan.cost import forward_flops_per_token
from finetune.plan.memory import GiB, Setup, estimate
from finetune.plan.plan import Decision
from finetune.plan.scaling import predict
from finetune.plan.search import Fit, Topology, describe, device_capacity, fits, host_shortfall, setup

RUNNERS_UP = 5


def alternatives(others: tuple[Fit, ...], m: ModelFacts) -> tuple[dict, ...]:
    return tuple(
        {
            "setup": describe(f, m),
            "gib": round(f.estimate.device_bytes / GiB, 2),
            "seconds": round(f.step_seconds, 4),
        }
        for f in others[:RUNNERS_UP]
    )


def record_savers(
    config: Config,
    fit: Fit,
    m: ModelFacts,
    hw: Hardware,
    topo: Topology,
    precision: str,
    batch: int,
    out: list[Decision],
) -> None:
    """One Decision per saver: precision (when bf16-pure), loss, checkpointing, activation offload, step in
    backward."""
    t, v = config.train, fit.savers
    usable = device_capacity(hw) / GiB
    gib = fit.estimate.device_bytes / GiB

    def undone(**change) -> str:
        est = estimate(
            m,
            setup(config, hw, topo, precision, batch, fit.candidate, fit.micro_batch_size, replace(v, **change), m),
            topo.processes_per_node,
        )
        need = est.device_bytes / GiB
        if need > usable:
            verdict = f"does not fit; {usable:.1f} GiB usable"
        elif not fits(est, hw):
            verdict = "fits the device, but not host RAM: " + host_shortfall(est, hw)
        else:
            verdict = "fits, but the step is slower"
        return f"without it {need:.1f} GiB per device ({verdict}), with it {gib:.1f} GiB"

    if v.pure_bf16:
        reason = (
            "as set in the config"
            if t.precision == "bf16-pure"
            else "mixed precision does not fit: bf16 weights, gradients and optimizer states (8 bytes per trained "
            "parameter instead of 18) do; " + undone(pure_bf16=False)
        )
        _replace(out, Decision("precision", "bf16-pure", reason, "config" if t.precision == "bf16-pure" else "auto"))
        comp = t.compensation if t.compensation != "auto" else "stochastic_rounding"
        out.append(
            _choice(
                "compensation",
                comp,
                t.compensation,
                "stochastic rounding keeps updates smaller than bf16's precision in expectation, with no extra memory",
            )
        )
    loss_why = {
        "plain": "the whole logits tensor fits: no recomputation of the output head",
        "chunked": "the logits are computed a chunk of tokens at a time and recomputed in backward (one more head "
        "forward); " + undone(loss="plain"),
        "liger": "Liger's fused linear-cross-entropy kernel is installed: no logits tensor, no recomputation cost",
        "cut_cross_entropy": "Cut Cross Entropy's fused kernel is installed: no logits tensor, no recomputation cost",
    }
    out.append(_choice("loss_implementation", v.loss, t.loss_implementation, loss_why[v.loss]))
    layers = m.num_layers
    if v.checkpoint_layers:
        ckpt_why = (
            f"{v.checkpoint_layers} of {layers} decoder layers recompute their activations "
            f"(+{v.checkpoint_layers / layers:.0%} of a forward pass); " + undone(checkpoint_layers=0)
        )
    else:
        ckpt_why = "off: activations fit without recomputation"
    out.append(_choice("gradient_checkpointing", v.checkpoint_layers > 0, t.gradient_checkpointing, ckpt_why))
    out.append(
        _choice(
            "checkpoint_layers",
            v.checkpoint_layers,
            t.checkpoint_layers,
            f"{v.checkpoint_layers} of {layers}: the fewest that fit at the fastest setup",
        )
    )
    out.append(
        _choice(
            "activation_offload",
            v.activation_offload,
            t.activation_offload,
            "activations wait in pinned host memory for the backward pass (PCIe traffic each micro-batch); "
            + undone(activation_offload=False)
            if v.activation_offload
            else "off: activations stay on the device",
        )
    )
    out.append(
        _choice(
            "optimizer_in_backward",
            v.optimizer_in_backward,
            t.optimizer_in_backward,
            "each parameter is updated as soon as its gradient is complete, so the whole model's gradients never exist "
            "at once; " + undone(optimizer_in_backward=False)
            if v.optimizer_in_backward
            else "off: one optimizer step after the backward pass"
            + ("" if hw.is_cpu or topo.world > 1 or t.max_grad_norm == 0 else " (it needs max_grad_norm: 0)"),
        )
    )


def _choice(field: str, value, asked, reason: str) -> Decision:
    if asked != "auto":
        return Decision(field, value, "as set in the config", "config")
    return Decision(field, value, reason)


def _replace(out: list[Decision], decision: Decision) -> None:
    for i, d in enumerate(out):
        if d.field == decision.field:
            out[i] = decision
            return
    out.append(decision)


# ---------------------------------------------------------------- tensor and context parallelism, scaling
def record_parallel(
    config: Config, hw: Hardware, fit: Fit, others: tuple[Fit, ...], m: ModelFacts, topo: Topology, out: list[Decision]
) -> None:
    """The tensor- and context-parallel degrees, each with why (plan/parallel.py)."""
    d, c = config.distributed, fit.candidate
    everyone = (fit, *others)
    group = (c.adapter, c.quantization)
    tp_tried = len(parallel.tp_degrees(config, hw, topo, m)) > 1
    cp_tried = len(parallel.cp_degrees(config, hw, topo)) > 1
    for field, key, tried, what in (
        ("tensor_parallel", "tp", tp_tried, "split of its layers"),
        ("context_parallel", "cp", cp_tried, "split of its sequences"),
    ):
        value = getattr(c, key)
        if getattr(d, field) != "auto":
            out.append(Decision(field, value, "as set in the config", "config"))
            continue
        rivals = [f for f in everyone if (f.candidate.adapter, f.candidate.quantization) == group]
        if value > 1:
            without = [f for f in rivals if getattr(f.candidate, key) == 1]
            why = _pays(field, value, fit, without[0] if without else None, topo)
        elif not tried:
            why = _untried(field, config, hw, topo)
        else:
            split = [f for f in rivals if getattr(f.candidate, key) > 1]
            why = f"the fastest setup that fits needs no {what} (est. {fit.step_seconds:.3g} s/step" + (
                f"; with it at best {split[0].step_seconds:.3g})" if split else "; no setup with it fits)"
            )
        out.append(Decision(field, value, why))


def _pays(field: str, n: int, fit: Fit, without: Fit | None, topo: Topology) -> str:
    """Why a degree above 1 was chosen."""
    if field == "tensor_parallel":
        where = f"each layer split over {n} GPUs of a node (its collectives stay on the intra-node links)"
        gain = (
            f"each rank gathers 1/{n} of every layer across nodes"
            if topo.nodes > 1
            else "a layer's weights and activations are split"
        )
    else:
        where = f"each sequence split over {n} ranks (a ring exchanges keys and values)"
        gain = "one sequence's activations are split"
    if without is None:
        return f"{where}: nothing fits without it; with it {gain}"
    return (
        f"{where}: est. {fit.step_seconds:.3g} s/step against {without.step_seconds:.3g} without, as {gain} "
        f"(chosen when over {parallel.PAYS - 1:.0%} faster)"
    )


def _untried(field: str, config: Config, hw: Hardware, topo: Topology) -> str:
    """Why auto did not try a degree above 1."""
    if hw.is_cpu and field == "context_parallel":
        return "CPU: torch's ring attention replaces the CUDA attention kernels only"
    if hw.is_cpu:
        return "CPU: auto splits layers on GPUs only, where its collectives have fast links (an explicit degree runs)"
    if topo.world == 1:
        return "one device: nothing to split over"
    if field == "context_parallel":
        problems = parallel.cp_config_problems(config, hw)
        if problems:
            return "not tried: " + "; ".join(problems)
        return f"sequences of {config.data.seq_len} tokens: tried from {parallel.CP_MIN_SEQ} tokens on"
    problems = parallel.tp_config_problems(config)
    if problems:
        return "not tried: " + "; ".join(problems)
    if config.method.generation_tokens(config.data.seq_len):
        return "not tried: the method samples with the training model, which stays whole per rank"
    return "not tried: no degree that divides a node's GPUs divides the model's heads and MLP"


def scaling(fit: Fit, topo: Topology, m: ModelFacts, s: Setup, traffic: dict[str, float], speeds: Links) -> dict:
    """The chosen plan's predicted scaling (plan/scaling.py)."""
    if topo.world == 1:
        return {}
    per_token = forward_flops_per_token(m, s.seq_len)
    attention = 2 * s.seq_len * m.q_dim * m.num_layers / per_token
    c = fit.candidate
    return predict(
        fit.seconds,
        traffic,
        nodes=topo.nodes,
        sharding=c.sharding,
        per_node=topo.processes_per_node,
        tp=c.tp,
        cp=c.cp,
        layers=m.num_layers,
        micro_batches=s.accumulation,
        backward_share=2 / 3 if c.adapter == "full" else 1 / 2,
        attention_share=attention,
        speeds=speeds,
    )
