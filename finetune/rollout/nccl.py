"""Full weights to a vLLM rollout server over NCCL (GPUs): vLLM's own weight-transfer engine and its HTTP routes.

The server (`vllm serve --weight-transfer-config '{"backend": "nccl"}'`, rollout/serve.py) has vLLM's NCCL weight
transfer enabled. On the first update, trainer rank 0 opens the
transfer group (rank 0 of it; the server's workers follow) with vLLM's `NCCLTrainerWeightTransferEngine`. Each update
then broadcasts every parameter from rank 0's GPU. Packed buffers keep a bounded amount in flight. Every trainer rank
iterates the parameters, so each sharded parameter is all-gathered once and freed again: no GPU ever holds the
whole model. The control calls travel over vLLM's routes (`/init_weight_transfer_engine`, `/start_weight_update`,
`/update_weights`, `/finish_weight_update`). CPUs have no NCCL (and vLLM's other backend, IPC, shares CUDA memory):
there the server reloads the weights from files (server.py).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import socket

from finetune.errors import FtError

PACK_BYTES = 256 * 2**20  # each of vLLM's two packing buffers on rank 0's GPU during an update (its default: 1 GiB)
ADDRESS_ENV = "FT_ROLLOUT_NCCL_ADDR"  # the address the server's workers reach trainer rank 0 at (default: hostname)


def weight_source(engine):
    """The trainer's parameters as vLLM's `WeightSource`: shapes without gathering, then each gathered in turn."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    def metadata():
        return [
            ParamMeta(name, p.dtype, tuple(getattr(p, "ds_shape", None) or p.shape))  # ZeRO-3: the full shape
            for name, p in engine.inner.named_parameters(remove_duplicate=False)
        ]

    def tensors():
        import torch

        here = torch.device("cuda", torch.cuda.current_device())
        for name, tensor in engine.full_parameters():  # parameters offloaded to host RAM are gathered over gloo
            yield name, tensor if tensor.is_cuda else tensor.to(here)  # NCCL sends CUDA tensors only

    return source_class(WeightSource, metadata, tensors)()


def source_class(base, metadata, tensors):
    """A `base` (vLLM's WeightSource) subclass declaring `metadata()`'s parameters and yielding `tensors()`, in the
    form the installed vLLM asks for. 0.30-0.32 (weight_transfer/base.py): abstract `metadata()` and `__iter__`. 0.33:
    an abstract `metadata` property that subclasses must define as a functools.cached_property (checked in its
    `__init_subclass__`), and `iter_full()`, which its NCCL engine iterates (`implements_iter_full`)."""
    if isinstance(inspect.getattr_static(base, "metadata", None), property):

        class TrainerParameters(base):
            @functools.cached_property
            def metadata(self):
                return metadata()

            def iter_full(self):
                yield from tensors()

        return TrainerParameters

    class TrainerParameters(base):
        def metadata(self):
            return metadata()

        def __iter__(self):
            yield from tensors()

    return TrainerParameters


def init_info(cls, **values):
    """vLLM's `NCCLTrainerInitInfo` from the values ft has, passing only the fields the installed version declares
    (0.30-0.33: master_address, master_port, world_size, packed, packed_buffer_size_bytes, packed_num_buffers; rank,
    keyword-only, from its base TrainerInitInfo); a field it requires that ft does not know is named."""
    declared = {f.name: f for f in dataclasses.fields(cls) if f.init}
    missing = [
        name
        for name, f in declared.items()
        if name not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise FtError(
            f"this vLLM's {cls.__name__} requires {', '.join(missing)}, which ft does not know (ft was written "
            "against vLLM 0.30-0.33).\n    fix: pip install 'vllm>=0.30,<0.34', or set method.rollout.placement: "
            "colocated"
        )
    return cls(**{k: v for k, v in values.items() if k in declared})


class ServerControl:
    """vLLM's weight-sync client protocol (`VLLMWeightSyncClient`, structural) over vLLM's own HTTP routes
    (entrypoints/rl/online/api_router.py), through ft's client (its token, timeouts and error messages). vLLM ships
    `HTTPVLLMWeightSyncClient` for the same routes; it needs `requests` and sends no API key."""

    def __init__(self, post):
        self.post = post  # (path, body dict) -> reply

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.post("/start_weight_update", {})

    def update_weights(self, update_info) -> None:
        self.post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.post("/finish_weight_update", {} if weight_version is None else {"weight_version": weight_version})
        self.post("/reset_prefix_cache", {})  # no KV block computed with the old weights is reused

    def shutdown_weight_transfer_engine(self) -> None:
        pass


class NcclSender:
    """Trainer side: opened once (every rank), then `send()` per update (every rank)."""

    def __init__(self, engine, runtime, post, server_workers: int):
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        address = os.environ.get(ADDRESS_ENV) or socket.gethostname()
        info = init_info(
            NCCLTrainerInitInfo,
            master_address=address,
            master_port=_free_port(),
            world_size=1 + server_workers,  # trainer rank 0 sends; the server's workers receive
            packed_buffer_size_bytes=PACK_BYTES,
            rank=runtime.rank,
        )
        self.transfer = NCCLTrainerWeightTransferEngine.trainer_init(
            info, client=ServerControl(post), source=weight_source(engine)
        )

    def send(self) -> None:
        self.transfer.send_weights()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
