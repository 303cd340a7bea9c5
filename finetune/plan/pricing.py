"""A fit (a candidate setup, its micro-batch and memory savers, its estimate) and its estimated step time: its network
traffic by collective (plan/comm.py), its work by cause (plan/cost.py) and the communication that does not hide
behind that work (plan/scaling.py). `priced` fits are what plan/search.py ranks."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from finetune.catalog import ModelFacts
from finetune.hardware import Hardware
from finetune.plan.candidates import Candidate
from finetune.plan.comm import (
    Links,
    expert_parallel_traffic,
    parallel_traffic,
    reduces_every_micro_batch,
    step_traffic,
)
from finetune.plan.cost import forward_flops_per_token, step_seconds
from finetune.plan.memory import DTYPE_BYTES, Estimate, Setup, checkpointed_layers, tokens_per_micro_batch, tp_shares
from finetune.plan.savers import Savers
from finetune.plan.scaling import predict
from finetune.plan.topology import Topology


@dataclass(frozen=True)
class Fit:
    candidate: Candidate
    micro_batch_size: int
    savers: Savers
    estimate: Estimate
    seconds: dict[str, float] = field(default_factory=dict)  # estimated step time by cause (plan/cost.py)
    scaling: dict = field(default_factory=dict)  # its predicted scaling (plan/scaling.py); {} for one process
    fuller: Fit | None = None  # the faster fit this one was preferred to for its headroom (search.prefer_room)

    @property
    def checkpointing(self) -> bool:
        return self.savers.checkpoint_layers > 0

    @property
    def step_seconds(self) -> float:
        return sum(self.seconds.values())


def traffic(fit: Fit, topo: Topology, m: ModelFacts, s: Setup) -> dict[str, float]:
    """Bytes each rank sends per step, by collective (plan/comm.py), for `fit` whose memory view is `s`."""
    c = fit.candidate
    stored = 0.55 if c.quantization == "nf4" else 1.0 if c.quantization == "int8" else 4 if s.precision == "fp32" else 2
    params, trained = tp_shares(m, s, fit.estimate.trainable_params)
    out = step_traffic(
        c.backend,
        c.sharding,
        topo.nodes,
        topo.processes_per_node,
        round(fit.estimate.trainable_params * trained),
        round(m.num_params * params),
        stored,
        s.accumulation,
        adapter=c.adapter,
        grad_bytes=2 if fit.savers.pure_bf16 or (c.backend == "deepspeed" and s.precision != "fp32") else 4,
        tensor_parallel=c.tp,
    )
    out.update(
        parallel_traffic(
            tokens_per_micro_batch(s),
            m.hidden_size,
            m.kv_dim,
            m.num_layers,
            checkpointed_layers(m, s),
            DTYPE_BYTES[s.precision],
            s.accumulation,
            c.tp,
            c.cp,
        )
    )
    if s.expert_parallel > 1:  # the routed experts split over ranks (plan/expert_parallel.py)
        share = m.expert_params / m.num_params
        out = expert_parallel_traffic(
            out,
            topo.world,
            topo.processes_per_node,
            s.expert_parallel,
            (share, share if c.adapter == "full" else 0.0),
            tokens_per_micro_batch(s),
            m.hidden_size,
            m.experts_per_token,
            m.num_layers,
            checkpointed_layers(m, s),
            DTYPE_BYTES[s.precision],
            s.accumulation,
        )
    return out


def priced(fit: Fit, topo: Topology, m: ModelFacts, s: Setup, hw: Hardware, speeds: Links = Links()) -> Fit:
    """`fit` with its step time by cause: the work (plan/cost.py) and, as "communication", the part of its collectives
    that does not hide behind that work (plan/scaling.py), whose figures it keeps."""
    work = step_seconds(m, s, hw, s.accumulation, 0.0)
    scaled = prediction(fit, topo, m, s, work, traffic(fit, topo, m, s), speeds)
    exposed = scaled.get("exposed_seconds", 0.0)
    return replace(fit, seconds={**work, "communication": exposed} if exposed else work, scaling=scaled)


def prediction(
    fit: Fit, topo: Topology, m: ModelFacts, s: Setup, work: dict[str, float], sent: dict[str, float], speeds: Links
) -> dict:
    """The predicted scaling of `fit` (plan/scaling.py) from its work by cause and its traffic by collective."""
    if topo.world == 1:
        return {}
    c = fit.candidate
    attention = 2 * s.seq_len * m.q_dim * m.num_layers / forward_flops_per_token(m, s.seq_len)
    return predict(
        work,
        sent,
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
        reduce_every_micro_batch=reduces_every_micro_batch(c.backend, c.sharding, c.adapter),
    )
