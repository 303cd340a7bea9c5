"""What every section of the job file shares: the frozen base model and the bounded value types."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict

from finetune.config.types import Bounded, checked_path, checked_text

AUTO = "auto"
Auto = Literal["auto"]
BILLION = 10**9
Steps = Bounded(int, ge=1, le=BILLION)  # a count of steps, samples or tokens
NonNegSteps = Bounded(int, ge=0, le=BILLION)
Seed = Bounded(int, ge=0, le=2**32 - 1)
Tokens = Bounded(int, ge=1, le=2**20)  # tokens generated at once
FilePath = Annotated[str, checked_path]  # a file, folder, hub id or module: no control characters, sane lengths
Text = Annotated[str, checked_text]  # a name or revision: no control characters, at most 255 characters


class Section(BaseModel):
    """Base of every section: immutable, unknown keys rejected, field docstrings become descriptions."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    def explicit(self, field: str) -> bool:
        """True when the user wrote this key (as opposed to it taking its default)."""
        return field in self.model_fields_set
