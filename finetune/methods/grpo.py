"""Group relative policy optimisation: a rollout step that generates and scores, then a clipped policy-gradient loss.

Per optimizer step each rank takes global_batch_size / num_generations / world prompts (whole groups stay
on one rank), samples `num_generations` completions of each, scores them with the configured rewards
(weighted sum), and turns rewards into advantages relative to the group: (r − mean) / (std + 1e-4),
or r − mean for `dr_grpo` (Dr. GRPO drops the std scaling). The loss of a completion token is
    −min(ρ·A, clip(ρ, 1−ε, 1+ε)·A) + β·ρ·KL,   KL = exp(ref − logp) − (ref − logp) − 1,
with ρ the ratio to the policy that generated it (one update per rollout: ρ = 1 in value, but not in
gradient; multiplying the KL estimate by ρ makes its gradient the unbiased reverse-KL gradient, as
DeepSeek-V3.2 and trl do). Normalisation: `sequence` averages each completion's tokens, then the step's completions
(GRPO paper); `token` averages over every completion token of the step (DAPO); `dr_grpo` sums tokens and
divides by completions × max_new_tokens (Dr. GRPO).
"""

from __future__ import annotations

import json
import time

import torch

from finetune.data.collate import collate
from finetune.data.tokenize import pad_id
from finetune.errors import FtError
from finetune.methods import Context, register
from finetune.methods.dpo import reference_model, token_logps
from finetune.methods.head import LossHead, loss_head
from finetune.methods.loss import IGNORE
from finetune.methods.rewards import load_rewards


@register("grpo")
class GRPO:
    """Rollout batches and loss for GRPO."""

    def __init__(
        self, section, tokenizer, micro_batch_size: int, generate, reference, rewards, head: LossHead | None = None
    ):
        self.s, self.tokenizer, self.micro = section, tokenizer, micro_batch_size
        self.generate, self.reference, self.rewards = generate, reference, rewards
        self.head = head or LossHead()  # how the logits are computed (plan.loss_implementation)
        self.pad_id = pad_id(tokenizer)
        self.validates = section.validates

    @classmethod
    def create(cls, section, context: Context) -> GRPO:
        """Sampling from the wrapped policy, the reference the plan chose (with kl_coef > 0), the configured rewards."""
        if section.engine == "vllm":
            raise FtError(
                "method.engine: vllm generation for GRPO is not available in this version of ft; set engine: "
                "transformers (or auto)"
            )
        c, rewards = context, load_rewards(section.rewards)  # a bad reward stops the job before a reference loads
        head = loss_head(c.plan, True)
        generate = Generator(c.engine, c.tokenizer, section, c.device, c.autocast)
        return cls(section, c.tokenizer, c.plan.micro_batch_size, generate, reference_model(c), rewards, head)

    def micro_batches(self, dataset, indices: list[int]) -> list[dict]:
        """The rollout: generate, score, compute advantages; then the completions in micro-batches."""
        g = self.s.num_generations
        rows = dataset.select(indices)[:]
        prompt_ids = [list(p) for p in rows["prompt_ids"] for _ in range(g)]
        started = time.perf_counter()
        completions = self.generate(prompt_ids)
        rollout_s = time.perf_counter() - started
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        rewards, metrics = self.score(texts, rows, indices)
        advantages = group_advantages(rewards, g, scale=self.s.loss_normalization != "dr_grpo")
        metrics["completion_length"] = sum(map(len, completions)) / max(len(completions), 1)
        metrics.update(rollout_s=rollout_s, generated_tokens=sum(map(len, completions)))  # per rank
        seqs = [{"input_ids": p + c, "labels": [IGNORE] * len(p) + c} for p, c in zip(prompt_ids, completions)]
        out = []
        for i in range(0, len(seqs), self.micro):
            chunk = seqs[i : i + self.micro]
            batch = collate(chunk, self.pad_id, "sdpa")
            batch.update(advantages=advantages[i : i + self.micro], num_tokens=sum(len(s["input_ids"]) for s in chunk))
            out.append(batch)
        out[0]["metrics"] = metrics
        return out

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
        metrics["reward"], metrics["reward_std"] = (
            total.mean().item(),
            total.view(-1, g).std(-1).mean().item() if g > 1 else 0.0,
        )
        return total, metrics

    def tokens(self, batch: dict) -> int:
        if self.s.loss_normalization == "token":
            return int((batch["labels"][:, 1:] != IGNORE).sum())
        return len(batch["advantages"])

    def policy_score(self, model, batch: dict) -> torch.Tensor:
        """What the reference model is asked for: per-token log-probs."""
        return token_logps(model, batch, self.head)[0]

    def loss(self, model, batch: dict, normaliser: float):
        logps, mask = token_logps(model, batch, self.head)
        adv = batch["advantages"].to(logps.device)[:, None]
        ratio = torch.exp(logps - logps.detach())
        per_token = -torch.min(ratio * adv, ratio.clamp(1 - self.s.clip_eps, 1 + self.s.clip_eps) * adv)
        metrics = {}
        if self.s.kl_coef > 0:
            with torch.no_grad():
                ref = self.reference(model, batch, self).to(logps.device)
            delta = ref - logps
            kl = torch.exp(delta) - delta - 1
            per_token = per_token + self.s.kl_coef * kl * ratio  # ρ (= 1) makes the KL gradient unbiased
            metrics["kl"] = ((kl * mask).sum() / mask.sum().clamp(min=1)).item()
        per_token = per_token * mask
        if self.s.loss_normalization == "sequence":
            total = (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).sum()
        elif self.s.loss_normalization == "token":
            total = per_token.sum()
        else:
            total = per_token.sum() / self.s.max_new_tokens
        return total / normaliser, metrics


def group_advantages(rewards: torch.Tensor, group: int, scale: bool) -> torch.Tensor:
    """Each reward relative to its group's mean (and, with `scale`, divided by the group's std + 1e-4)."""
    r = rewards.view(-1, group)
    adv = r - r.mean(-1, keepdim=True)
    if scale:
        adv = adv / (r.std(-1, keepdim=True) + 1e-4)
    return adv.reshape(-1)


class Generator:
    """Sampled completions from the current policy (transformers' generate), trimmed after the first stop token."""

    def __init__(self, engine, tokenizer, section, device, autocast):
        from finetune.infer.engines import stop_ids

        self.engine, self.tokenizer, self.s, self.device, self.autocast = engine, tokenizer, section, device, autocast
        self.stop = stop_ids(tokenizer)
        self.pad = pad_id(tokenizer)

    @torch.no_grad()
    def __call__(self, prompts: list[list[int]]) -> list[list[int]]:
        model = self.engine.inner
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        was_training = model.training
        model.eval()
        try:
            with self.engine.generation(), self.autocast():
                # sharded: ranks sample different lengths
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=True,
                    temperature=self.s.temperature,
                    top_p=self.s.top_p,
                    top_k=0,
                    max_new_tokens=self.s.max_new_tokens,
                    eos_token_id=self.stop,
                    pad_token_id=self.pad,
                    use_cache=True,
                    synced_gpus=self.engine.synced_generation,
                )
        finally:
            model.train(was_training)
        return [self._trim(row.tolist()) for row in out[:, width:]]

    def _trim(self, tokens: list[int]) -> list[int]:
        for i, t in enumerate(tokens):
            if t in self.stop:
                return tokens[: i + 1]
        return tokens
