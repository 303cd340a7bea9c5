"""Experiment trackers: each one writes what was logged, offline; missing packages and failures are handled."""

from __future__ import annotations

import logging
import sys

import pytest

from finetune import trackers as trk
from finetune.errors import FtError
from finetune.trackers import Trackers, flatten

SECRET = "hf_" + "Zq9" * 12
CONFIG = {
    "model": {"name": "tiny"},
    "train": {"lr": 2e-4, "max_steps": 3},
    "hub_token": SECRET,
    "data": {"datasets": [{"path": "d.jsonl", "format": "chat"}], "seq_len": 64},
    "adapter": {"target_modules": ["q_proj", "v_proj"]},
}


def _log_three_steps(t: Trackers) -> None:
    for step in (1, 2, 3):
        t.log(step, {"loss": 1.0 / step, "lr": 1e-4 * step, "note": "text is skipped", "missing": None})


def _hide(monkeypatch, *modules: str) -> None:
    """Make `import module` fail as if the package were not installed."""
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


# ---------------------------------------------------------------- no-ops and errors
def test_other_ranks_and_no_trackers_do_nothing(monkeypatch, tmp_path):
    _hide(monkeypatch, "wandb", "mlflow", "tensorboard", "torch.utils.tensorboard")
    for t in (
        Trackers(["tensorboard", "wandb", "mlflow"], tmp_path / "a", "r", CONFIG, rank=1),
        Trackers([], tmp_path / "b", "r", CONFIG),
    ):
        _log_three_steps(t)
        t.close()
        assert t.active == []
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "name, modules",
    [("wandb", ["wandb"]), ("mlflow", ["mlflow"]), ("tensorboard", ["tensorboard", "torch.utils.tensorboard"])],
)
def test_missing_package_names_the_key_and_the_extra(monkeypatch, tmp_path, name, modules):
    _hide(monkeypatch, *modules)
    with pytest.raises(FtError) as e:
        Trackers([name], tmp_path, "r", CONFIG)
    msg = str(e.value)
    assert "output.trackers" in msg and repr(name) in msg and f"pip install 'finetune[{name}]'" in msg


def test_all_missing_packages_are_reported_together(monkeypatch, tmp_path):
    _hide(monkeypatch, "wandb", "mlflow")
    with pytest.raises(FtError) as e:
        trk.check_installed(["wandb", "mlflow", "neptune"])
    msg = str(e.value)
    assert "finetune[wandb]" in msg and "finetune[mlflow]" in msg and "unknown tracker 'neptune'" in msg


class _Fake:
    """A tracker that records calls and fails when told to."""

    calls: list = []
    fail_on_start = False

    def __init__(self, run_dir, run_name, config):
        if _Fake.fail_on_start:
            raise ConnectionError("no route to host")
        self.config = config
        _Fake.calls.append(("start", config))

    def log(self, step, metrics):
        _Fake.calls.append(("log", step, metrics))
        if step >= 2:
            raise ConnectionError("network is down")

    def close(self, failed):
        _Fake.calls.append(("close", failed))


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setitem(trk.MODULES, "fake", "json")
    monkeypatch.setitem(trk._SINKS, "fake", _Fake)
    monkeypatch.setitem(trk._START_FIX, "fake", "check the fake")
    monkeypatch.setattr(_Fake, "calls", [])
    monkeypatch.setattr(_Fake, "fail_on_start", False)
    return _Fake


def test_a_failing_tracker_warns_once_and_training_goes_on(fake, tmp_path, caplog):
    t = Trackers(["fake"], tmp_path, "r", CONFIG)
    assert fake.calls[0][1]["hub_token"] == "***"  # redacted again, whatever the caller did
    with caplog.at_level(logging.WARNING, logger="finetune.trackers"):
        _log_three_steps(t)
        t.log(4, {"loss": 0.1})
    assert [c[0] for c in fake.calls] == ["start", "log", "log", "close"]
    assert fake.calls[1][2] == {"loss": 1.0, "lr": 1e-4}  # only numbers
    assert len(caplog.records) == 1 and "fake failed at step 2" in caplog.text and "network is down" in caplog.text
    assert t.active == []
    t.close()


def test_a_tracker_that_cannot_start_is_an_error(fake, tmp_path):
    fake.fail_on_start = True
    with pytest.raises(FtError, match=r"output.trackers: fake could not start: ConnectionError.*\n    fix: check"):
        Trackers(["fake"], tmp_path, "r", CONFIG)


def test_close_marks_failure_from_a_with_block(fake, tmp_path):
    with pytest.raises(RuntimeError):
        with Trackers(["fake"], tmp_path, "r", CONFIG) as t:
            t.log(1, {"loss": 1.0})
            raise RuntimeError("training crashed")
    assert fake.calls[-1] == ("close", True)


def test_flatten():
    assert flatten({"train": {"lr": 1e-4}, "data": {"datasets": [{"path": "x"}]}, "t": ["q", "v"], "e": {}}) == {
        "train.lr": "0.0001",
        "data.datasets.0.path": "x",
        "t": "['q', 'v']",
    }


# ---------------------------------------------------------------- the real trackers, offline
def test_tensorboard_writes_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Trackers(["tensorboard"], tmp_path, "r", CONFIG) as t:
        _log_three_steps(t)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"loss", "lr"}
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([1.0, 0.5, 1 / 3])


@pytest.mark.slow
def test_wandb_offline_writes_a_run_folder(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_PROJECT", "ft-test")
    run_dir = tmp_path / "run"
    with Trackers(["wandb"], run_dir, "my-run", CONFIG) as t:
        _log_three_steps(t)
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    import time

    deadline = time.time() + 30  # wandb's service process may still be flushing the run file on a busy machine
    while True:
        data = b"".join(p.read_bytes() for p in runs[0].glob("run-*.wandb"))
        if b"loss" in data or time.time() > deadline:
            break
        time.sleep(0.5)
    assert b"loss" in data and b"my-run" in data and b"***" in data
    assert not [p for p in run_dir.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]


def _read_mlflow(uri: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("ft")
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


@pytest.mark.slow
def test_mlflow_logs_to_the_run_folder(monkeypatch, tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    with Trackers(["mlflow"], run_dir, "my-run", CONFIG) as t:
        _log_three_steps(t)
    client, run = _read_mlflow(f"sqlite:///{(run_dir / 'mlflow.db').as_posix()}")
    assert run.info.run_name == "my-run" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == [1, 2, 3]
    assert [m.value for m in history] == pytest.approx([1.0, 0.5, 1 / 3])
    params = run.data.params
    assert params["train.lr"] == "0.0002" and params["data.datasets.0.path"] == "d.jsonl"
    assert params["hub_token"] == "***"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing written to the working directory


def test_mlflow_follows_the_tracking_uri(monkeypatch, tmp_path):
    pytest.importorskip("mlflow")
    store = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this switch
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    with Trackers(["mlflow"], tmp_path / "run", "r", CONFIG) as t:
        _log_three_steps(t)
    client, run = _read_mlflow(store)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "lr")] == [1, 2, 3]
    assert not (tmp_path / "run" / "mlflow.db").exists()
