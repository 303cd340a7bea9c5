"""What one `ft generate` produces, as the launcher and each process read it: OUT.parts/job.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from finetune.artifacts import ModelSource
from finetune.infer.engines import Sampling
from finetune.infer.prompts import PromptSpec

DEFAULT_BATCH = {"transformers": 16, "vllm": 256}


@dataclass(frozen=True)
class GenerateJob:
    """Everything that decides the output; saved as OUT.parts/job.json for the processes and for restarts."""

    source: ModelSource
    prompts: PromptSpec
    out: str
    sampling: Sampling = Sampling()
    template: str | None = None  # None: the job file's data.template, else the run's, else the tokenizer's
    batch_size: int | None = None  # None: 16 for transformers, 256 for vLLM
    sort: bool = True
    engine: str = "auto"
    tensor_parallel: int = 1
    dtype: str = "auto"
    output_field: str = "completion"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> GenerateJob:
        sampling = {**data["sampling"], "stop": tuple(data["sampling"]["stop"])}
        source = {**data["source"], "tokenizer_dirs": tuple(data["source"]["tokenizer_dirs"])}
        return cls(
            **{
                **data,
                "source": ModelSource(**source),
                "prompts": PromptSpec(**data["prompts"]),
                "sampling": Sampling(**sampling),
            }
        )
