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
from finetune.plan import search
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
    if t.gradient_checkpointing is False:
        out.append(("`train.gradient_checkpointing: true`", lambda c: _set(c, "train", gradient_checkpointing=True)))
    if t.optimizer not in ("adamw_8bit", "paged_adamw_8bit"):
        out.append(("`train.optimizer: adamw_8bit`", lambda c: _set(c, "train", optimizer="adamw_8bit")))
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
            out.append((f"{n} × {hw.accelerator.name} per node", search.with_hardware(hw, devices_per_node=n)))
    for n in (2, 4, 8):
        if hw.nodes < n and hw.devices_per_node * n >= 2:
            out.append((f"{n} nodes", search.with_hardware(hw, nodes=n)))
    return out


def _try(config: Config, hw: Hardware, m: ModelFacts) -> Estimate | None:
    try:
        topo = search.choose_topology(config, hw, [])
        precision = search.choose_precision(config, hw, [])
        batch = search.choose_global_batch(config, topo, [])
    except PlanError:
        return None
    fit = search.search(config, hw, m, topo, precision, batch)
    return fit.estimate if fit else None


def options(config: Config, hw: Hardware, m: ModelFacts, limit: int = 4) -> list[str]:
    """Changes that would fit, each with its per-device estimate."""
    found: list[str] = []
    for label, edit in relaxations(config):
        est = _try(edit(config), hw, m)
        if est is not None:
            found.append(f"{label} (est. {est.device_bytes / GiB:.1f} GiB)")
    for label, bigger in _scaled(hw):
        if len(found) >= limit:
            break
        backend = "fsdp" if config.distributed.backend in ("auto", "single", "ddp") else config.distributed.backend
        est = _try(
            _set(
                config,
                "distributed",
                backend=backend,
                sharding="auto",
                nodes="auto",
                processes_per_node="auto",
            ),
            bigger,
            m,
        )
        if est is not None:
            found.append(f"{label} with `distributed.backend: {backend}` (est. {est.device_bytes / GiB:.1f} GiB)")
            break
    return found[:limit]


def smallest_estimate(config: Config, hw: Hardware, m: ModelFacts, topo, precision: str, batch: int) -> Estimate:
    """The smallest per-device estimate among the setups the config allows (micro-batch 1, checkpointing if allowed)."""
    best: Estimate | None = None
    t = config.train
    mb = 1 if t.micro_batch_size == "auto" else t.micro_batch_size
    ckpt = True if t.gradient_checkpointing == "auto" else t.gradient_checkpointing
    for cand in search.candidates(config, hw, topo):
        est = estimate(m, search.setup(config, hw, topo, precision, batch, cand, mb, ckpt), topo.processes_per_node)
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
        msg = (
            f"{m.name} does not fit: host RAM needs {est.host_bytes / GiB:.1f} GiB per node for offloading, "
            f"{search.host_capacity(hw) / GiB:.1f} GiB usable"
        )
    opts = options(config, hw, m)
    msg += (
        (" — options that fit: " + "; or ".join(opts))
        if opts
        else " — no single change to this config fits this hardware; try a smaller model or larger hardware (ft plan "
        "--hardware ...)"
    )
    return PlanError(msg)
