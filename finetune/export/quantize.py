"""Quantized GGUF files, made by llama.cpp's own quantizer (through llama-cpp-python) from a float GGUF file.

llama.cpp picks each tensor's type for a file type (q4_k_m keeps some tensors at higher precision) and falls back,
tensor by tensor, to a type whose block fits where a row's length is not a multiple of the asked type's block (256
values for the k-quants, 32 for q4_0/q5_0/q8_0). `tensor_types` reads back what each tensor became.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from pathlib import Path

from finetune.errors import FtError

# --quant name -> llama.cpp's file type (the LLAMA_FTYPE_MOSTLY_* constant of llama_cpp)
QUANTS = {
    "q8_0": "Q8_0",
    "q6_k": "Q6_K",
    "q5_k_m": "Q5_K_M",
    "q5_k_s": "Q5_K_S",
    "q5_1": "Q5_1",
    "q5_0": "Q5_0",
    "q4_k_m": "Q4_K_M",
    "q4_k_s": "Q4_K_S",
    "q4_1": "Q4_1",
    "q4_0": "Q4_0",
    "q3_k_l": "Q3_K_L",
    "q3_k_m": "Q3_K_M",
    "q3_k_s": "Q3_K_S",
    "q2_k": "Q2_K",
}
INSTALL = "pip install 'finetune[export]' (llama-cpp-python builds llama.cpp from source: minutes)"


def llama_cpp():
    """The llama_cpp module; FtError with the install command where it is missing."""
    try:
        import llama_cpp as module
    except ImportError:
        raise FtError(
            f"quantizing to GGUF needs llama.cpp's Python binding (llama-cpp-python).\n    fix: {INSTALL}"
        ) from None
    return module


_DROP_LOG = None  # llama.cpp's log callback while ft quantizes (kept referenced: ctypes calls it from C)


def _quiet(module) -> None:
    """Send llama.cpp's log lines (one per tensor while quantizing) nowhere."""
    global _DROP_LOG
    if _DROP_LOG is None:
        _DROP_LOG = module.llama_log_callback(lambda level, text, data: None)
    module.llama_log_set(_DROP_LOG, ctypes.c_void_p(0))


def quantize(source: Path, target: Path, kind: str, threads: int = 0) -> None:
    """Quantize the float GGUF file `source` to `kind` (a QUANTS name) into `target`, with llama.cpp."""
    module = llama_cpp()
    params = module.llama_model_quantize_default_params()
    params.ftype = getattr(module, f"LLAMA_FTYPE_MOSTLY_{QUANTS[kind]}")
    params.nthread = threads
    _quiet(module)
    status = module.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if status != 0 or not target.is_file():
        raise FtError(
            f"llama.cpp could not quantize {source.name} to {kind} (status {status}).\n    fix: export --quant f16 "
            "and quantize it with llama.cpp's llama-quantize, whose log says which tensor it refused"
        )


def tensor_types(path: Path) -> dict[str, int]:
    """How many of the file's tensors are stored in each type, e.g. {"Q8_0": 28, "F32": 9}."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return dict(Counter(t.tensor_type.name for t in reader.tensors))
