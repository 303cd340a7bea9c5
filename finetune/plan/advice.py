"""When nothing fits: the estimate, and the concrete changes that would fit, each with its estimate.

Each option relaxes one thing (a choice the user pinned, or the hardware) and reruns the same search,
so every number quoted is what `ft plan` would print after that change.
"""

from __future__ import annotations

from collections.abc import Callable

from finetune.catalog import ModelFacts
from finetune.config.schema import Config
from finetune.errors import PlanError
from finetune.hardware import Hardware
from finetune.plan import candidates, savers, search, topology
from finetune.plan.memory import Estimate, GiB, estimate

Relaxation = tuple[str, Callable[[Config], Config]]


def _set(config: Config, section: str, **values) -> Config:
    return config.model_copy(update={section: getattr(config, section).model_copy(update=values)})


def relaxations(config: Config) -> list[Relaxation]:
    """One-change edits of the config, most preferable first; only those that change something."""
    a, q, t, d = config.adapter, config.quantization, config.train, config.distributed
    out: list[Relaxation] = []
    if t.micro_batch_size != "auto":
        out.append(("`train.micro_batch_size: auto`", lambda c: _set(c, "train", micro_batch_size="auto")))
    if t.gradient_checkpointing is False or t.checkpoint_layers != "auto":
        out.append(
            (
                "`train.gradient_checkpointing: auto` (and checkpoint_layers: auto)",
                lambda c: _set(c, "train", gradient_checkpointing="auto", checkpoint_layers="auto"),
            )
        )
    if t.loss_implementation == "plain":
        out.append(("`train.loss_implementation: auto`", lambda c: _set(c, "train", loss_implementation="auto")))
    if t.activation_offload is False:
        out.append(("`train.activation_offload: auto`", lambda c: _set(c, "train", activation_offload="auto")))
    if t.optimizer not in ("adamw_8bit", "paged_adamw_8bit"):
        out.append(("`train.optimizer: adamw_8bit`", lambda c: _set(c, "train", optimizer="adamw_8bit")))
    if a.type == "full" and t.precision in ("bf16", "fp32", "fp16"):
        out.append(("`train.precision: bf16-pure`", lambda c: _set(c, "train", precision="bf16-pure")))
    if a.type == "full":
        out.append(("`adapter.type: lora`", lambda c: _set(c, "adapter", type="lora")))
    if a.type != "qlora" and q.type in ("auto", "none"):
        out.append(
            ("`adapter.type: qlora`", lambda c: _set(_set(c, "adapter", type="qlora"), "quantization", type="nf4"))
        )
    if d.backend not in ("auto",) or d.offload == "none" or d.sharding != "auto":
        out.append(
            (
                "`distributed: {backend: auto, sharding: auto, offload: auto}`",
                lambda c: _set(c, "distributed", backend="auto", sharding="auto", offload="auto"),
            )
        )
    return out


def _scaled(hw: Hardware) -> list[tuple[str, Hardware]]:
    """More of the same accelerator: up to 8 per node, then more nodes."""
    if hw.is_cpu:
        return []
    out = []
    for n in (2, 4, 8):
        if hw.devices_per_node < n:
            out.append((f"{n} × {hw.accelerator.name} per node", topology.with_hardware(hw, devices_per_node=n)))
    for n in (2, 4, 8):
        if hw.nodes < n and hw.devices_per_node * n >= 2:
            out.append((f"{n} nodes", topology.with_hardware(hw, nodes=n)))
    return out


def _try(config: Config, hw: Hardware, m: ModelFacts, like: topology.Topology | None = None) -> Estimate | None:
    """The estimate of what the planner would choose for `config` on `hw`, or None when that does not plan (for any
    reason: an alternative's own errors are never shown to the user). `like`: the refused plan's topology, whose
    rollout pool and engine share the alternative keeps."""
    pool, engine = (like.rollout_gpus, like.engine) if like else (0, topology.EngineShare())
    try:
        topo = topology.choose_topology(config, hw, [], pool, engine)
        precision = topology.choose_precision(config, hw, [])
        batch = topology.choose_global_batch(config, topo, [])
        fit = search.search(config, hw, m, topo, precision, batch).chosen
    except PlanError:
        return None
    return fit.estimate if fit else None


def options(config: Config, hw: Hardware, m: ModelFacts, limit: int = 4, like=None) -> list[str]:
    """Changes to the config that fit this hardware, each with the per-device estimate it would be planned with."""
    found: list[str] = []
    for label, edit in relaxations(config):
        est = _try(edit(config), hw, m, like)
        if est is not None:
            found.append(f"{label} (est. {est.device_bytes / GiB:.1f} GiB)")
    return found[:limit]


def more_hardware(config: Config, hw: Hardware, m: ModelFacts) -> str | None:
    """The smallest step up in hardware on which the config (with a sharding backend) would fit, for when no change to
    the config fits this hardware."""
    backend = "fsdp" if config.distributed.backend in ("auto", "single", "ddp") else config.distributed.backend
    edited = _set(config, "distributed", backend=backend, sharding="auto", nodes="auto", processes_per_node="auto")
    if config.train.micro_batch_size != "auto":
        edited = _set(edited, "train", micro_batch_size="auto")
    for label, bigger in _scaled(hw):
        est = _try(edited, bigger, m)
        if est is not None:
            return (
                f"{label} with `distributed.backend: {backend}` would fit (est. {est.device_bytes / GiB:.1f} GiB; "
                f"check with ft plan --hardware {spec(bigger)})"
            )
    return None


def spec(hw: Hardware) -> str:
    """The --hardware spelling of described GPU hardware, e.g. 2x8xH100-80GB."""
    gpus = f"{hw.devices_per_node}x{hw.accelerator.name}"
    return f"{hw.nodes}x{gpus}" if hw.nodes > 1 else gpus


def smallest_estimate(config: Config, hw: Hardware, m: ModelFacts, topo, precision: str, batch: int) -> Estimate:
    """The smallest per-device estimate among the setups the config allows (micro-batch 1, every saver it allows)."""
    best: Estimate | None = None
    t = config.train
    mb = 1 if t.micro_batch_size == "auto" else t.micro_batch_size
    pure = topology.pure_bf16_mode(config, hw) != "never"
    for cand in candidates.candidates(config, hw, topo, m):
        for combo in savers.combinations(config, hw, m, cand.backend, topo.world, pure, cand.sharding):
            s = search.setup(config, hw, topo, precision, batch, cand, mb, combo, m)
            est = estimate(m, s, topo.processes_per_node)
            if best is None or est.device_bytes < best.device_bytes:
                best = est
    assert best is not None
    return best


def no_fit_error(config: Config, hw: Hardware, m: ModelFacts, topo, precision: str, batch: int) -> PlanError:
    est = smallest_estimate(config, hw, m, topo, precision, batch)
    unit = "process" if hw.is_cpu else "GPU"
    need, have = est.device_bytes / GiB, search.device_capacity(hw) / GiB
    top = sorted(est.device.items(), key=lambda kv: -kv[1])[:4]
    parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in top)
    msg = (
        f"{m.name} does not fit: needs {need:.1f} GiB per {unit} ({parts}), {have:.1f} GiB usable of "
        f"{hw.device_memory_bytes / GiB:.1f} GiB"
    )
    if need <= have and not hw.is_cpu:
        parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in sorted(est.host.items(), key=lambda kv: -kv[1])[:3])
        msg = (
            f"{m.name} does not fit: host RAM needs {est.host_bytes / GiB:.1f} GiB per node ({parts}), "
            f"{search.host_capacity(hw) / GiB:.1f} GiB usable"
        )
    opts = options(config, hw, m, like=topo)
    if opts:
        return PlanError(msg + " — changes that fit this hardware: " + "; or ".join(opts))
    bigger = more_hardware(config, hw, m)
    return PlanError(
        msg
        + " — no single change to this config fits this hardware; "
        + (
            bigger
            if bigger
            else "try a smaller model, a shorter data.seq_len, or larger hardware (ft plan --hardware ...)"
        )
    )
