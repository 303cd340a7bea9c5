"""The job file: schema (frozen pydantic sections), loader (YAML, overrides, env) and cross-key checks."""

from finetune.config.load import load, loads
from finetune.config.schema import Config

__all__ = ["Config", "load", "loads"]
