"""ft: declarative fine-tuning for large language models.

Heavy libraries (torch, transformers, peft, datasets) are imported lazily inside the functions that
need them, so that `ft --help`, `ft validate` and `ft plan --hardware ...` start fast.
"""

__version__ = "0.1.0"
