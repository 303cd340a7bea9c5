"""The trainer's side of vLLM's NCCL weight transfer (rollout/nccl.py) against the shapes of vLLM's API in the versions
the `vllm` extra admits, without vLLM: stand-ins written from vLLM 0.30-0.33's weight_transfer/base.py and
nccl_engine.py. NCCLTrainerInitInfo has the same fields in all four; WeightSource changed in 0.33 (a cached `metadata`
property and `iter_full()` instead of a `metadata()` method and iteration)."""

from __future__ import annotations

import dataclasses
import functools
from abc import ABC, abstractmethod
from typing import ClassVar

import pytest

from finetune.errors import FtError
from finetune.rollout.nccl import PACK_BYTES, init_info, source_class

FT_VALUES = dict(master_address="node0", master_port=29600, world_size=3, packed_buffer_size_bytes=PACK_BYTES, rank=0)


@dataclasses.dataclass
class TrainerInitInfo:  # base.py: `rank` keyword-only, `backend` a class constant
    backend: ClassVar[str] = ""
    rank: int = dataclasses.field(kw_only=True)


@dataclasses.dataclass
class InitInfo030To033(TrainerInitInfo):  # nccl_engine.py NCCLTrainerInitInfo, 0.30.0 through 0.33.0
    backend: ClassVar[str] = "nccl"
    master_address: str
    master_port: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = 1 << 30
    packed_num_buffers: int = 2


@dataclasses.dataclass
class InitInfoWithoutBufferSize(TrainerInitInfo):  # a version that dropped a field ft sets
    master_address: str
    master_port: int
    world_size: int


@dataclasses.dataclass
class InitInfoNeedingMore(TrainerInitInfo):  # a version with a required field ft does not know
    master_address: str
    master_port: int
    world_size: int
    transport: str


def test_the_init_info_takes_ft_values_where_the_version_declares_them():
    info = init_info(InitInfo030To033, **FT_VALUES)
    assert dataclasses.asdict(info) == {**FT_VALUES, "packed": True, "packed_num_buffers": 2}
    fewer = init_info(InitInfoWithoutBufferSize, **FT_VALUES)
    assert dataclasses.asdict(fewer) == {"rank": 0, "master_address": "node0", "master_port": 29600, "world_size": 3}
    with pytest.raises(FtError, match="InitInfoNeedingMore requires transport, which ft does not know"):
        init_info(InitInfoNeedingMore, **FT_VALUES)


class Source032(ABC):  # 0.30-0.32 WeightSource: abstract metadata() and __iter__, iterated by the NCCL engine
    @abstractmethod
    def metadata(self): ...

    @abstractmethod
    def __iter__(self): ...


class Source033(ABC):  # 0.33 WeightSource: `metadata` an abstract property, a cached_property in subclasses
    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        declared = cls.__dict__.get("metadata")
        if declared is not None and not isinstance(declared, functools.cached_property):
            raise TypeError(f"{cls.__name__}.metadata must be a functools.cached_property")

    @property
    @abstractmethod
    def metadata(self): ...

    def implements_iter_full(self) -> bool:
        return type(self).iter_full is not Source033.iter_full

    def iter_full(self):  # the base's own, as in vLLM 0.33: a source that does not override it is refused
        raise NotImplementedError


def test_the_weight_source_takes_the_form_each_version_asks_for():
    calls = []

    def metadata():
        calls.append("metadata")
        return ["w", "b"]

    def tensors():
        yield from [("w", 1), ("b", 2)]

    old = source_class(Source032, metadata, tensors)()
    assert old.metadata() == ["w", "b"] and list(old) == [("w", 1), ("b", 2)]
    new = source_class(Source033, metadata, tensors)()  # a plain metadata() method raises TypeError here
    assert new.implements_iter_full() and list(new.iter_full()) == [("w", 1), ("b", 2)]
    calls.clear()
    assert new.metadata == ["w", "b"] and new.metadata == ["w", "b"] and calls == ["metadata"]  # read once


@pytest.mark.vllm
def test_the_installed_vllm_takes_fts_init_info_and_weight_source():
    """With the installed vLLM's own classes: a trainer rank other than 0 opens nothing and, at each update, only
    iterates the parameters (its part in the gathers), which needs no GPU."""
    nccl_engine = pytest.importorskip("vllm.distributed.weight_transfer.nccl_engine")
    import torch
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    from finetune.rollout.nccl import ServerControl

    seen, posted = [], []

    def tensors():
        for name in ("a", "b"):
            seen.append(name)
            yield name, torch.zeros(2)

    metas = [ParamMeta("a", torch.float32, (2,)), ParamMeta("b", torch.float32, (2,))]
    source = source_class(WeightSource, lambda: metas, tensors)()
    info = init_info(nccl_engine.NCCLTrainerInitInfo, **{**FT_VALUES, "rank": 1})
    client = ServerControl(lambda path, body: posted.append(path))
    transfer = nccl_engine.NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
    transfer.send_weights()
    assert seen == ["a", "b"] and posted == []  # only rank 0 talks to the server
