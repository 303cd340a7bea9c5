"""The training model samples its own rollouts with transformers' `generate` (`placement: inline`)."""

from __future__ import annotations

import torch

from finetune.data.tokenize import pad_id
from finetune.rollout import Completion


class TransformersRollout:
    """Sampled completions from the current policy, trimmed after the first stop token. Under sharding the engine
    decides how parameters are gathered for the call (plan.generation), and ranks stay in step where they must."""

    name = "transformers"

    def __init__(self, engine, tokenizer, section, device, autocast):
        from finetune.infer.engines import stop_ids

        self.engine, self.s, self.device, self.autocast = engine, section, device, autocast
        self.stop = stop_ids(tokenizer)
        self.pad = pad_id(tokenizer)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], seed: int) -> list[Completion]:
        """`seed` is not used: sampling draws from the training process's RNG, which checkpoints save and restore."""
        model = self.engine.inner
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        was_training = model.training
        model.eval()
        try:
            with self.engine.generation(), self.autocast():
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
                    synced_gpus=self.engine.synced_generation,  # sharded: ranks sample different lengths
                )
        finally:
            model.train(was_training)
        return [Completion(self._trim(row.tolist())) for row in out[:, width:]]

    def _trim(self, tokens: list[int]) -> list[int]:
        for i, t in enumerate(tokens):
            if t in self.stop:
                return tokens[: i + 1]
        return tokens

    def update(self, weights) -> None:
        pass  # it samples with the training model's own weights

    def sleep(self, reloading: bool = False) -> None:
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass
