"""What `ft train` shows while it trains: plain step lines where the output is a log (finetune/progress.py), the
method's own metrics in them and in loss.png, and the third-party messages kept off the console (finetune/quiet.py)."""

from __future__ import annotations

import logging
import re
import warnings

import pytest

from finetune.config.methods import DPOMethod, GRPOMethod, KTOMethod, ORPOMethod, RewardMethod, SFTMethod, SimPOMethod
from finetune.metrics import MetricsWriter, plot_losses
from finetune.progress import StepLines, step_line
from finetune.quiet import DEEPSPEED_CPU, DEEPSPEED_LOGGER, only_new_score_head, quiet_libraries
from tests.helpers import REPO, ft_train

ROW = {"loss": 1.23454, "lr": 2e-4, "tokens": 800, "tokens_per_s": 999.0, "memory_gib": 3.21, "grad_norm": 0.5}
GRPO_ROW = {
    **ROW,
    "reward": 0.5,
    "reward_std": 0.1,
    "rewards/exact_match": 0.25,
    "rewards/digits_right": 0.75,
    "kl": 0.00123,
    "completion_length": 7.5,
    "clip_fraction": 0.0,
}
PREFERENCE_ROW = {
    **ROW,
    "rewards/chosen": 0.2,
    "rewards/rejected": -0.1,
    "rewards/margin": 0.3,
    "rewards/accuracy": 0.75,
}


def test_a_step_line_has_the_fixed_fields_in_a_stable_format():
    line = step_line(20, 200, ROW, SFTMethod.progress_metrics, tokens_per_s=12345.4, eta_s=250)
    assert line == "step 20/200 loss 1.2345 lr 2.00e-04 tok/s 12,345 mem 3.2 GiB eta 0:04:10"
    assert step_line(1, 9, {"loss": 2.0}) == "step 1/9 loss 2.0000"  # what a step did not report is left out


def test_a_grpo_line_shows_the_reward_per_function_kl_and_completion_length():
    line = step_line(3, 40, GRPO_ROW, GRPOMethod.progress_metrics, eta_s=10)
    assert line.endswith(
        "eta 0:00:10 reward 0.5 rewards/exact_match 0.25 rewards/digits_right 0.75 kl 0.00123 completion_length 7.5"
    )
    assert "reward_std" not in line and "clip_fraction" not in line and "grad_norm" not in line


@pytest.mark.parametrize("section", [DPOMethod, ORPOMethod, SimPOMethod, KTOMethod, RewardMethod])
def test_a_preference_line_shows_margin_and_accuracy(section):
    line = step_line(3, 40, PREFERENCE_ROW, section.progress_metrics)
    assert line.endswith("rewards/margin 0.3 rewards/accuracy 0.75") and "rewards/chosen" not in line
    assert "rewards/accuracy" not in step_line(3, 40, {**ROW, "rewards/margin": 0.3}, section.progress_metrics)


def test_lines_every_log_steps_at_the_last_step_and_when_steps_are_slow():
    now = [0.0]
    lines: list[str] = []
    report = StepLines(log_steps=3, write=lines.append, clock=lambda: now[0], heartbeat=30)
    for step in range(1, 8):
        now[0] += 2.0
        report(step, 7, ROW)
    assert [line.split()[1] for line in lines] == ["3/7", "6/7", "7/7"]
    assert "tok/s 400 " in lines[0] and "eta 0:00:08" in lines[0]  # 2,400 tokens in 6 s; 4 steps of 2 s left
    lines.clear()
    slow = StepLines(log_steps=100, write=lines.append, clock=lambda: now[0], heartbeat=30)
    for step in range(11, 14):  # a resumed run: the ETA counts only the steps this process trained
        now[0] += 40.0
        slow(step, 20, ROW)
    assert [line.split()[1] for line in lines] == ["11/20", "12/20", "13/20"] and "eta 0:04:40" in lines[-1]


@pytest.mark.slow
def test_loss_png_shows_the_reward_of_grpo_and_the_margin_of_preference_methods(tmp_path):
    with MetricsWriter(tmp_path / "grpo.jsonl") as m:
        for step in (1, 2, 3):
            m.log(step, **{k: v for k, v in GRPO_ROW.items() if k != "loss"})
    assert plot_losses(tmp_path / "grpo.jsonl", tmp_path / "grpo.png") is None  # nothing it is told to show
    out = plot_losses(tmp_path / "grpo.jsonl", tmp_path / "grpo.png", GRPOMethod.progress_metrics)
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with MetricsWriter(tmp_path / "dpo.jsonl") as m:
        for step in (1, 2, 3):
            m.log(step, **PREFERENCE_ROW)
    small = plot_losses(tmp_path / "dpo.jsonl", tmp_path / "sft.png").stat().st_size
    both = plot_losses(tmp_path / "dpo.jsonl", tmp_path / "dpo.png", DPOMethod.progress_metrics).stat().st_size
    assert both > small  # a second panel


REPORT = (
    "\x1b[1mLlamaForSequenceClassification LOAD REPORT\x1b[0m from: /models/tiny\n"
    "Key          | Status  | \n-------------+---------+-\nscore.weight | \x1b[31mMISSING\x1b[0m | \n\n"
    "Notes:\n- MISSING:\tthose params were newly initialized because missing from the checkpoint."
)


def test_only_a_report_of_a_new_score_head_is_dropped():
    assert only_new_score_head(REPORT)
    other = REPORT.replace("score.weight | ", "score.weight | MISSING |\nmodel.norm.weight | ", 1)
    assert not only_new_score_head(other)  # another missing parameter is a real problem: shown
    assert not only_new_score_head(REPORT.replace("MISSING", "MISMATCH"))
    assert not only_new_score_head("score.weight | MISSING |")  # not a load report


def test_quiet_libraries_drops_exactly_the_named_messages():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_libraries()
        quiet_libraries()  # twice changes nothing
        warnings.warn(
            "`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning, stacklevel=1
        )
        warnings.warn("the user's own deprecation", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["the user's own deprecation"]
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    record = logger.makeRecord(DEEPSPEED_LOGGER, logging.WARNING, __file__, 1, f"{DEEPSPEED_CPU}. If ...", (), None)
    kept = logger.makeRecord(DEEPSPEED_LOGGER, logging.WARNING, __file__, 1, "NCCL timeout", (), None)
    assert not logger.filter(record) and logger.filter(kept)
    assert sum(type(f).__name__ == "DropMessages" for f in logger.filters) == 1


LINE = re.compile(
    r"step (\d+)/4 loss \d+\.\d{4} lr \d\.\d\de[-+]\d\d tok/s [\d,]+ mem \d+\.\d GiB eta \d+:\d\d:\d\d"
    r" rewards/margin \S+ rewards/accuracy \S+"
)
SILENCED = ("is_gradient_checkpointing", DEEPSPEED_CPU, "LOAD REPORT", "kernels-community", "Loading weights")


@pytest.fixture(scope="module")
def piped_run(tmp_path_factory):
    """One tiny reward-model run with LoRA and a checkpoint (what loads a new score head, wraps with peft and saves),
    its stdout and stderr pipes, from a fresh home: ft first builds and saves ft-tiny there (transformers' "Writing
    model shards" bar). (home, the finished process)."""
    tmp_path = tmp_path_factory.mktemp("piped")
    home = tmp_path / "home"
    home.mkdir()
    r = ft_train(
        str(REPO / "examples/yaml/tiny-reward.yaml"),
        "--hardware",
        "cpu",
        *("--set", f"output.dir={tmp_path / 'run'}", "--set", f"data.cache_dir={tmp_path / 'cache'}"),
        *("--set", "train.max_steps=4", "--set", "train.global_batch_size=8", "--set", "train.warmup_steps=1"),
        *("--set", "output.log_steps=2", "--set", "output.save_steps=2", "--set", "output.eval_steps=0"),
        env={"HOME": str(home), "BASE_MODEL": "ft-tiny"},  # the example's own base, built in the fresh home
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return home, r


@pytest.mark.slow
def test_piped_output_has_a_step_line_per_log_steps_and_no_library_noise(piped_run):
    _, r = piped_run
    steps = [int(m.group(1)) for m in map(LINE.fullmatch, r.stdout.splitlines()) if m]
    assert steps == [2, 4], r.stdout
    everything = r.stdout + r.stderr
    assert not [s for s in SILENCED if s in everything], everything


def test_quiet_tensor_parallel_drops_only_torch_notices_of_the_split_layers():
    from finetune.quiet import REDISTRIBUTE_LOGGER, REDISTRIBUTE_NOTE, quiet_tensor_parallel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_tensor_parallel()
        warnings.warn(
            "FSDP2-wrapped module (FSDPQwen2DecoderLayer) returned a view tensor. An in-place op",
            UserWarning,
            stacklevel=1,
        )
        warnings.warn(
            "FSDP2-wrapped module (FSDPMyBlock) returned a view tensor. An in-place op", UserWarning, stacklevel=1
        )
    assert [str(w.message)[:40] for w in caught] == ["FSDP2-wrapped module (FSDPMyBlock) retur"]
    logger = logging.getLogger(REDISTRIBUTE_LOGGER)
    note = logger.makeRecord(
        REDISTRIBUTE_LOGGER, logging.WARNING, __file__, 1, f"{REDISTRIBUTE_NOTE} (x) to (y)", (), None
    )
    other = logger.makeRecord(REDISTRIBUTE_LOGGER, logging.WARNING, __file__, 1, "a real problem", (), None)
    assert not logger.filter(note) and logger.filter(other)


@pytest.mark.slow
def test_a_log_gets_no_progress_bars_even_when_ft_builds_its_tiny_model(piped_run):
    """A fresh home: ft builds and saves ft-tiny before training (transformers' "Writing model shards" bar), then
    trains and saves; with stdout and stderr going to pipes, no bar and no carriage return reaches them."""
    home, r = piped_run
    assert any((home / ".cache" / "ft" / "models").iterdir())  # the model was built in this run
    everything = r.stdout + r.stderr
    assert "\r" not in everything and "it/s]" not in everything, everything
