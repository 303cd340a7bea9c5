"""What ft writes and reads back, and the models its verbs are pointed at.

run.py       RunFolder: the paths of a run folder, its config and plan read back
sources.py   what a SOURCE argument names: a run folder, a model folder, an adapter folder with its base,
             a hub id or ft-tiny (ModelSource, for ft generate and ft eval); an adapter alone (AdapterSource,
             for ft merge-lora)
bases.py     which base an adapter is loaded on, and whether two names of a base are the same model
weights.py   loading a base and its tokenizer; an adapter checked against its base, attached and merged

Every module that opens a run folder or loads what a SOURCE argument names goes through these.
"""

from finetune.artifacts.run import RunFolder
from finetune.artifacts.sources import AdapterSource, ModelSource, check_adapter_folder, find_adapter, resolve
from finetune.artifacts.weights import (
    DTYPES,
    attach,
    check_fits,
    dtypes,
    find_processor,
    find_tokenizer,
    first_line,
    load_base,
    load_model,
    load_tokenizer,
    merge_adapter,
)

__all__ = [
    "DTYPES",
    "AdapterSource",
    "ModelSource",
    "RunFolder",
    "attach",
    "check_adapter_folder",
    "check_fits",
    "dtypes",
    "find_adapter",
    "find_processor",
    "find_tokenizer",
    "first_line",
    "load_base",
    "load_model",
    "load_tokenizer",
    "merge_adapter",
    "resolve",
]
