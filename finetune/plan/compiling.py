"""train.compile: whether the decoder layers are compiled (plan.compile; finetune/compile.py does it).

`auto` compiles where it is supported and repays its cost: torch.compile needs a code generator (Triton on GPUs, a C++
compiler on CPUs), cannot trace bitsandbytes' quantized layers, and ft does not compile under DeepSpeed's engine;
compiling one layer takes about a minute (traced once, reused by every layer; once more when lengths first change),
which a run must win back from its steps. `true` where it cannot work is refused with the reason and the fix.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

from finetune.config.schema import Config
from finetune.errors import PlanError
from finetune.hardware import Hardware
from finetune.plan.plan import Decision

# Estimated seconds to compile one decoder layer (forward and backward), for the first shape and again when lengths
# change (torch then compiles a graph with dynamic lengths): inductor's Triton kernels on a GPU, C++ on a CPU.
COMPILE_SECONDS = {"gpu": 60.0, "cpu": 120.0}
GAIN = 0.1  # share of a step's estimated time that compiled layers save (fused norms, activations, rotary embeddings)


def choose_compile(
    config: Config,
    hw: Hardware,
    backend: str,
    quantization: str,
    step_seconds: float,
    out,
    context_parallel: int = 1,
    expert_parallel: int = 1,
) -> bool:
    """The plan's `compile`, with its Decision appended to `out`; PlanError for `true` where it cannot work."""
    asked = config.train.compile
    if asked is False:
        out.append(Decision("compile", False, "as set in the config", "config"))
        return False
    ring = "context parallelism replaces each layer's attention at run time (ring attention)" * (context_parallel > 1)
    dispatch = "expert parallelism reads each MoE layer's split sizes on the host (distributed/ep.py)" * (
        expert_parallel > 1
    )
    blocker = unsupported(backend, quantization) or ring or dispatch or missing_toolchain(hw)
    if asked is True:
        if blocker:
            raise PlanError(f"train.compile: true cannot run here: {blocker}. Set train.compile: false (or auto)")
        out.append(Decision("compile", True, "as set in the config", "config"))
        return True
    on, reason = (False, blocker) if blocker else repays(config, hw, step_seconds)
    out.append(Decision("compile", on, reason))
    return on


def unsupported(backend: str, quantization: str) -> str:
    """Why this setup cannot be compiled ("" when it can)."""
    if backend == "deepspeed":
        return (
            "ft compiles the decoder layers of models it wraps itself (single, ddp, fsdp); DeepSpeed's engine "
            "partitions and hooks them in ways ft does not compile through (use distributed.backend: fsdp)"
        )
    if quantization != "none":
        return (
            f"the base's bitsandbytes {quantization} layers hold packed weights and call bitsandbytes' own kernels, "
            "which torch.compile cannot trace"
        )
    return ""


def missing_toolchain(hw: Hardware) -> str:
    """What torch's compiler (inductor) lacks on this machine ("" when nothing): a C++ compiler on CPUs (torch takes
    the one $CXX names, else g++), Triton on GPUs."""
    if hw.is_cpu:
        cxx = os.environ.get("CXX", "g++")
        if shutil.which(cxx) is None:
            return (
                f"no C++ compiler found ({cxx} is not on PATH): torch compiles for CPUs with one; install g++ or set "
                "CXX"
            )
        return ""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed: torch compiles for GPUs with it (pip install triton)"
    return ""


def repays(config: Config, hw: Hardware, step_seconds: float) -> tuple[bool, str]:
    """On when the time compiled steps save (GAIN of each) exceeds the time compiling takes."""
    cost = COMPILE_SECONDS["cpu" if hw.is_cpu else "gpu"]
    if config.data.packing and config.model.attn_implementation in ("auto", "sdpa_varlen"):
        return False, (
            "packed rows attend sample by sample (sdpa_varlen): every batch brings new sample lengths, which "
            "recompile the layers (measured on CPU: 0.42x the eager speed); set train.compile: true to compile anyway"
        )
    if config.method.generation_tokens(config.data.seq_len):
        return False, (
            "the model also samples completions, whose lengths change at every token and would recompile the "
            "layers; set train.compile: true to compile anyway"
        )
    steps = config.train.max_steps
    if not steps:
        return False, (
            f"the number of steps is not known when planning (set by train.epochs); compiling takes about "
            f"{cost:.0f} s, which a short run does not win back: set train.compile: true to compile anyway"
        )
    saved = GAIN * step_seconds * steps
    verdict = "repays" if saved > cost else "would not repay"
    return saved > cost, (
        f"compiling takes about {cost:.0f} s; compiled layers save about {GAIN:.0%} of each step's est. "
        f"{step_seconds:.3g} s, {saved:.0f} s over {steps} steps: it {verdict} its cost"
    )
