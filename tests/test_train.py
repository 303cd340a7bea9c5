"""`ft train` on one process with the tiny model: learning, what is trained, saving, resuming, stopping, errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from finetune.errors import FtError
from finetune.merge import read_record
from finetune.tiny import arithmetic_records, write_jsonl
from tests.helpers import REPO, job_text, losses, setup_job, write_job


def train(tmp_path, text, **kw):
    from finetune.workflow import run_train

    return run_train(write_job(tmp_path, text), hardware="cpu", **kw)


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["full", "lora", "qlora", "int8"])
def test_loss_falls_and_only_trainable_parameters_change(tmp_path, adapter):
    from finetune.train import run

    # a small set the adapter can fit: a random base gives LoRA little to build on in a few steps
    small = write_jsonl(arithmetic_records(16, seed=5), tmp_path / "small.jsonl")
    config, p, prepared, job = setup_job(tmp_path, job_text(tmp_path, adapter, steps=25, data=small))
    before = {n: t.detach().clone() for n, t in job.model.named_parameters()}
    trainable = {n for n, t in job.model.named_parameters() if t.requires_grad}
    (tmp_path / "run").mkdir()
    run(job, tmp_path / "run")
    seen = losses(tmp_path / "run")
    # a random tiny base caps what an adapter can reach (frozen tied embeddings bound the logits), so
    # adapters must cut the loss by 15%, full fine-tuning by 40%; without training it stays flat
    assert sum(seen[-5:]) / 5 < (0.6 if adapter == "full" else 0.85) * seen[0], seen
    after = dict(job.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert changed and changed <= trainable
    if adapter == "full":
        assert len(changed) == len(trainable) == len(before)
    else:
        numel = {n: t.numel() for n, t in job.model.named_parameters()}
        assert all("lora_" in n for n in changed) and sum(numel[n] for n in trainable) < 0.2 * sum(numel.values())


@pytest.mark.slow
def test_run_folder_holds_what_is_needed_to_understand_and_repeat_the_run(tmp_path):
    result = train(tmp_path, job_text(tmp_path, "lora", steps=8))
    run_dir = tmp_path / "run"
    for name in (
        "config.yaml",
        "plan.json",
        "environment.json",
        "data.json",
        "metrics.jsonl",
        "loss.png",
        "README.md",
        "launch.txt",
        "result.json",
        "final/adapter_config.json",
        "final/adapter_model.safetensors",
        "final/tokenizer.json",
    ):
        assert (run_dir / name).exists(), name
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 9))
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "memory_gib"} <= set(rows[0])
    assert json.loads((run_dir / "plan.json").read_text())["adapter"] == "lora"
    assert json.loads((run_dir / "environment.json").read_text())["packages"]["torch"] == torch.__version__
    assert "PeftModel.from_pretrained" in (run_dir / "README.md").read_text()
    assert result["artifact"] == "adapter"


@pytest.mark.slow
def test_saved_adapter_reloads_with_the_trained_outputs(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from finetune.tiny import ensure_model
    from finetune.train import run, save_final

    config, p, prepared, job = setup_job(tmp_path, job_text(tmp_path, "lora", steps=6))
    (tmp_path / "run").mkdir()
    run(job, tmp_path / "run")
    final = save_final(job, tmp_path / "run", prepared.tokenizer)
    ids = torch.tensor([prepared.tokenizer("What is 12 + 30?")["input_ids"]])
    job.model.eval()
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(ensure_model())), str(final)).eval()
    untrained = AutoModelForCausalLM.from_pretrained(str(ensure_model())).eval()
    with torch.no_grad():
        trained, again, base = job.model(ids).logits, reloaded(ids).logits, untrained(ids).logits
    torch.testing.assert_close(again, trained, atol=1e-5, rtol=1e-5)
    assert (trained - base).abs().max() > 1e-3  # the adapter changed the outputs


@pytest.mark.slow
def test_micro_batch_1_times_4_equals_micro_batch_4(tmp_path):
    from finetune.train import train_step

    states = []
    for micro in (1, 4):
        sub = tmp_path / f"m{micro}"
        sub.mkdir()
        _, p, _, job = setup_job(sub, job_text(sub, "full", steps=2, batch=4, micro=micro))
        assert p.micro_batch_size == micro and p.gradient_accumulation_steps == 4 // micro
        metrics = train_step(job)
        states.append((metrics["loss"], {n: t.detach().clone() for n, t in job.model.named_parameters()}))
    (loss1, w1), (loss4, w4) = states
    assert loss1 == pytest.approx(loss4, rel=1e-5)
    assert max((w1[n] - w4[n]).abs().max().item() for n in w1) < 1e-6


@pytest.mark.slow
def test_interrupted_and_resumed_run_matches_an_uninterrupted_one(tmp_path):
    """Stopped twice (the Slurm requeue case) and resumed twice: the same weights and one log line per step."""
    from finetune import checkpoint
    from finetune.errors import Stopped
    from finetune.train import SignalStop, run, setup

    text = job_text(tmp_path, "lora", steps=8).replace("save_steps: 0", "save_steps: 100")
    config, p, prepared, job = setup_job(tmp_path, text)
    (tmp_path / "run").mkdir()
    run(job, tmp_path / "run")
    straight = {n: t.detach().clone() for n, t in job.model.named_parameters() if t.requires_grad}

    def stopping_at(at: int):
        stop = SignalStop()

        def hook(step, total, row):
            if step == at:
                stop.signum = signal.SIGTERM

        return stop, hook

    (tmp_path / "run2").mkdir()
    resume_from = None
    for at in (3, 6):
        stop, hook = stopping_at(at)
        with pytest.raises(Stopped) as info:
            run(setup(config, p, prepared), tmp_path / "run2", resume_from=resume_from, on_step=hook, stop=stop)
        assert info.value.exit_code == 143 and "--resume" in str(info.value)
        resume_from = checkpoint.latest(tmp_path / "run2")
        assert resume_from.name == f"step-{at:08d}"
    positions = [
        json.loads((c / "state.json").read_text())["position"] for c in checkpoint.checkpoints(tmp_path / "run2")
    ]
    assert len(positions) == 2 and positions[0] != positions[1]  # each checkpoint records its own data position
    job3 = setup(config, p, prepared)
    run(job3, tmp_path / "run2", resume_from=resume_from)
    resumed = {n: t.detach() for n, t in job3.model.named_parameters() if t.requires_grad}
    assert max((straight[n] - resumed[n]).abs().max().item() for n in straight) == 0.0
    assert [
        json.loads(line)["step"]
        for line in (tmp_path / "run2" / "metrics.jsonl").read_text().splitlines()
        if "loss" in line
    ] == list(range(1, 9))


@pytest.mark.slow
def test_checkpoints_keep_the_newest_and_disk_full_loses_nothing(tmp_path, monkeypatch):
    from finetune import checkpoint

    text = job_text(tmp_path, "lora", steps=10).replace("save_steps: 0", "save_steps: 2, keep_checkpoints: 2")
    train(tmp_path, text)
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "run")] == ["step-00000006", "step-00000008"]
    import errno

    import torch.distributed.checkpoint as dcp

    calls = {"n": 0}
    real = dcp.save

    def full_disk(*a, **k):
        calls["n"] += 1
        if calls["n"] >= 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(dcp, "save", full_disk)
    with pytest.raises(FtError, match="disk is full.*earlier checkpoints are intact"):
        train(tmp_path, text.replace("/run,", "/run2,"))
    names = [p.name for p in checkpoint.checkpoints(tmp_path / "run2")]
    assert names == ["step-00000002", "step-00000004"]
    assert not [p for p in (tmp_path / "run2" / "checkpoints").iterdir() if p.name.startswith(".tmp")]


@pytest.mark.slow
def test_output_dir_holding_a_run_is_refused_unless_resume_or_overwrite(tmp_path, capsys):
    text = job_text(tmp_path, "full", steps=2)
    train(tmp_path, text)
    run = tmp_path / "run"
    with pytest.raises(FtError, match="already holds a run.*--resume.*--overwrite"):
        train(tmp_path, text)
    final = {p: p.stat().st_mtime_ns for p in (run / "final").iterdir()}
    assert train(tmp_path, text, resume=True)["finished"] is True  # a finished run: said so, nothing changed
    assert "finished all 2 steps" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in (run / "final").iterdir()} == final
    with pytest.raises(FtError, match=r"differs from the run's.*train\.lr.*--allow-changes"):
        train(tmp_path, text.replace("max_steps: 2", "max_steps: 3").replace("lr: 0.003", "lr: 0.001"), resume=True)
    # longer: resume-safe
    assert train(tmp_path, text.replace("max_steps: 2", "max_steps: 3"), resume=True)["steps"] == 3
    assert "starting from step 0" in capsys.readouterr().err  # no checkpoint to continue from (save_steps: 0)
    assert "train.max_steps" in (run / "resume-changes.jsonl").read_text()
    (run / "notes.txt").write_text("mine")
    assert train(tmp_path, text, overwrite=True)["steps"] == 2
    assert (run / "notes.txt").read_text() == "mine" and not (run / "resume-changes.jsonl").exists()


def test_overwrite_never_deletes_what_ft_did_not_make(tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "code.py").write_text("print('keep me')")
    (project / ".git").mkdir()
    monkeypatch.chdir(project)
    here = job_text(tmp_path, "full", steps=2).replace(f"dir: {tmp_path / 'run'}", "dir: .")
    with pytest.raises(FtError, match="not empty and is not an ft run folder"):
        train(project, here)
    (project / "config.yaml").write_text("looks like a run\n")  # an older run folder, or a project with a config.yaml
    with pytest.raises(FtError, match="folder you run ft from"):
        train(project, here, overwrite=True)
    legacy = tmp_path / "legacy"
    (legacy / "checkpoints").mkdir(parents=True)
    (legacy / "data.bin").write_text("x")
    with pytest.raises(FtError, match="no .ft-run marker.*checkpoints, data.bin"):
        train(
            tmp_path,
            job_text(tmp_path, "full", steps=2).replace(f"dir: {tmp_path / 'run'}", f"dir: {legacy}"),
            overwrite=True,
        )
    holder = tmp_path / "holder"
    holder.mkdir()
    (holder / ".ft-run").write_text("")
    with pytest.raises(FtError, match="holds the job file"):
        train(
            holder,
            job_text(tmp_path, "full", steps=2).replace(f"dir: {tmp_path / 'run'}", f"dir: {holder}"),
            overwrite=True,
        )
    assert (project / "src" / "code.py").exists() and (project / ".git").is_dir() and (legacy / "data.bin").exists()
    assert (holder / "job.yaml").exists()


@pytest.mark.slow
def test_output_dir_is_checked_before_any_work(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("")
    with pytest.raises(FtError, match="is a file, not a folder"):
        train(
            tmp_path,
            job_text(tmp_path, "full", steps=1).replace(f"dir: {tmp_path / 'run'}", f"dir: {tmp_path / 'afile'}"),
        )
    assert not (tmp_path / "cache").exists()  # refused before the data was prepared
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    train(tmp_path, job_text(tmp_path, "full", steps=1).replace(f"dir: {tmp_path / 'run'}", "dir: ~/runs/one"))
    assert (tmp_path / "home" / "runs" / "one" / "final").is_dir() and not (tmp_path / "~").exists()


@pytest.mark.parametrize(
    "edit, needle",
    [
        (("model: {name: ft-tiny}", "model: {name: ./no/such/folder}"), "does not exist"),
        (
            (
                "adapter: {type: lora, r: 8, alpha: 16, dropout: 0.0}",
                "adapter: {type: lora, target_modules: [qq_proj]}",
            ),
            "matches no module",
        ),
    ],
)
def test_bad_model_inputs_are_clear(tmp_path, edit, needle):
    with pytest.raises(FtError, match=needle):
        train(tmp_path, job_text(tmp_path, "lora", steps=2).replace(*edit))


@pytest.mark.slow
def test_sigterm_saves_a_resumable_checkpoint(tmp_path):
    path = write_job(tmp_path, job_text(tmp_path, "full", steps=2000))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "finetune", "train", str(path), "--hardware", "cpu"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "Resume with: ft train CONFIG --resume" in err and "Traceback" not in err
    from finetune import checkpoint

    last = checkpoint.latest(tmp_path / "run")
    assert last is not None
    state = json.loads((last / "state.json").read_text())
    assert 3 <= state["step"] < 2000 and state["position"] == state["step"] * 8


@pytest.mark.slow
def test_lora_run_merges_into_a_model_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    train(tmp_path, job_text(tmp_path, "lora", steps=4))
    out = tmp_path / "merged"
    r = subprocess.run(
        [sys.executable, "-m", "finetune", "merge-lora", str(tmp_path / "run"), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    report = read_record(out)
    assert report["max_abs_logit_diff"] < 1e-4
    merged = AutoModelForCausalLM.from_pretrained(str(out))
    assert not any("lora" in n for n, _ in merged.named_parameters())
    again = subprocess.run(
        [sys.executable, "-m", "finetune", "merge-lora", str(tmp_path / "run"), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert again.returncode == 2 and "Traceback" not in again.stderr


@pytest.mark.slow
def test_configured_tracker_receives_the_training_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(
        tmp_path,
        job_text(tmp_path, "full", steps=3).replace("save_steps: 0}", "save_steps: 0, trackers: [tensorboard]}"),
    )
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]


@pytest.mark.slow
def test_full_disk_at_a_checkpoint_and_at_the_final_save_loses_nothing_and_resumes(tmp_path, monkeypatch):
    import errno

    import transformers

    from finetune import checkpoint

    text = job_text(tmp_path, "full", steps=6).replace("save_steps: 0", "save_steps: 2")
    real_save = torch.save
    calls = {"n": 0}

    def failing_torch_save(obj, f, *a, **k):  # how torch reports a full disk: a RuntimeError from its stream writer
        calls["n"] += str(f).endswith("scheduler.pt")
        if calls["n"] == 2 and str(f).endswith("scheduler.pt"):  # the second checkpoint's
            raise RuntimeError(
                "[enforce fail at inline_container.cc:626] . unexpected pos 1234 vs 1200: file write failed"
            )
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", failing_torch_save)
    with pytest.raises(
        FtError, match="checkpoint step 4.*partial checkpoint was removed.*intact \\(step-00000002\\).*--resume"
    ):
        train(tmp_path, text)
    monkeypatch.setattr(torch, "save", real_save)
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step-00000002"]

    def full_disk(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", full_disk)
    with pytest.raises(FtError, match="final weights.*the disk is full.*--resume"):
        train(tmp_path, text, resume=True)
    assert not (tmp_path / "run" / "final").exists() and not list((tmp_path / "run").glob(".tmp-*"))
    assert checkpoint.latest(tmp_path / "run").name == "step-00000004"
    monkeypatch.undo()
    train(tmp_path, text, resume=True)
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()
    assert [
        json.loads(line)["step"]
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if "loss" in line
    ] == list(range(1, 7))


@pytest.mark.slow
def test_secrets_from_the_environment_appear_nowhere_under_the_run_folder(tmp_path, monkeypatch):
    """A secret given through ${VAR} (a secret-named variable) is written back as ${VAR} wherever ft records the
    config."""
    secret = "s3cret-9f8e7d6c5b4a"
    monkeypatch.setenv("FT_TEST_RUN_SECRET", secret)
    text = job_text(tmp_path, "full", steps=2).replace(
        "log_steps: 1,", "log_steps: 1, run_name: '${FT_TEST_RUN_SECRET}',"
    )
    train(tmp_path, text)
    run = tmp_path / "run"
    assert (run / "README.md").exists() and (run / "config.yaml").exists()
    leaks = [p for p in run.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not leaks, leaks
    assert "${FT_TEST_RUN_SECRET}" in (run / "config.yaml").read_text()


def test_the_prepared_data_records_the_largest_share_of_a_rows_positions_trained(tmp_path):
    """The summary's most_trained_share bounds the share of trained positions in any row the loss sees: rounded up,
    over the samples, which a packed row (or a padding-free micro-batch of rows) cannot exceed."""
    from finetune.config import load
    from finetune.data.preprocess import prepare

    for packing in (False, True):
        text = job_text(tmp_path, "lora").replace(
            "  seq_len: 48\n", f"  seq_len: 48\n  packing: {str(packing).lower()}\n"
        )
        prepared = prepare(load(write_job(tmp_path, text)))
        shares = [sum(t != -100 for t in labels[1:]) / len(labels) for labels in prepared.train["labels"]]
        assert 0 < max(shares) <= prepared.summary["most_trained_share"] < 1
        if not packing:
            assert prepared.summary["most_trained_share"] - max(shares) < 1e-4


@pytest.mark.slow
def test_ft_plan_of_a_packed_runs_saved_config_gives_its_plan_sized_for_the_prepared_rows(tmp_path):
    """ft train plans for the prepared rows' trained share (the plain loss's logits of the trained positions of packed
    rows); ft plan of the run folder's config.yaml reads the share its data.json recorded and gives the same plan, while
    the job file alone (no data read) is planned for every position."""
    from finetune.plan.plan import Plan
    from finetune.workflow import compile_plan

    text = job_text(tmp_path, "full", steps=1).replace("  seq_len: 48\n", "  seq_len: 48\n  packing: true\n")
    train(tmp_path, text)
    run = tmp_path / "run"
    recorded = Plan.from_json(json.loads((run / "plan.json").read_text()))
    assert "of a row's positions (the largest share" in recorded.decision("loss_implementation").reason
    assert compile_plan(run / "config.yaml", hardware="cpu").to_json() == recorded.to_json()
    unread = compile_plan(tmp_path / "job.yaml", hardware="cpu")
    assert unread.estimate.device["logits and loss"] > recorded.estimate.device["logits and loss"]


@pytest.mark.slow
@pytest.mark.parametrize("added", ["config", "template"])
def test_a_job_whose_data_adds_tokens_is_planned_once_with_the_grown_embeddings(tmp_path, monkeypatch, added):
    """The tokens the data pipeline adds (data.add_special_tokens, or a built-in template's tokens that the tokenizer
    lacks), and the share of a row's positions trained, are known before planning: ft train plans once, and that plan
    (the one in plan.json, which the ranks run) trains the grown embeddings and sizes the plain loss's logits by the
    prepared rows' trained share. ft plan of the run folder's config.yaml gives the same plan from its data.json."""
    import finetune.plan
    from finetune.plan.plan import Plan
    from finetune.tiny import build_tokenizer
    from finetune.workflow import compile_plan

    planned, real = [], finetune.plan.plan
    monkeypatch.setattr(finetune.plan, "plan", lambda *a, **k: planned.append(real(*a, **k)) or planned[-1])
    text = job_text(tmp_path, "lora", steps=1).replace("  seq_len: 48\n", "  seq_len: 48\n  packing: true\n")
    if added == "config":
        text = text.replace("  seq_len: 48\n", "  seq_len: 48\n  add_special_tokens: [<t>]\n")
    else:  # a tokenizer without ChatML's tokens: the template adds <|im_start|> and <|im_end|>
        build_tokenizer(tmp_path / "bare", extra_special=())
        text = text.replace("{name: ft-tiny}", f"{{name: ft-tiny, tokenizer: {tmp_path / 'bare'}}}")
        text = text.replace("  seq_len: 48\n", "  seq_len: 48\n  template: chatml\n")
    train(tmp_path, text)
    run = tmp_path / "run"
    recorded = Plan.from_json(json.loads((run / "plan.json").read_text()))
    assert len(planned) == 1 and planned[0].train_embeddings and recorded == planned[0]
    assert "largest share of a prepared row" in recorded.decision("loss_implementation").reason
    assert compile_plan(run / "config.yaml", hardware="cpu").to_json() == recorded.to_json()
