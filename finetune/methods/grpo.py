"""Group relative policy optimisation: a rollout that generates and scores, then a clipped policy-gradient loss.

Per batch each rank takes global_batch_size / num_generations / world prompts (whole groups stay on one rank), samples
`num_generations` completions of each with the rollout engine (finetune/rollout/: the training model itself, or vLLM
colocated or on a server), scores them with the configured rewards (weighted sum), and turns rewards into advantages
relative to the group: (r − mean) / (std + 1e-4), or r − mean for `dr_grpo` (Dr. GRPO drops the std scaling). The
batch is trained for `num_iterations` optimizer steps (μ). The loss of a completion token is
    −min(ρ·A, clip(ρ, 1−ε, 1+ε)·A) · w + β·ρ·KL,   KL = exp(ref − logp) − (ref − logp) − 1,
with ρ = π/π_old the ratio to the policy the trainer had when the rollout was made (its log-probs computed once,
before the first update, where μ > 1 or w needs them; else ρ = 1 in value, not in gradient). w = min(π_old/π_engine,
cap) is the truncated importance weight for the mismatch between the trainer and a separate rollout engine (its
numerics, or its older weights with asynchronous rollouts); 1 where the training model sampled. Multiplying the KL
estimate by ρ makes its gradient the unbiased reverse-KL gradient for samples of π_old (DeepSeek-V3.2, trl's default).
Normalisation: `sequence` averages each completion's tokens, then the step's completions (GRPO paper); `token`
averages over every completion token of the step (DAPO); `dr_grpo` sums tokens and divides by completions ×
max_new_tokens (Dr. GRPO).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from finetune.data.collate import collate
from finetune.data.masking import IGNORE
from finetune.data.tokenize import pad_id
from finetune.methods import Context, register
from finetune.methods.dpo import reference_model
from finetune.methods.head import LossHead, loss_head
from finetune.methods.loss import metric
from finetune.methods.rewards import load_rewards


@register("grpo")
class GRPO:
    """Rollout batches and loss for GRPO."""

    def __init__(
        self,
        section,
        tokenizer,
        micro_batch_size: int,
        driver,
        reference,
        rewards,
        head: LossHead | None = None,
        policy=None,
        stream=None,
    ):
        """driver: a rollout.driver.RolloutDriver (None: the tests that call `loss` and `score` only); policy: a
        callable (batch on the device) -> per-token log-probs under no_grad, for the old policy's log-probs."""
        self.s, self.tokenizer, self.micro = section, tokenizer, micro_batch_size
        self.driver, self.reference, self.rewards = driver, reference, rewards
        self.head = head or LossHead()  # how the logits are computed (plan.loss_implementation)
        self.pad_id = pad_id(tokenizer)
        self.validates = section.validates
        self.policy, self.stream = policy, stream
        self.steps = 0  # optimizer steps dealt so far (where no stream says it)
        self.pending: dict | None = None  # the current batch's micro-batches, for its remaining iterations

    @classmethod
    def create(cls, section, context: Context) -> GRPO:
        """The rollout engine the plan placed, the reference the plan chose (with kl_coef > 0), the rewards."""
        from finetune.rollout.driver import RolloutDriver
        from finetune.rollout.factory import create_engine, placement
        from finetune.rollout.weights import Weights

        c = context  # a bad reward stops the job before a reference loads; reward models on this rank's device
        rewards = load_rewards(section.rewards, c.device, c.plan.precision, c.plan.seq_len)
        head = loss_head(c.plan, True)
        engine = create_engine(section, c)
        separate = placement(c.plan, section)[1] != "inline"
        folder = Path(c.folder if c.folder is not None else ".") / "rollout"  # adapters sent to the engine

        def weights(version: int, in_flight=frozenset()):
            return Weights(c.engine, c.runtime, folder, version, c.plan.adapter != "full", in_flight)

        def prompts_for(rows: list[int]) -> list[list[int]]:
            return [list(p) for p in c.dataset.select(rows)["prompt_ids"] for _ in range(section.num_generations)]

        driver = RolloutDriver(
            engine,
            weights if separate else None,
            c.runtime,
            c.seed,
            section.rollout.sync_every,
            section.rollout.asynchronous and separate,
            prompts_for,
            c.stream.peek if c.stream is not None else None,
            section.num_iterations,
            section.rollout.max_staleness,
        )

        @torch.no_grad()
        def policy(batch: dict) -> torch.Tensor:
            on_device = {k: v.to(c.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            with c.autocast():
                return head.token_logps(c.engine.model, on_device)[0].float().cpu()

        return cls(
            section, c.tokenizer, c.plan.micro_batch_size, driver, reference_model(c), rewards, head, policy, c.stream
        )

    def _step(self) -> int:
        """Optimizer steps taken before the one being dealt now (the policy's version)."""
        st = self.stream
        if st is None:
            self.steps += 1
            return self.steps - 1
        return (st.position // st.global_batch - 1) * st.repeat + st.served - 1

    def micro_batches(self, dataset, indices: list[int]) -> list[dict]:
        """The first step of a batch: the rollout, scored, with advantages (and old log-probs where they are needed),
        in micro-batches; the batch's later steps (num_iterations) reuse them."""
        step = self._step()
        p = self.pending
        if p is not None and p["left"] > 0 and p["indices"] == indices:
            p["left"] -= 1
            return [dict(b) for b in p["batches"]]
        g = self.s.num_generations
        rows = dataset.select(indices)[:]
        prompt_ids = [list(x) for x in rows["prompt_ids"] for _ in range(g)]
        rollout = self.driver.rollout(step, indices, prompt_ids)
        completions = rollout.completions
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        rewards, metrics = self.score(texts, rows, indices)
        advantages = group_advantages(rewards, g, scale=self.s.loss_normalization != "dr_grpo")
        generated = sum(map(len, completions))
        metrics.update(
            completion_length=generated / max(len(completions), 1),
            rollout_s=rollout.seconds,
            generated_tokens=generated,  # per rank
            rollout_lag=step - rollout.version,
            sync_s=self.driver.sync_seconds,
        )
        out = []
        for i in range(0, len(completions), self.micro):
            seqs = [
                {"input_ids": q + c, "labels": [IGNORE] * len(q) + c}
                for q, c in zip(rollout.prompts[i : i + self.micro], completions[i : i + self.micro])
            ]
            batch = collate(seqs, self.pad_id, "sdpa")
            batch.update(advantages=advantages[i : i + self.micro], num_tokens=sum(len(s["input_ids"]) for s in seqs))
            engine_logps = rollout.logps[i : i + self.micro] if rollout.logps is not None else None
            self._old_policy(batch, rollout.prompts[i : i + self.micro], engine_logps, metrics)
            out.append(batch)
        _mean_into(metrics, len(out))
        out[0]["metrics"] = metrics
        self.pending = {"indices": indices, "left": self.s.num_iterations - 1, "batches": out}
        return [dict(b) for b in out]

    def _old_policy(self, batch: dict, prompts, engine_logps, metrics: dict) -> None:
        """The trainer's log-probs of the rollout before any update (π_old), where the ratio or the importance weight
        needs them, and the truncated importance weight against the engine's log-probs."""
        cap = self.s.importance_sampling_cap
        weighted = engine_logps is not None and cap is not None
        if self.s.num_iterations == 1 and not weighted:
            return
        old = self.policy(batch)
        batch["old_logps"] = old
        if engine_logps is None:
            return
        sampled = torch.zeros_like(old)
        for row, (q, lp) in enumerate(zip(prompts, engine_logps)):
            sampled[row, len(q) - 1 : len(q) - 1 + len(lp)] = torch.tensor(lp, dtype=old.dtype)
        mask = batch["labels"][:, 1:] != IGNORE
        delta = (old - sampled)[mask]
        if len(delta):
            metrics["_is_mean"] = metrics.get("_is_mean", 0.0) + float(torch.exp(delta).mean())
            metrics["_is_max"] = max(metrics.get("_is_max", 0.0), float(torch.exp(delta).max()))
            metrics["_mismatch"] = metrics.get("_mismatch", 0.0) + float(delta.abs().mean())
        if weighted:
            batch["is_weight"] = torch.exp(old - sampled).clamp(max=cap) * mask

    def score(self, texts: list[str], rows: dict, indices: list[int]) -> tuple[torch.Tensor, dict]:
        """Weighted sum of the rewards of each completion, and their means for logging."""
        g = self.s.num_generations
        extras = [json.loads(e) for e in rows["extra"]]
        columns = {
            k: [extras[i // g].get(k) for i in range(len(texts))] for k in dict.fromkeys(k for e in extras for k in e)
        }
        prompts = [json.loads(rows["prompt"][i // g]) for i in range(len(texts))]
        origins = [
            (rows["_origin"][i // g] if "_origin" in rows else f"row {indices[i // g]}") for i in range(len(texts))
        ]
        total = torch.zeros(len(texts))
        metrics = {}
        for reward in self.rewards:
            values = torch.tensor(reward(texts, prompts, columns, origins))
            total += reward.weight * values
            metrics[f"rewards/{reward.name}"] = values.mean().item()
        metrics["reward"] = total.mean().item()
        metrics["reward_std"] = total.view(-1, g).std(-1).mean().item() if g > 1 else 0.0
        return total, metrics

    def tokens(self, batch: dict) -> int:
        if self.s.loss_normalization == "token":
            return int((batch["labels"][:, 1:] != IGNORE).sum())
        return len(batch["advantages"])

    def policy_score(self, model, batch: dict) -> torch.Tensor:
        """What the reference model is asked for: per-token log-probs."""
        return self.head.token_logps(model, batch)[0]

    def loss(self, model, batch: dict, normaliser: float):
        logps, mask = self.head.token_logps(model, batch)
        adv = batch["advantages"].to(logps.device)[:, None]
        old = batch.get("old_logps")
        old = logps.detach() if old is None else old.to(logps.device)
        ratio = torch.exp(logps - old)
        clipped = ratio.clamp(1 - self.s.clip_eps, 1 + self.s.clip_eps)
        per_token = -torch.min(ratio * adv, clipped * adv)
        if "is_weight" in batch:
            per_token = per_token * batch["is_weight"].to(logps.device)
        tokens = mask.sum().clamp(min=1)
        with torch.no_grad():
            active = ((ratio < 1 - self.s.clip_eps) & (adv < 0)) | ((ratio > 1 + self.s.clip_eps) & (adv > 0))
            metrics = {"clip_fraction": metric((active & mask).sum() / tokens)}
        if self.s.kl_coef > 0:
            with torch.no_grad():
                ref = self.reference(model, batch, self).to(logps.device)
            delta = ref - logps
            kl = torch.exp(delta) - delta - 1
            per_token = per_token + self.s.kl_coef * kl * ratio  # samples of π_old: ρ makes the KL gradient unbiased
            metrics["kl"] = metric((kl * mask).sum() / tokens)
        per_token = per_token * mask
        if self.s.loss_normalization == "sequence":
            total = (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).sum()
        elif self.s.loss_normalization == "token":
            total = per_token.sum()
        else:
            total = per_token.sum() / self.s.max_new_tokens
        return total / normaliser, metrics

    def state_dict(self) -> dict:
        """What a checkpoint keeps so that a resumed run trains on the same rollouts: the batch being reused and a
        rollout generated ahead."""
        return {
            "steps": self.steps,
            "pending": self.pending,
            "driver": self.driver.state_dict() if self.driver is not None else {},
        }

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.pending = state.get("steps", self.steps), state.get("pending")
        if self.driver is not None:
            self.driver.load_state_dict(state.get("driver") or {})


def _mean_into(metrics: dict, micro_batches: int) -> None:
    """The importance-sampling figures summed over micro-batches, as means (the maximum stays the maximum)."""
    if "_is_mean" in metrics:
        metrics["is_ratio_mean"] = metrics.pop("_is_mean") / micro_batches
        metrics["is_ratio_max"] = metrics.pop("_is_max")
        metrics["logp_mismatch"] = metrics.pop("_mismatch") / micro_batches


def group_advantages(rewards: torch.Tensor, group: int, scale: bool) -> torch.Tensor:
    """Each reward relative to its group's mean (and, with `scale`, divided by the group's std + 1e-4)."""
    r = rewards.view(-1, group)
    adv = r - r.mean(-1, keepdim=True)
    if scale:
        adv = adv / (r.std(-1, keepdim=True) + 1e-4)
    return adv.reshape(-1)
