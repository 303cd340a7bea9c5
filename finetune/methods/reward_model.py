"""A trained reward model as a GRPO reward (`rewards: [{model: runs/rm/final}]`).

The model is a sequence classifier with one output, as ft's `reward` method writes it. Its config.json is checked
before any weight loads (at plan time: `classifier_facts`, which also gives the planner its size), then each process
loads it once on its own training device, frozen and in eval mode, in the plan's precision, from safetensors only.

A completion is scored as the reward model was trained on a preference pair's prompt + chosen answer: the prompt
conversation plus the completion as the assistant's reply, tokenized by `tokenize_continuation` with the reward
model's own tokenizer and chat template. Sequences longer than data.seq_len (or the model's position limit) keep their
last tokens: the reward model reads its score at the last token, so the start of the prompt is what is cut. Batches of
`batch_size` are right-padded with the model's pad id under inference mode; the reward is the single logit, which
transformers reads at each row's rightmost token that is not the pad id, so it does not depend on the batch size.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from finetune.errors import FtError
from finetune.plan.reward_models import classifier_config

SKIPPED_PARTS = re.compile(r"^(final|checkpoints|step-\d+)$")  # parts of a run folder that do not name the model


def model_name(model: str) -> str:
    """The metric name of a reward model: its folder's name, skipping ft's run-folder parts (runs/rm/final -> rm)."""
    parts = [p for p in Path(model.rstrip("/\\")).parts if p not in ("/", ".", "..", "~")]
    named = [p for p in parts if not SKIPPED_PARTS.match(p)]
    return (named or parts or ["reward_model"])[-1]


class ModelReward:
    """A reward model configured as a reward: `name` (its metric is rewards/<name>), `weight`, and a call like a
    reward function's, returning the model's score of each completion."""

    def __init__(self, spec, index: int, name: str, device="cpu", precision: str = "fp32", max_tokens: int = 2048):
        self.key, self.function = f"method.rewards[{index}].model", spec.model
        self.name, self.weight, self.batch_size = name, spec.weight, spec.batch_size
        classifier_config(spec, index)  # the checks that need no weights, before any load
        self.device = device
        self.model = _load_classifier(spec, self.key, device, precision)
        self.tokenizer, self.jinja = _load_tokenizer(spec, self.key)
        self.pad = self.model.config.get_text_config().pad_token_id
        limit = getattr(self.model.config.get_text_config(), "max_position_embeddings", None) or max_tokens
        self.max_tokens = min(max_tokens, limit)

    def __call__(
        self, completions: list[str], prompts: list, columns: dict[str, list], origins: list[str]
    ) -> list[float]:
        seqs = [self.encode(prompt, text, origin) for prompt, text, origin in zip(prompts, completions, origins)]
        scores = []
        for start in range(0, len(seqs), self.batch_size):
            scores += self._forward(seqs[start : start + self.batch_size])
        for i, value in enumerate(scores):
            if not math.isfinite(value):
                raise FtError(
                    f"{self.key}: the reward model {self.function!r} gave {value} for completion {i} (prompt "
                    f"{origins[i]}); check its weights, or whether it overflows in this precision (try "
                    "train.precision: fp32)"
                )
        return scores

    def encode(self, prompt, text: str, origin: str) -> list[int]:
        """The ids the model scores for one completion: prompt and completion in its chat template, cut from the
        left to max_tokens."""
        from finetune.data.masking import tokenize_continuation

        try:
            ids, _ = tokenize_continuation(prompt, [{"role": "assistant", "content": text}], self.tokenizer, self.jinja)
        except FtError as e:
            raise FtError(
                f"{self.key}: cannot tokenize the completion of prompt {origin} for the reward model: {e}"
            ) from None
        return ids[-self.max_tokens :]  # the end, where the score is read

    def _forward(self, seqs: list[list[int]]) -> list[float]:
        import torch

        longest = max(map(len, seqs))
        ids = torch.full((len(seqs), longest), self.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), longest), dtype=torch.long)
        for row, seq in enumerate(seqs):  # right padding: positions 0.. of every row as in a batch of one
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        with torch.inference_mode():
            # GPU: the inputs go to the device the model was moved to (this rank's), the logits come back to the CPU
            out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
        return out.logits[:, 0].float().cpu().tolist()


def _load_classifier(spec, key: str, device, precision: str):
    """The reward model, whole on this process's device, frozen, in eval mode, from safetensors only."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from finetune.distributed.deepspeed_load import zero3_withdrawn
    from finetune.models import torch_dtype

    # GPU: straight onto this rank's device (context.device: cuda:LOCAL_RANK), as models.load_model places the policy:
    # never a whole copy per rank in host memory first (transformers 5.24 from_pretrained: device_map {"": device})
    placed = {"device_map": {"": device}} if torch.device(device).type == "cuda" else {}
    try:
        with zero3_withdrawn():  # under ZeRO-3 too the reward model is whole on every rank, not partitioned
            model = AutoModelForSequenceClassification.from_pretrained(
                spec.model,
                revision=spec.revision,
                dtype=torch_dtype(precision),
                use_safetensors=True,
                trust_remote_code=spec.trust_remote_code,
                **placed,
            )
    except (OSError, ValueError) as e:
        raise FtError(
            f"{key}: cannot load {spec.model!r} as a sequence classifier from safetensors: "
            f"{str(e).splitlines()[0][:300]}; give a folder with config.json and model.safetensors (as ft's reward "
            "method saves it)"
        ) from None
    if model.config.num_labels != 1:
        raise FtError(f"{key}: {spec.model} has {model.config.num_labels} outputs; a reward model has one")
    model.to(device)  # CPU: where it was built; GPU: already there (a no-op), where _forward sends the inputs
    model.eval()
    model.requires_grad_(False)
    return model


def _load_tokenizer(spec, key: str):
    """The reward model's own tokenizer and the Jinja of its chat template (`template`)."""
    from transformers import AutoTokenizer

    from finetune.templates import KEY, TemplateError, resolve

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            spec.model, revision=spec.revision, trust_remote_code=spec.trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise FtError(
            f"{key}: cannot load the tokenizer saved with {spec.model!r}: {str(e).splitlines()[0][:300]}; save the "
            "reward model's tokenizer in its folder (ft's reward method does)"
        ) from None
    try:
        return tokenizer, resolve(tokenizer, spec.template)
    except TemplateError as e:
        template_key = key.removesuffix(".model") + ".template"
        raise FtError(str(e).replace(KEY, template_key)) from None
