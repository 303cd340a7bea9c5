"""Third-party messages that are not the user's business, kept off the console. Each filter is precise (one
message of one library, read in the version named), so the user's own warnings and real problems stay visible; no
library function is replaced. Cheap to import (warnings, logging and re only).

- transformers 5.x: `is_gradient_checkpointing` is a deprecated alias that peft 0.21 still reads when it wraps a
  model (a FutureWarning about peft's code, at every adapter run).
- DeepSpeed 0.19: importing it logs "Setting accelerator to CPU" on a machine without a GPU; accelerate imports it
  whenever transformers saves a model (unwrapping a possible DeepSpeedEngine), DeepSpeed backend or not. ft's plan
  already says which devices it found.
- transformers 5.x: the LOAD REPORT of a reward model whose score head is not in the base checkpoint: ft starts that
  head from seeded values on purpose (models.head_value). A report that names anything else is kept.
- tqdm bars (transformers' "Loading weights" / "Writing model shards", datasets', the hub's), where the output is a
  log: their carriage returns would fill it (`no_bars_in_logs`).
- torch 2.13, under tensor parallelism only (`quiet_tensor_parallel`): FSDP2's warning that a decoder layer returned
  a view (the tensor-parallel plan's last layer hands back its gathered output as one; the supported families never
  change a layer's output in place, and the tests compare every gradient with one process's), and DTensor's notes
  that a redistribution over the 2-D mesh takes two collectives (clipping's norm, the final gather).
- torch 2.13: DCP's note, at each checkpoint of a one-process job, that without a process group it assumes one
  process (engine.py writes one format for every torch backend; one process is what a single-process job is).
(bitsandbytes' "kernels-community" notice: finetune.compat.quiet_unused_bitsandbytes_kernel.)
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable

GRADIENT_CHECKPOINTING_ALIAS = "`is_gradient_checkpointing` is deprecated"
DEEPSPEED_LOGGER, DEEPSPEED_CPU = "DeepSpeed", "Setting accelerator to CPU"
DCP_ONE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to"
LOAD_REPORT_LOGGER, LOAD_REPORT = "transformers.modeling_utils", "LOAD REPORT"
_STYLE = re.compile(r"\x1b\[[0-9;]*m")


class DropMessages(logging.Filter):
    """A logging filter that drops the records whose message `drops` is true of (the others pass)."""

    def __init__(self, name: str, drops: Callable[[str], bool]):
        super().__init__()
        self.what, self.drops = name, drops

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.drops(record.getMessage())


def _add_filter(logger_name: str, what: str, drops: Callable[[str], bool]) -> None:
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, DropMessages) and f.what == what for f in logger.filters):
        logger.addFilter(DropMessages(what, drops))


def quiet_libraries() -> None:
    """The filters every ft process wants (the CLI's and each rank's entry); installing twice changes nothing."""
    warnings.filterwarnings("ignore", message=re.escape(GRADIENT_CHECKPOINTING_ALIAS), category=FutureWarning)
    warnings.filterwarnings("ignore", message=re.escape(DCP_ONE_PROCESS), category=UserWarning)
    _add_filter(DEEPSPEED_LOGGER, "accelerator-cpu", lambda message: message.startswith(DEEPSPEED_CPU))


FSDP_VIEW_OUTPUT = r"FSDP2-wrapped module \(FSDP\w*DecoderLayer\) returned a view tensor"
REDISTRIBUTE_LOGGER, REDISTRIBUTE_NOTE = "torch.distributed.tensor._redistribute", "While redistributing from"


def quiet_tensor_parallel() -> None:
    """For a process that applies tensor parallelism (distributed/tp.py): the two torch notices above."""
    warnings.filterwarnings("ignore", message=FSDP_VIEW_OUTPUT, category=UserWarning)
    _add_filter(REDISTRIBUTE_LOGGER, "sequential-collectives", lambda message: message.startswith(REDISTRIBUTE_NOTE))


def quiet_new_score_head() -> None:
    """For a job that trains a score head (method: reward): transformers' report that the head was missing from the
    base checkpoint, when that is all the report says."""
    _add_filter(LOAD_REPORT_LOGGER, "new-score-head", only_new_score_head)


def only_new_score_head(message: str) -> bool:
    """Whether a LOAD REPORT lists nothing but MISSING `score.*` parameters."""
    if LOAD_REPORT not in message:
        return False
    rows = [[cell.strip() for cell in line.split("|")] for line in _STYLE.sub("", message).splitlines() if "|" in line]
    rows = [r for r in rows if len(r) >= 2 and r[0] and r[0] != "Key"]
    return bool(rows) and all(r[1] == "MISSING" and r[0].split(".")[0] == "score" for r in rows)


BAR_SWITCHES = ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS")


def no_bars_in_logs(stream=None) -> None:
    """Where `stream` (stderr, where tqdm draws) is not a terminal, every tqdm bar off for this process and the
    processes it starts (ranks, vLLM, data workers), through the libraries' own switches: tqdm's `TQDM_DISABLE`
    (its default for `disable`), huggingface_hub's (which transformers' bars follow) and datasets'. Read when those
    libraries are imported, so this runs first. A value the user set is kept."""
    import os
    import sys

    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if callable(isatty) and isatty():
        return
    for name in BAR_SWITCHES:
        os.environ.setdefault(name, "1")


def quiet_loading_bars() -> None:
    """transformers' own progress bars (loading and writing weights) off: for output that is not a terminal."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
