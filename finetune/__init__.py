"""ft: declarative fine-tuning for large language models.

Heavy libraries (torch, transformers, peft, datasets) are imported lazily inside the functions that
need them, so that `ft --help`, `ft validate` and `ft plan --hardware ...` start fast.
"""

from finetune.compat import quiet_unused_bitsandbytes_kernel

__version__ = "0.1.0"

quiet_unused_bitsandbytes_kernel()  # before anything imports bitsandbytes (logging only: no library is imported here)
