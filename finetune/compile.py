"""Regional compilation (plan.compile): each decoder layer compiled on its own with torch.compile.

torch's recommended way for a stack of identical blocks (torch 2.13 `nn.Module.compile`, the "regional compilation"
recipe): one layer's graph is traced and compiled once and every other layer reuses it (their parameters are inputs
of the graph, not constants), so the compile time is that of one layer rather than of the whole model. The module
tree is unchanged (no `_orig_mod.` wrapper), so parameter names, checkpoints, peft adapters and FSDP2's per-layer
units stay as they are. `engine.build` calls `compile_layers` on the model it wraps (single, DDP, FSDP2):
- FSDP2: fully_shard's hooks run inside each layer's compiled call, but torch 2.13 marks them as not to be traced
  (fully_shard/_fsdp_state.py: _pre_forward, _post_forward under `_dynamo_disable`), so the all-gathers and
  reshards stay eager and only the layer's compute is compiled;
- DDP: the layers are compiled before DDP wraps the model, whose gradient hooks are on the parameters;
- activation checkpointing (non-reentrant, as models.py enables it): transformers 5.24 checkpoints a layer's
  `forward` inside its `__call__`, so the compiled call contains the checkpoint, which dynamo traces as a region to
  recompute in the backward pass.
torch compiles lazily, on a layer's first call: a failure surfaces in the first forward or backward pass, where
`failures_explained` turns it into one FtError naming the key and the fix.
"""

from __future__ import annotations

import contextlib

from finetune.errors import FtError

RECOMPILE_LIMIT = 32  # variants of the shared layer code kept compiled (compile_layers)
BACKEND = "inductor"  # torch's default compiler: Triton kernels on GPUs, C++ (needs a compiler) on CPUs


def compile_layers(model, backend: str = BACKEND) -> int:
    """Compile each decoder layer of `model` in place (nn.Module.compile); returns how many. `backend`: a torch.compile
    backend (tests use "aot_eager", which traces and runs autograd's graphs without generating code)."""
    from finetune import activations
    from finetune.distributed import fsdp

    # transformers' GradientCheckpointingLayer: found by class, so also after fully_shard swapped the layers' classes;
    # else (older remote code) the classes the model marks as not to be split, as FSDP2 shards them
    layers = activations.decoder_layers(model)
    try:
        layers = layers or fsdp.decoder_layers(model)
    except ValueError as e:
        raise FtError(
            f"train.compile: {e}; ft compiles a model one decoder layer at a time. Set train.compile: false"
        ) from None
    import torch._dynamo

    # Every layer runs one code object (the layer class's forward), so its variants add up in one cache: the first
    # layer's input needs no gradient (a frozen embedding) and the others' do, training and evaluation (grad mode),
    # static then dynamic shapes: about eight in one job, torch's default limit, past which dynamo silently runs the
    # layers eagerly. A setting of dynamo's (not a patch); never lowered.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)


def is_compiled(module) -> bool:
    """Whether nn.Module.compile was called on `module` (torch 2.13 keeps that call in `_compiled_call_impl`)."""
    return getattr(module, "_compiled_call_impl", None) is not None


@contextlib.contextmanager
def failures_explained(inner: contextlib.AbstractContextManager):
    """`inner`, with a torch.compile failure raised inside it turned into an FtError (the original chained)."""
    with inner:
        try:
            yield
        except Exception as e:
            from torch._dynamo.exc import TorchDynamoException

            # torch's compiler stack: dynamo's tracing, a backend such as inductor failing, a missing compiler
            if not isinstance(e, TorchDynamoException):
                raise
            raise FtError(compile_failure_message(e)) from e


def compile_failure_message(e: BaseException) -> str:
    """What went wrong, from the error the compiler raised (a backend's failure carries it as `inner_exception`)."""
    cause = getattr(e, "inner_exception", None) or e
    first = next((line for line in str(cause).splitlines() if line.strip()), "")
    return (
        f"train.compile: torch.compile could not compile a decoder layer ({type(cause).__name__}: {first[:300]}). Set "
        "train.compile: false to train without compiling (the traceback is in the run folder's log; "
        "TORCH_LOGS=+dynamo shows what torch traced)"
    )
