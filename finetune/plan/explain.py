"""The reasons for the memory savers a plan turns on (or leaves off), and the runners-up it did not choose.

Each reason quotes the estimate with that one saver undone, at the same micro-batch, so a user sees what the saver
buys; `memory_headroom` says how much of the usable memory the plan leaves free and what it gave up for it; runners-up
are the best fit of every other candidate setup, fastest first, with their estimates.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from finetune.catalog import ModelFacts
from finetune.config.schema import Config
from finetune.config.vision_checks import geometry, images_per_sample
from finetune.hardware import Hardware
from finetune.plan import parallel
from finetune.plan.comm import Links
from finetune.plan.memory import VISION, Estimate, GiB, estimate
from finetune.plan.plan import Decision, choice
from finetune.plan.pricing import priced
from finetune.plan.search import (
    FILLING_PAYS,
    ROOMY,
    Fit,
    Topology,
    compensation,
    describe,
    device_capacity,
    fits,
    head_on_trained,
    host_shortfall,
    setup,
)

RUNNERS_UP = 5


def alternatives(chosen: Fit, others: tuple[Fit, ...], m: ModelFacts) -> tuple[dict, ...]:
    """The RUNNERS_UP fastest of `others`, each a different way to train: a setup that differs from the chosen one or
    from a faster runner-up only in how it loads the base (through host RAM or not) trains the same: it is left out."""
    seen, out = {_training(chosen)}, []
    for f in others:
        if _training(f) in seen:
            continue
        seen.add(_training(f))
        out.append(
            {
                "setup": describe(f, m),
                "gib": round(f.estimate.device_bytes / GiB, 2),
                "seconds": round(f.step_seconds, 4),
            }
        )
    return tuple(out[:RUNNERS_UP])


def _training(f: Fit) -> tuple:
    return replace(f.candidate, host_load=False), f.micro_batch_size, f.savers


@dataclass(frozen=True)
class _Undo:
    """The chosen fit and what the search saw, to quote the estimate with one saver undone."""

    config: Config
    fit: Fit
    m: ModelFacts
    hw: Hardware
    topo: Topology
    precision: str
    batch: int
    speeds: Links

    def text(self, **change) -> str:
        """'without it X GiB per device (verdict), with it Y GiB': the estimate at the same micro-batch with the savers
        changed as given, and why that was not chosen."""
        f, hw, savers = self.fit, self.hw, replace(self.fit.savers, **change)
        c, mb = f.candidate, f.micro_batch_size
        s = setup(self.config, hw, self.topo, self.precision, self.batch, c, mb, savers, self.m)
        est = estimate(self.m, s, self.topo.processes_per_node)
        need, usable = est.device_bytes / GiB, device_capacity(hw) / GiB
        if need > usable:
            verdict = f"does not fit; {usable:.1f} GiB usable"
        elif not fits(est, hw):
            verdict = "fits the device, but not host RAM: " + host_shortfall(est, hw)
        else:
            other = priced(Fit(c, mb, savers, est), self.topo, self.m, s, hw, self.speeds).step_seconds
            verdict = f"fits, but the step is slower: est. {other:.3g} s against {f.step_seconds:.3g} s"
        return f"without it {need:.1f} GiB per device ({verdict}), with it {f.estimate.device_bytes / GiB:.1f} GiB"


def record_savers(
    config: Config,
    fit: Fit,
    m: ModelFacts,
    hw: Hardware,
    topo: Topology,
    precision: str,
    batch: int,
    out: list[Decision],
    speeds: Links = Links(),
) -> None:
    """One Decision per saver: precision (when bf16-pure), loss, checkpointing, activation offload, step in
    backward."""
    undo = _Undo(config, fit, m, hw, topo, precision, batch, speeds)
    t, v = config.train, fit.savers
    if v.pure_bf16:
        reason = (
            "as set in the config"
            if t.precision == "bf16-pure"
            else "mixed precision does not fit: bf16 weights, gradients and optimizer states (8 bytes per trained "
            "parameter instead of 18) do; " + undo.text(pure_bf16=False)
        )
        _replace(out, Decision("precision", "bf16-pure", reason, "config" if t.precision == "bf16-pure" else "auto"))
        why = "stochastic rounding keeps updates smaller than bf16's precision in expectation, with no extra memory"
        out.append(choice("compensation", compensation(config), t.compensation, why))
    loss_why = {
        "plain": "the whole logits tensor fits: no recomputation of the output head",
        "chunked": "the logits are computed a chunk of tokens at a time and recomputed in backward (one more head "
        "forward); " + undo.text(loss="plain"),
        "liger": "Liger's fused linear-cross-entropy kernel is installed: no logits tensor, no recomputation cost",
        "cut_cross_entropy": "Cut Cross Entropy's fused kernel is installed: no logits tensor, no recomputation cost",
    }
    loss = choice("loss_implementation", v.loss, t.loss_implementation, loss_why[v.loss])
    out.append(replace(loss, reason=loss.reason + _trained_why(config, fit)) if v.loss == "plain" else loss)
    k, layers = v.checkpoint_layers, m.num_layers
    out.append(choice("gradient_checkpointing", k > 0, t.gradient_checkpointing, _checkpointing_why(undo)))
    out.append(
        choice(
            "checkpoint_layers",
            k,
            t.checkpoint_layers,
            f"{k} of {layers}: the fewest that fit at the fastest setup"
            + (" with room to spare (see memory_headroom)" if fit.fuller else ""),
        )
    )
    offload_why = (
        "activations wait in pinned host memory for the backward pass (PCIe traffic each micro-batch); "
        + undo.text(activation_offload=False)
        if v.activation_offload
        else "off: activations stay on the device"
    )
    out.append(choice("activation_offload", v.activation_offload, t.activation_offload, offload_why))
    in_backward_why = (
        "each parameter is updated as soon as its gradient is complete, so the whole model's gradients never exist "
        "at once; " + undo.text(optimizer_in_backward=False)
        if v.optimizer_in_backward
        else "off: one optimizer step after the backward pass"
        + ("" if hw.is_cpu or topo.world > 1 or t.max_grad_norm == 0 else " (it needs max_grad_norm: 0)")
    )
    out.append(choice("optimizer_in_backward", v.optimizer_in_backward, t.optimizer_in_backward, in_backward_why))


def _trained_why(config: Config, fit: Fit) -> str:
    """How many positions' logits the plain loss holds where it asks the model for the trained positions' only (one row
    a micro-batch: planner.one_row_batches, search.head_on_trained), and where that share comes from."""
    share = config.data.trained_share()
    if share is None or not head_on_trained(config, fit.candidate):
        return ""
    largest = "the largest share of a prepared row's positions trained"
    if share == 1:
        sized = f"every position of a row (ft train sizes them by {largest})"
    else:
        sized = f"{share:.1%} of a row's positions ({largest})"
    return f"; it asks the model for the trained positions' logits only, sized for {sized}"


def _checkpointing_why(undo: _Undo) -> str:
    """Why layers recompute their activations. With activation offload on, the device holds only the layers in flight
    either way (a recomputed layer one more): checkpointing then saves host RAM and PCIe traffic, since a checkpointed
    layer offloads only its input."""
    k, layers = undo.fit.savers.checkpoint_layers, undo.m.num_layers
    if not k:
        return "off: activations fit without recomputation"
    what = f"{k} of {layers} decoder layers recompute their activations (+{k / layers:.0%} of a forward pass)"
    if undo.fit.savers.activation_offload:
        what += (
            "; with activation offload on, this saves pinned host RAM and PCIe traffic rather than device memory (a "
            "checkpointed layer offloads only its input, and the layer being recomputed takes device memory)"
        )
    return what + "; " + undo.text(checkpoint_layers=0)


def record_headroom(fit: Fit, hw: Hardware, m: ModelFacts, out: list[Decision]) -> None:
    """The usable memory the plan leaves free, and why it leaves that much (search.prefer_room)."""
    usable, used = device_capacity(hw), fit.estimate.device_bytes
    share = used / usable
    if fit.fuller is not None:
        f = fit.fuller
        fuller = f.estimate.device_bytes / usable
        why = (
            f"fills {share:.0%} of the usable memory: {describe(f, m)} would fill {fuller:.0%} for an est. "
            f"{f.step_seconds:.3g} s step against {fit.step_seconds:.3g} s, too little gain for no room left for the "
            f"estimate's error (a micro-batch and savers that fill over {ROOMY:.0%} are chosen only when over "
            f"{FILLING_PAYS:.0%} faster)"
        )
    elif share > ROOMY:
        why = (
            f"fills {share:.0%} of the usable memory: the micro-batches and savers the config allows that leave "
            f"{1 - ROOMY:.0%} of it free are over {FILLING_PAYS:.0%} slower with this setup, or do not fit"
        )
    else:
        why = f"fills {share:.0%} of the usable memory"
    out.append(Decision("memory_headroom", f"{(usable - used) / GiB:.1f} GiB", why))


def record_vision(
    config: Config, m: ModelFacts, est: Estimate, images_why: str, trained: str, out: list[Decision]
) -> None:
    """A vision-language job's images as planned, one line each: tokens and patches per image with their source, the
    images per sample assumed, and the memory its tower takes (plan/memory.py's vision activations)."""
    g = geometry(config, m)
    if g is None:
        return
    n, seq_len = images_per_sample(config), config.data.seq_len
    out.append(
        Decision(
            "image_tokens",
            g.tokens,
            f"per image, in data.seq_len: {g.rule} ({g.source}); {n} per sample take {n * g.tokens} of {seq_len}",
        )
    )
    span = f", attending over {g.patches_per_tile} at a time" if g.tiles > 1 else ""
    out.append(Decision("image_patches", g.patches, f"per image, what the vision tower runs over{span} ({g.source})"))
    asked = config.data.image.per_sample is not None and images_why.startswith("as set")
    out.append(Decision("images_per_sample", n, images_why, "config" if asked else "auto"))
    how = (
        "the tower trains: its layers' activations are saved for backward"
        if trained == "all"
        else "the tower is frozen: nothing is saved for backward, one layer's working set in flight"
    )
    gib = est.device.get(VISION, 0) / GiB
    out.append(
        Decision(
            "vision_activations",
            f"{gib:.2f} GiB",
            f"per device, {how} (per micro-batch, {n} × {g.patches} patches per sequence)",
        )
    )


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
    cp_tried = len(parallel.cp_degrees(config, hw, topo, m)) > 1
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
            why = _untried(field, config, hw, topo, m)
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


def _untried(field: str, config: Config, hw: Hardware, topo: Topology, m: ModelFacts) -> str:
    """Why auto did not try a degree above 1."""
    if hw.is_cpu and field == "context_parallel":
        return "CPU: torch's ring attention replaces the CUDA attention kernels only"
    if hw.is_cpu:
        return "CPU: auto splits layers on GPUs only, where its collectives have fast links (an explicit degree runs)"
    if topo.world == 1:
        return "one device: nothing to split over"
    if field == "context_parallel":
        problems = parallel.cp_config_problems(config, hw, m)
        if problems:
            return "not tried: " + "; ".join(problems)
        return f"sequences of {config.data.seq_len} tokens: tried from {parallel.CP_MIN_SEQ} tokens on"
    problems = parallel.tp_config_problems(config)
    if problems:
        return "not tried: " + "; ".join(problems)
    if config.method.generation_tokens(config.data.seq_len):
        return "not tried: the method samples with the training model, which stays whole per rank"
    return "not tried: no degree that divides a node's GPUs divides the model's heads and MLP"
