"""`ft eval` and the evaluation during training: user functions, metrics against hand computation, loss, lm-eval."""

from __future__ import annotations

import json
import math
import re

import pytest

from finetune.errors import DataError, FtError
from finetune.infer.scoring import Metric, Scorer, parse
from finetune.userfn import load_function
from tests.helpers import crafted_run, evil_model

METRIC_FILE = """
def score(completions, reference, topic, **columns):
    return [float(len(c) % 2 == 0) + (0.5 if t == "sums" else 0.0) for c, t in zip(completions, topic)]

def wrong_length(completions, **columns):
    return [1.0]

def not_a_number(completions, **columns):
    return [1.0] * (len(completions) - 1) + ["high"]

def fails_on_seven(completions, reference, **columns):
    return [1.0 / (7 - int(r)) for r in reference]

CONSTANT = 3
"""


@pytest.fixture
def metric_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "metrics.py").write_text(METRIC_FILE)
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    return tmp_path / "metrics.py"


# ---------------------------------------------------------------- user functions
def test_load_function_from_a_file_or_a_module(metric_file):
    assert load_function("metrics.py:score", "k")(["ab"], reference=["x"], topic=["sums"]) == [1.5]
    assert load_function(f"{metric_file}:wrong_length", "k")(["a"]) == [1.0]
    assert load_function("metrics:score", "k") is not None  # a module next to the current folder
    assert load_function("json:dumps", "k") is json.dumps


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("metrics.py", "does not name a function"),
        ("metrics.py:", "does not name a function"),
        ("missing.py:score", "the file missing.py does not exist"),
        ("no_such_pkg.mod:score", "no module named 'no_such_pkg'"),
        ("metrics.py:nope", "has no attribute 'nope' (it defines: fails_on_seven, not_a_number, score, wrong_length)"),
        ("metrics.py:CONSTANT", "CONSTANT in metrics.py is a int, not a function"),
        ("broken.py:f", "importing broken.py failed with ModuleNotFoundError"),
        ("metrics.py:not-a-name", "is not a function name"),
    ],
)
def test_load_function_errors_name_the_key_the_spec_and_the_fix(metric_file, spec, needle):
    with pytest.raises(FtError) as err:
        load_function(spec, "method.rewards[0].function")
    text = str(err.value)
    assert text.startswith("method.rewards[0].function: ") and needle in text and "fix:" in text, text


# ---------------------------------------------------------------- metrics by hand
def test_built_in_metrics_agree_with_a_hand_count():
    completions = [" 42 ", "The answer is 42.", "41", "#### 7", "so 13 then 14"]
    references = ["42", "42", "42", "The total is #### 7", "14"]
    origins = [f"set.jsonl:{i + 1}" for i in range(5)]
    score = lambda m: Scorer(m)(completions, references, {}, origins)  # noqa: E731
    assert score(parse("exact_match", None)) == [1, 0, 0, 0, 0]
    assert score(parse("contains", None)) == [1, 1, 0, 0, 1]
    assert score(parse("regex", r"#### (\d+)")) == [0, 0, 0, 1, 0]  # the reference is extracted too
    assert score(parse("regex", r"(\d+)$")) == [0, 0, 0, 1, 1]  # " 42 " ends with a space: no match
    assert score(parse("regex", r"\d+")) == [1, 1, 0, 1, 0]  # no group: the whole first match


def test_metric_functions_get_columns_and_are_checked(metric_file):
    origins = ["s.jsonl:1", "s.jsonl:2", "s.jsonl:3"]
    cols = {"topic": ["sums", "words", "sums"]}
    fn = lambda name: Scorer(Metric("function", "--metric", function=f"metrics.py:{name}"))  # noqa: E731
    assert fn("score")(["ab", "abc", ""], ["1", "2", "3"], cols, origins) == [1.5, 0.0, 1.5]
    with pytest.raises(FtError, match="returned 1 scores for 3 completions"):
        fn("wrong_length")(["a", "b", "c"], [None] * 3, {}, origins)
    with pytest.raises(FtError, match=re.escape("gave 'high' for sample 2 (s.jsonl:3)")):
        fn("not_a_number")(["a", "b", "c"], [None] * 3, {}, origins)
    with pytest.raises(
        FtError, match=re.escape("metrics.py:fails_on_seven failed on sample 1 (s.jsonl:2): ZeroDivisionError")
    ):
        fn("fails_on_seven")(["a", "b", "c"], ["1", "7", "2"], {}, origins)
    with pytest.raises(DataError, match="s.jsonl:2: no reference answer for exact_match"):
        Scorer(parse("exact_match", None))(["a", "b"], ["a", None], {}, origins[:2])
    with pytest.raises(FtError, match="not a metric"):
        parse("exactmatch", None)
    with pytest.raises(FtError, match="--pattern '"):
        parse("regex", None)


def test_only_bounded_metrics_are_shown_as_percentages():
    """exact_match, contains and regex score the share of samples that match (0..1); a user function may return any
    number, so its mean (and a loss) is shown as it is, in ft eval's table as after training."""
    import io

    from rich.console import Console

    from finetune.infer.evaluation import EvalResult, print_table
    from finetune.infer.scoring import score_text

    assert [score_text(m, 0.25) for m in ("exact_match", "contains", "regex")] == ["25.00%"] * 3
    assert score_text("exact_match", 0.25, 1) == "25.0%"
    assert score_text("function", 12.5, 1) == score_text("metrics.py:score", 12.5) == "12.5000"
    out = io.StringIO()
    result = EvalResult(model="m", metrics={"exact_match": 0.5, "metrics.py:score": 1.25, "loss": 2.0})
    print_table(result, Console(file=out, width=200))
    table = out.getvalue()
    assert "50.00%" in table and "1.2500" in table and "2.0000" in table and "125" not in table


# ---------------------------------------------------------------- ft eval on a tiny model
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from finetune.tiny import build_model

    folder = tmp_path_factory.mktemp("tiny-model")
    build_model(folder)
    return folder


def test_ft_eval_metrics_and_loss_agree_with_a_hand_computation(model_dir, tmp_path, monkeypatch):
    from finetune.infer.commands import EvalOptions, GenerateOptions, run_eval, run_generate

    monkeypatch.chdir(tmp_path)
    (tmp_path / "metrics.py").write_text(METRIC_FILE)
    questions = [f"What is {i} + {i + 3}?" for i in range(8)]
    (tmp_path / "q.jsonl").write_text(
        "".join(json.dumps({"id": i, "prompt": q}) + "\n" for i, q in enumerate(questions))
    )
    run_generate(GenerateOptions(str(model_dir), "q.jsonl", "seen.jsonl", max_new_tokens=5, quiet=True))
    seen = [json.loads(line)["completion"] for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    answers = [c if i % 2 == 0 else c + "!" for i, c in enumerate(seen)]  # half match exactly
    topics = ["sums" if i < 3 else "words" for i in range(8)]
    (tmp_path / "set.jsonl").write_text(
        "".join(
            json.dumps(
                {"id": i, "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}], "topic": t}
            )
            + "\n"
            for i, (q, a, t) in enumerate(zip(questions, answers, topics))
        )
    )
    result = run_eval(
        EvalOptions(
            str(model_dir),
            data="set.jsonl",
            metrics=("exact_match", "contains", "metrics.py:score", "loss"),
            max_new_tokens=5,
            out="results.json",
            predictions="preds.jsonl",
            quiet=True,
            as_json=True,
        )
    )
    m = result.metrics
    assert m["exact_match"] == sum(c.strip() == a.strip() for c, a in zip(seen, answers)) / 8 == 0.5
    assert m["contains"] == sum(a.strip() in c.strip() for c, a in zip(seen, answers)) / 8
    assert m["metrics.py:score"] == pytest.approx(
        sum((len(c) % 2 == 0) + (0.5 if t == "sums" else 0) for c, t in zip(seen, topics)) / 8
    )
    assert m["loss"] == pytest.approx(_hand_loss(model_dir, questions, answers), rel=1e-5)
    assert m["perplexity"] == pytest.approx(math.exp(m["loss"]))
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["metrics"] == pytest.approx(m) and saved["samples"] == 8 and saved["generation"]["processes"] == 1
    assert [json.loads(line)["id"] for line in (tmp_path / "preds.jsonl").read_text().splitlines()] == list(range(8))


def _hand_loss(model_dir, questions, answers) -> float:
    """Token-mean cross-entropy over the tokens of each answer and its <|im_end|>, after the chat-formatted question."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    total, count = 0.0, 0
    for q, a in zip(questions, answers):
        user = [{"role": "user", "content": q}]
        head = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
        text = tok.apply_chat_template(user + [{"role": "assistant", "content": a}], tokenize=False)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        start, end = len(head), len(head) + len(a) + len("<|im_end|>")
        ids = enc["input_ids"]
        trained = [i for i, (s, e) in enumerate(enc["offset_mapping"]) if s < end and e > start and i > 0]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        total += float(
            torch.nn.functional.cross_entropy(
                logits[[i - 1 for i in trained]], torch.tensor([ids[i] for i in trained]), reduction="sum"
            )
        )
        count += len(trained)
    return total / count


def test_ft_eval_refuses_metrics_without_references(model_dir, tmp_path):
    from finetune.infer.commands import EvalOptions, run_eval

    (tmp_path / "q.jsonl").write_text(json.dumps({"prompt": "Hi"}) + "\n")
    with pytest.raises(FtError, match=r"q.jsonl:1: exact_match needs a reference answer"):
        run_eval(EvalOptions(str(model_dir), data=str(tmp_path / "q.jsonl"), quiet=True))
    with pytest.raises(FtError, match="no data to evaluate on"):
        run_eval(EvalOptions(str(model_dir), quiet=True))


# ---------------------------------------------------------------- during training, and again with ft eval
@pytest.mark.slow
def test_periodic_evaluation_during_training_and_ft_eval_of_the_run_agree(tmp_path, monkeypatch, capfd):
    from finetune.infer.commands import EvalOptions, run_eval
    from finetune.tiny import arithmetic_records, write_jsonl
    from finetune.workflow import run_train

    monkeypatch.chdir(tmp_path)
    (tmp_path / "metrics.py").write_text(
        "def digits(completions, **columns):\n    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c "
        "in completions]\n"
    )
    data = write_jsonl(arithmetic_records(64, seed=3), tmp_path / "train.jsonl")
    test = write_jsonl(arithmetic_records(12, seed=4), tmp_path / "test.jsonl")
    (tmp_path / "job.yaml").write_text(f"""
model: {{name: ft-tiny}}
data: {{datasets: [{{path: {data}, format: chat}}], seq_len: 48, cache_dir: {tmp_path / "cache"}}}
adapter: {{type: full}}
train: {{global_batch_size: 8, micro_batch_size: 8, max_steps: 4, lr: 3.0e-3}}
output: {{dir: {tmp_path / "run"}, log_steps: 1, save_steps: 0}}
evaluation: {{path: {test}, metric: function, function: metrics.py:digits, max_new_tokens: 6, every_steps: 2}}
""")
    result = run_train(tmp_path / "job.yaml", hardware="cpu")
    printed = " ".join(capfd.readouterr().err.split())  # a function's score is a plain number, not a percentage
    assert f": {result['task_before']:.4f} → {result['task_after']:.4f}" in printed, printed[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_function" in r] == [2]
    assert result["task_before"] is not None and result["task_after"] is not None
    again = run_eval(EvalOptions(str(tmp_path / "run"), quiet=True, as_json=True))
    assert again.metrics == {"metrics.py:digits": pytest.approx(result["task_after"], abs=1e-9)}


# ---------------------------------------------------------------- lm-evaluation-harness
@pytest.mark.slow
@pytest.mark.skipif(
    not __import__("importlib").util.find_spec("lm_eval"),
    reason="lm-eval is an optional extra (pip install 'finetune[lm-eval]')",
)
def test_lm_eval_runs_a_local_task_offline(model_dir, tmp_path):
    from finetune.infer.commands import EvalOptions, run_eval

    (tmp_path / "qa.jsonl").write_text(
        "".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(4))
    )
    (tmp_path / "ft_tiny_qa.yaml").write_text(f"""task: ft_tiny_qa
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / "qa.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["<|im_end|>"], max_gen_toks: 4, do_sample: false}}
metric_list: [{{metric: exact_match, aggregation: mean, higher_is_better: true}}]
""")
    result = run_eval(
        EvalOptions(str(model_dir), lm_eval=("ft_tiny_qa",), lm_eval_include=str(tmp_path), quiet=True, as_json=True)
    )
    assert set(result.lm_eval) == {"ft_tiny_qa"} and 0.0 <= result.lm_eval["ft_tiny_qa"]["exact_match"] <= 1.0
    with pytest.raises(FtError, match="unknown task no_such_task"):
        run_eval(EvalOptions(str(model_dir), lm_eval=("no_such_task",), lm_eval_include=str(tmp_path), quiet=True))


# ---------------------------------------------------------------- code in a run folder runs only when asked
def _adapter_run(model_dir, root, marker):
    """A LoRA run folder: final/ is a peft adapter; config.yaml names an evil base model and turns trust_remote_code
    on."""
    import yaml
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = evil_model(model_dir, root / "evil-base", marker)
    run = root / "lora-run"
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    )
    peft_model.peft_config["default"].base_model_name_or_path = str(base)  # trained on it, as config.yaml says
    peft_model.save_pretrained(str(run / "final"))
    (run / "config.yaml").write_text(
        yaml.safe_dump({"model": {"name": str(base), "trust_remote_code": True}, "adapter": {"type": "lora"}})
    )
    return run


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_ft_eval_of_a_crafted_run_folder_runs_none_of_its_code(model_dir, tmp_path, monkeypatch, kind):
    import sys

    import transformers.dynamic_module_utils as dynamic

    from finetune.infer.commands import EvalOptions, run_eval

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    marker = tmp_path / "MARKER"
    run = crafted_run(model_dir, tmp_path, marker) if kind == "full" else _adapter_run(model_dir, tmp_path, marker)
    data = tmp_path / "set.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]}) + "\n"
    )
    result = run_eval(EvalOptions(str(run), data=str(data), metrics=("loss",), quiet=True, as_json=True))
    assert math.isfinite(result.metrics["loss"])
    assert not marker.exists(), f"ft eval ran code from the {kind} run folder without --trust-remote-code"
