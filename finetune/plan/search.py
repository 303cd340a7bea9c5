"""The search for the setup to run: for every candidate (plan/candidates.py) and every combination of memory savers
the config allows (plan/savers.py), the largest micro-batch whose estimate fits the hardware (plan/memory.py); then
the one with the least estimated step time: the work of plan/cost.py plus the communication of plan/comm.py that does
not hide behind it (plan/pricing.py). Within a candidate, a micro-batch and savers that fill more than ROOMY of the
usable memory are kept only when they are more than FILLING_PAYS faster than the fastest that leave room.

`finetune.plan.planner` records the result as Decisions; `finetune.plan.advice` reruns the same search on
relaxed configs when nothing fits. Both use this module; neither is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from finetune.catalog import ModelFacts
from finetune.config.moe_checks import lora_dropout
from finetune.config.schema import Config
from finetune.errors import PlanError
from finetune.hardware import Hardware
from finetune.plan import parallel
from finetune.plan import savers as saver_options
from finetune.plan.attention import estimated_kernel
from finetune.plan.candidates import Candidate, candidates, data_parallel, loading
from finetune.plan.comm import Links
from finetune.plan.memory import PINNED_ACTIVATIONS, Estimate, Setup, estimate
from finetune.plan.pricing import Fit, priced
from finetune.plan.savers import Savers, chunk_tokens
from finetune.plan.topology import Topology, pure_bf16_mode

GPU_HEADROOM = 0.04  # keep 4% of each GPU free (the estimate already counts the allocator's reserve and the context)
CPU_HEADROOM = 0.20  # the OS, page cache and the tokenizer also live in host RAM
HOST_HEADROOM = 0.10
PINNED_SHARE = 0.25  # of a node's usable RAM, at most, pinned for offloaded activations
# The estimate is for ranking setups, not a promise (median error 15% on published runs, tests/test_calibration.py):
# a micro-batch and savers that fill more than ROOMY of the usable memory are chosen only when they are more than
# FILLING_PAYS faster than the fastest ones of the same candidate that do not.
ROOMY = 0.90
FILLING_PAYS = 0.10


@dataclass(frozen=True)
class Outcome:
    """The chosen fit, and the best fit of every other candidate (`ft plan --explain-candidates`), fastest first."""

    chosen: Fit | None
    others: tuple[Fit, ...] = ()
    why: str = ""  # why the chosen adapter/quantization group won, when it is not the least compromise


# ---------------------------------------------------------------- the search
def search(
    config: Config, hw: Hardware, m: ModelFacts, topo: Topology, precision: str, batch: int, speeds: Links = Links()
) -> Outcome:
    """The fastest setup that fits (plan/cost.py), among the candidates of the least compromising adapter and
    quantization unless another is at least SPEEDUP_TO_COMPROMISE times faster (a 4-bit base beats a 16-bit one
    streamed from host RAM). Pure bf16 only when nothing fits in mixed precision (unless the config asks for it)."""
    saver_options.check_in_backward(config, topo.world)
    parallel.check(config, hw, topo, m)
    mode = pure_bf16_mode(config, hw)
    outcome = _search(config, hw, m, topo, precision, batch, pure=mode == "always", speeds=speeds)
    if outcome.chosen is None and mode == "fallback":
        return _search(config, hw, m, topo, precision, batch, pure=True, speeds=speeds)
    return outcome


SPEEDUP_TO_COMPROMISE = 2.0


def _search(
    config: Config,
    hw: Hardware,
    m: ModelFacts,
    topo: Topology,
    precision: str,
    batch: int,
    pure: bool,
    speeds: Links = Links(),
) -> Outcome:
    fits = []
    for cand in candidates(config, hw, topo, m):
        fit = fit_candidate(config, hw, m, topo, precision, batch, cand, pure, speeds)
        if fit is not None:
            fits.append(fit)
    if not fits:
        return Outcome(None)
    ranked = sorted(fits, key=lambda f: f.step_seconds)  # stable: ties keep the order of `candidates`
    groups = list(dict.fromkeys((f.candidate.adapter, f.candidate.quantization) for f in fits))
    fastest, why = _plain_unless_it_pays(config, ranked[0], ranked), ""
    chosen = next(f for f in ranked if (f.candidate.adapter, f.candidate.quantization) == groups[0])
    chosen = _plain_unless_it_pays(config, chosen, ranked)
    if chosen.step_seconds > SPEEDUP_TO_COMPROMISE * fastest.step_seconds:
        why = (
            f"{chosen.candidate.adapter} with quantization {chosen.candidate.quantization} only fits as "
            f"{describe(chosen, m)} (est. {chosen.step_seconds:.3g} s/step); {describe(fastest, m)} is "
            f"{chosen.step_seconds / fastest.step_seconds:.1f}× faster (est. {fastest.step_seconds:.3g} s/step)"
        )
        chosen = fastest
    return Outcome(chosen, tuple(f for f in ranked if f is not chosen), why)


def plain(config: Config, c: Candidate) -> bool:
    """No tensor or context parallelism beyond what the config asks for."""
    d = config.distributed
    return (c.tp, c.cp) == (parallel.asked(d.tensor_parallel) or 1, parallel.asked(d.context_parallel) or 1)


def _plain_unless_it_pays(config: Config, chosen: Fit, ranked: list[Fit]) -> Fit:
    """Tensor or context parallelism only where it pays: more than parallel.PAYS faster than the best setup without
    (the fastest fit of the same adapter and quantization without tensor or context parallelism of its own choosing),
    or the only one that fits."""
    if plain(config, chosen.candidate):
        return chosen
    group = (chosen.candidate.adapter, chosen.candidate.quantization)
    same = (f for f in ranked if (f.candidate.adapter, f.candidate.quantization) == group)
    other = next((f for f in same if plain(config, f.candidate)), None)
    return other if other is not None and other.step_seconds <= parallel.PAYS * chosen.step_seconds else chosen


def describe(fit: Fit, m: ModelFacts) -> str:
    """One line for a setup: adapter, backend, micro-batch and savers."""
    c = fit.candidate
    adapter = c.adapter + (f" ({c.quantization})" if c.quantization != "none" else "")
    backend = (
        c.backend + (f" {c.sharding}" if c.sharding else "") + (f", offload {c.offload}" if c.offload != "none" else "")
    ) + (", loaded through host RAM" if c.host_load else "")
    inner = "".join(f", {k} {v}" for k, v in (("tensor parallel", c.tp), ("context parallel", c.cp)) if v > 1)
    return f"{adapter}, {backend}{inner}, micro-batch {fit.micro_batch_size}, {fit.savers.describe(m.num_layers)}"


def fit_candidate(
    config: Config,
    hw: Hardware,
    m: ModelFacts,
    topo: Topology,
    precision: str,
    batch: int,
    cand: Candidate,
    pure: bool = False,
    speeds: Links = Links(),
) -> Fit | None:
    """The fastest combination of micro-batch and savers that fits this candidate (`prefer_room`): for each
    combination the config allows, the largest micro-batch that fits (memory grows with it), and, where that fills
    more than ROOMY of the usable memory, the largest that does not."""
    sizes, per_rank = _sizes(config, topo, batch, cand)
    found: list[Fit] = []
    for combo in saver_options.combinations(config, hw, m, cand.backend, topo.world, pure, cand.sharding):
        allowed = [per_rank] if combo.optimizer_in_backward else sizes  # no accumulation with the step in backward
        if combo.optimizer_in_backward and per_rank not in sizes:
            continue
        fit = _largest_fit(config, hw, m, topo, precision, batch, cand, combo, allowed, speeds)
        if fit is None:
            continue
        found.append(fit)
        if not roomy(fit, hw):
            room = _largest_fit(config, hw, m, topo, precision, batch, cand, combo, allowed, speeds, ROOMY)
            found += [room] if room is not None else []
        elif fit.micro_batch_size == sizes[-1] and _free(combo) and fit is min(found, key=lambda f: f.step_seconds):
            break  # the largest micro-batch without any saver, with room to spare: nothing can be better
    return prefer_room(sorted(found, key=lambda f: f.step_seconds), hw) if found else None


def _sizes(config: Config, topo: Topology, batch: int, cand: Candidate) -> tuple[list[int], int]:
    """The micro-batch sizes to try, ascending, and the sequences each data-parallel rank gets per step."""
    dp = data_parallel(topo.world, cand)
    per_rank = batch // dp
    t = config.train
    sizes = divisors(per_rank) if t.micro_batch_size == "auto" else [t.micro_batch_size]
    if t.micro_batch_size != "auto" and per_rank % t.micro_batch_size:
        raise PlanError(
            f"train.micro_batch_size: {t.micro_batch_size} does not divide the {per_rank} sequences each rank "
            f"gets per step (global batch {batch} over {dp}{' data-parallel' if dp < topo.world else ''} ranks); "
            f"use one of {divisors(per_rank)} or auto"
        )
    if t.optimizer_in_backward is True and per_rank not in sizes:
        raise PlanError(
            f"train.optimizer_in_backward: true steps after every backward pass, so a step must be one micro-batch, "
            f"but micro_batch_size {t.micro_batch_size} is less than the {per_rank} sequences each rank gets per step; "
            f"set train.micro_batch_size: {per_rank} (or auto), or train.global_batch_size: "
            f"{t.micro_batch_size * dp}"
        )
    return sizes, per_rank


def roomy(fit: Fit, hw: Hardware) -> bool:
    """The fit leaves room for the estimate's error: it fills at most ROOMY of the usable memory."""
    return fit.estimate.device_bytes <= ROOMY * device_capacity(hw)


def prefer_room(ranked: list[Fit], hw: Hardware) -> Fit:
    """The fastest of `ranked` (one candidate's fits, fastest first), unless it fills more than ROOMY of the usable
    memory and the fastest that does not is at most FILLING_PAYS slower: then that one, which keeps the one it
    displaced (`fuller`). Between candidates (backend, sharding, offload) the search goes by speed alone."""
    fastest = ranked[0]
    room = next((f for f in ranked if roomy(f, hw)), None)
    if roomy(fastest, hw) or room is None or room.step_seconds > (1 + FILLING_PAYS) * fastest.step_seconds:
        return fastest
    return replace(room, fuller=fastest)


def _free(combo: Savers) -> bool:
    return combo.loss not in ("chunked",) and not combo.checkpoint_layers and not combo.activation_offload


def _largest_fit(config, hw, m, topo, precision, batch, cand, combo, sizes, speeds=Links(), share=1.0) -> Fit | None:
    """Binary search over ascending `sizes` for the largest micro-batch whose estimate fits (in `share` of the usable
    memory)."""
    lo, hi, found = 0, len(sizes) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        s = setup(config, hw, topo, precision, batch, cand, sizes[mid], combo, m)
        est = estimate(m, s, topo.processes_per_node)
        if fits(est, hw, share):
            found, lo = (sizes[mid], est, s), mid + 1
        else:
            hi = mid - 1
    if found is None:
        return None
    mb, est, s = found
    return priced(Fit(cand, mb, combo, est), topo, m, s, hw, speeds)


def divisors(n: int) -> list[int]:
    """Every divisor of n, ascending, in O(sqrt n)."""
    import math

    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def setup(
    config: Config,
    hw: Hardware,
    topo: Topology,
    precision: str,
    batch: int,
    cand: Candidate,
    mb: int,
    savers: Savers,
    m: ModelFacts,
) -> Setup:
    """The memory estimator's view of one candidate."""
    a, method = config.adapter, config.method
    dp = data_parallel(topo.world, cand)
    # FSDP's group: a node (hybrid_shard), else the data- and context-parallel ranks of one tensor-parallel slot
    shard_size = topo.processes_per_node if cand.sharding == "hybrid_shard" else topo.world // cand.tp
    # the kernel the planner will choose for this model (plan/attention.py): eager's T×T scores, flex's block mask
    attn = estimated_kernel(config, hw, m)
    gen_tokens = method.generation_tokens(config.data.seq_len) if topo.engine.samples else 0
    targets = a.target_modules if isinstance(a.target_modules, str) else tuple(a.target_modules)
    return Setup(
        adapter=cand.adapter,
        quantization=cand.quantization,
        precision=precision,
        optimizer=config.train.optimizer,
        micro_batch_size=mb,
        seq_len=config.data.seq_len,
        gradient_checkpointing=savers.checkpoint_layers > 0,
        checkpoint_layers=savers.checkpoint_layers,
        pure_bf16=savers.pure_bf16,
        compensation=compensation(config) if savers.pure_bf16 else "none",
        loss=savers.estimator_loss,
        trained_share=trained_share(config, cand),
        loss_chunk_tokens=chunk_tokens(m) if savers.loss == "chunked" else 0,
        activation_offload=savers.activation_offload,
        optimizer_in_backward=savers.optimizer_in_backward,
        sharding=cand.sharding,
        shard_size=shard_size if cand.sharding else 1,
        offload=cand.offload,
        lora_r=a.r,
        lora_targets=targets,
        lora_dropout=lora_dropout(a, m, cand.adapter),
        dora=a.dora,
        modules_to_save=tuple(a.modules_to_save),
        double_quant=config.quantization.double_quant,
        attention=attn,
        sequences_per_row=method.sequences_per_row,
        reference_copy=method.reference_kind(cand.adapter) == "copy",
        generation_tokens=gen_tokens,
        generation_batch=batch // dp if gen_tokens else 0,
        accelerator=not hw.is_cpu,
        loading=loading(cand),
        accumulation=batch // dp // mb,
        rollout_bytes=topo.engine.device_bytes,
        rollout_sleeps=topo.engine.sleeps,
        rollout_host_bytes=topo.engine.host_bytes,
        reward_models=reward_models(method),
        head=method.head,
        tensor_parallel=cand.tp,
        context_parallel=cand.cp,
        **vision_split(config, m, cand.adapter),
    )


def head_on_trained(config: Config, cand: Candidate) -> bool:
    """Whether the plain loss asks the model for the trained positions' logits only (methods/head.py): a loss summed
    over tokens and each row whole on the rank (no tensor or context parallelism). Whether each micro-batch is one row
    the planner has said already, by giving the section its trained share (planner.one_row_batches)."""
    return config.method.summed_loss and cand.tp == 1 and cand.cp == 1


def trained_share(config: Config, cand: Candidate) -> float:
    """The share of a micro-batch's positions whose logits the plain loss holds: where it runs the head on the trained
    positions only, the largest share of a prepared row's positions trained (every position before the data is
    prepared: an upper bound); else every position."""
    share = config.data.trained_share()
    return share if share is not None and head_on_trained(config, cand) else 1.0


def vision_split(config, m: ModelFacts, adapter: str) -> dict:
    """Setup's vision fields: what of a vision-language model's vision side trains (model.train_vision,
    config/vision_checks.py: the tower stays frozen unless `all`, the projector trains with `projector` or `all`), and
    the patches its tower runs over per sequence (the images per sample the plan assumes, each the largest the
    processor makes)."""
    from finetune.config.vision_checks import geometry, images_per_sample, train_vision, trains_images

    if not trains_images(config, m):
        return {}
    trained = train_vision(config, adapter)[0]
    tower, projector = m.vision_params - m.projector_params, m.projector_params
    parts = {"none": 0, "projector": projector, "all": tower + projector}[trained]
    split = {"vision_frozen": tower + projector - parts} if adapter == "full" else {"vision_trained": parts}
    g = geometry(config, m)
    if g is None:
        return split
    patches = {"vision_patches": images_per_sample(config) * g.patches, "vision_span": g.patches_per_tile}
    return {**split, **patches, "tower_trains": trained == "all"}


def reward_models(method) -> tuple:
    """GRPO's rewards by trained reward models: (architecture, batch_size) of each, from its config.json (checked: a
    sequence classifier with one output; no weights are read)."""
    from finetune.plan.reward_models import classifier_facts

    specs = enumerate(method.reward_specs())
    return tuple((classifier_facts(r, i), r.batch_size) for i, r in specs if r.model is not None)


def compensation(config: Config) -> str:
    c = config.train.compensation
    return "stochastic_rounding" if c == "auto" else c


def device_capacity(hw: Hardware) -> int:
    return int(hw.device_memory_bytes * (1 - (CPU_HEADROOM if hw.is_cpu else GPU_HEADROOM)))


def host_capacity(hw: Hardware) -> int:
    return int(hw.host_memory_bytes * (1 - HOST_HEADROOM))


def fits(est: Estimate, hw: Hardware, share: float = 1.0) -> bool:
    """The estimate fits `share` of the usable device memory, and host RAM."""
    if est.device_bytes > share * device_capacity(hw):
        return False
    if est.host.get(PINNED_ACTIVATIONS, 0) > PINNED_SHARE * host_capacity(hw):
        return False  # page-locked memory the OS cannot swap: a bounded share of the node's RAM
    return hw.is_cpu or est.host_bytes <= host_capacity(hw)


def host_shortfall(est: Estimate, hw: Hardware) -> str:
    """Why an estimate that fits the device does not fit host RAM, in words."""
    pinned = est.host.get(PINNED_ACTIVATIONS, 0)
    if pinned > PINNED_SHARE * host_capacity(hw):
        return (
            f"{pinned / 2**30:.1f} GiB of pinned activations per node, more than the {PINNED_SHARE:.0%} of its "
            f"{host_capacity(hw) / 2**30:.1f} GiB usable RAM that may be pinned"
        )
    return f"{est.host_bytes / 2**30:.1f} GiB per node, {host_capacity(hw) / 2**30:.1f} GiB usable"
