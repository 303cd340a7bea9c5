"""The checkpoint protocol (finetune/checkpoint.py) around an engine's own format, on a tiny torch model in one
process: a write that fails leaves nothing partial and keeps the earlier checkpoints, the newest K are kept, a
checkpoint of another format is refused, and a round trip restores the model, optimizer, schedule and RNG."""

from __future__ import annotations

import errno
import json

import pytest
import torch

from finetune import checkpoint
from finetune.distributed.engine import FORMAT, Engine, TorchEngine, read_trained
from finetune.distributed.runtime import Runtime
from finetune.errors import FtError


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.trained = torch.nn.Linear(4, 3)
        self.frozen = torch.nn.Linear(3, 2).requires_grad_(False)

    def forward(self, x):
        return self.frozen(self.trained(x))


def engine(seed: int = 0, cls=TorchEngine) -> TorchEngine:
    torch.manual_seed(seed)
    model = Tiny()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return cls(model, optimizer, scheduler, max_grad_norm=1.0, fp16=False, device=torch.device("cpu"))


def trained_step(e: TorchEngine) -> None:
    e.backward(e.model(torch.randn(5, 4)).square().mean())
    e.step()


def steps(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


class FailingWrite(TorchEngine):
    """An engine whose write fails halfway, as a full disk makes it."""

    def save(self, path, runtime):
        (path / "half-written.bin").write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")


class Buggy(TorchEngine):
    def save(self, path, runtime):
        (path / "half-written.bin").write_bytes(b"\0" * 100)
        raise ValueError("a bug in an engine")


class OtherFormat(TorchEngine):
    format = "deepspeed"


def test_torch_engine_is_an_engine():
    assert isinstance(engine(), Engine) and engine().format == FORMAT


def test_a_round_trip_restores_model_optimizer_schedule_and_rng(tmp_path):
    e = engine()
    trained_step(e)
    path = checkpoint.save(tmp_path, 1, e, {"position": 7, "tokens": 10}, keep=3, runtime=Runtime())
    assert path == tmp_path / "checkpoints" / "step-00000001"
    state = json.loads((path / "state.json").read_text())
    assert (state["step"], state["position"], state["format"]) == (1, 7, FORMAT)
    expected_next = torch.rand(3)
    weights = {n: p.detach().clone() for n, p in e.inner.named_parameters()}
    trained_step(e)  # moves the weights, optimizer, schedule and RNG on

    other = engine(seed=1)  # different starting weights
    saved = checkpoint.load(path, other, Runtime())
    assert saved["position"] == 7 and saved["step"] == 1
    for name, p in other.inner.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, weights[name]), name
    assert torch.equal(torch.rand(3), expected_next)  # the RNG continues where the checkpoint left it
    assert other.scheduler.last_epoch == 1 and other.lr() == pytest.approx(0.1 / 2)
    assert other.optimizer.state_dict()["state"][0]["step"] == 1
    trained = read_trained(path, checkpoint.written_format(path), other.inner)
    assert set(trained) == {"trained.weight", "trained.bias"}  # frozen weights are never written


def test_a_failed_write_leaves_nothing_partial_and_keeps_the_earlier_checkpoints(tmp_path):
    checkpoint.save(tmp_path, 2, engine(), {"position": 0}, keep=3, runtime=Runtime())
    with pytest.raises(
        FtError,
        match=r"checkpoint step 4 .*the disk is full.*partial checkpoint was removed.*\(step-00000002\).*--resume",
    ):
        checkpoint.save(tmp_path, 4, engine(cls=FailingWrite), {"position": 0}, keep=3, runtime=Runtime())
    assert steps(tmp_path) == ["step-00000002"]  # no hidden temporary folder either
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-00000002"]


def test_an_engine_bug_is_shown_as_it_is_and_leaves_nothing_partial(tmp_path):
    with pytest.raises(ValueError, match="a bug in an engine"):
        checkpoint.save(tmp_path, 1, engine(cls=Buggy), {"position": 0}, keep=3, runtime=Runtime())
    assert steps(tmp_path) == []


def test_the_newest_k_are_kept_and_a_step_saved_again_is_replaced(tmp_path):
    e = engine()
    for step in range(1, 6):
        checkpoint.save(tmp_path, step, e, {"position": step}, keep=2, runtime=Runtime())
    assert steps(tmp_path) == ["step-00000004", "step-00000005"]
    checkpoint.save(tmp_path, 5, e, {"position": 50, "stopped_by": "SIGTERM"}, keep=2, runtime=Runtime())
    assert steps(tmp_path) == ["step-00000004", "step-00000005"]
    assert checkpoint.read_state(checkpoint.latest(tmp_path))["position"] == 50


def test_a_checkpoint_of_another_format_is_refused_with_the_fix(tmp_path):
    path = checkpoint.save(tmp_path, 1, engine(), {"position": 0}, keep=3, runtime=Runtime())
    with pytest.raises(FtError, match=r"'dcp' format and this job's backend reads 'deepspeed'.*distributed.backend"):
        checkpoint.load(path, engine(cls=OtherFormat), Runtime())
    state = json.loads((path / "state.json").read_text())
    (path / "state.json").write_text(json.dumps({**state, "format": "single"}))  # a development version's format
    with pytest.raises(FtError, match=r"'single' format of a development version.*new output.dir"):
        checkpoint.load(path, engine(), Runtime())
    with pytest.raises(FtError, match=r"format 'single'.*development version of ft"):
        read_trained(path, "single", engine().inner)
    assert (path / "dcp").is_dir()  # refused, not removed
    del state["format"]
    (path / "state.json").write_text(json.dumps(state))
    with pytest.raises(FtError, match="records no format"):
        checkpoint.load(path, engine(), Runtime())
    with pytest.raises(FtError, match="format 'zip'.*cannot read"):
        read_trained(path, "zip", engine().inner)


def test_a_rank_the_checkpoint_did_not_have_starts_from_rank_0s_rng(tmp_path):
    path = checkpoint.save(tmp_path, 1, engine(), {"position": 0}, keep=3, runtime=Runtime())
    assert [p.name for p in path.glob("rng-*.pt")] == ["rng-0.pt"]
    expected = torch.rand(2)
    checkpoint.load(path, engine(), Runtime(rank=1, local_rank=1, world_size=1))
    assert torch.equal(torch.rand(2), expected)


def test_every_rank_resumes_from_the_checkpoint_rank_0_found(tmp_path):
    import json
    from types import SimpleNamespace

    from finetune import checkpoint

    found = {}
    for step in (4, 6):
        found[step] = tmp_path / "checkpoints" / f"step-{step:08d}"
        found[step].mkdir(parents=True)
        (found[step] / "state.json").write_text(json.dumps({"step": step}))
    # rank 0 found step 4; this node started later and found step 6, completed in between
    peer = SimpleNamespace(rank=1, is_main=False, sum=lambda value: 4.0 + value)
    assert checkpoint.agreed(tmp_path, found[6], peer) == found[4]
    fresh = SimpleNamespace(rank=1, is_main=False, sum=lambda value: 0.0 + value)  # rank 0 starts from scratch
    assert checkpoint.agreed(tmp_path, found[6], fresh) is None
    main = SimpleNamespace(rank=0, is_main=True, sum=lambda value: value)
    assert checkpoint.agreed(tmp_path, found[4], main) == found[4] and checkpoint.agreed(tmp_path, None, main) is None


@pytest.mark.own_process  # a process group in-process: not in a pytest worker shared with later tests
def test_a_ddp_model_round_trips_its_trained_weights_and_optimizer(tmp_path):
    """DDP's parameters are named module.* while torch's get_state_dict names them as the unwrapped model does: the
    checkpoint holds (and restores) every trained tensor all the same."""
    from finetune.distributed import ddp
    from tests.helpers import in_a_one_rank_group

    def wrapped(seed):
        e = engine(seed)
        e.model = ddp.wrap(e.model, torch.device("cpu"))
        return e

    def check():
        e = wrapped(0)
        trained_step(e)
        path = checkpoint.save(tmp_path, 1, e, {"position": 0}, keep=3, runtime=Runtime())
        weights = {n: p.detach().clone() for n, p in e.inner.named_parameters() if p.requires_grad}
        other = wrapped(1)
        checkpoint.load(path, other, Runtime())
        assert all(torch.equal(p, weights[n]) for n, p in other.inner.named_parameters() if p.requires_grad)
        assert other.optimizer.state_dict()["state"][0]["step"] == 1

    in_a_one_rank_group(check, f"file://{tmp_path / 'group'}")
