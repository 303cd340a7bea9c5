"""`ft preprocess` end to end on the tiny tokenizer: formats mixed, masks, lengths, packing, cache, errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from finetune.config import loads
from finetune.data.masking import IGNORE
from finetune.errors import DataError
from finetune.tiny import arithmetic_records, write_jsonl
from tests.helpers import REPO, JobText


def job(tmp_path, datasets: str, **data) -> str:
    extra = "".join(f"\n  {k}: {json.dumps(v)}" for k, v in data.items())
    return JobText(f"""
model: {{name: ft-tiny}}
data:
  datasets: {datasets}
  seq_len: 64
  cache_dir: {tmp_path / "cache"}{extra}
output: {{dir: {tmp_path / "run"}}}
""")


def prepare(text: str, **kw):
    from finetune.data.preprocess import prepare as run

    return run(loads(text), **kw)


@pytest.fixture
def arithmetic(tmp_path):
    return write_jsonl(arithmetic_records(200, seed=3), tmp_path / "arith.jsonl")


def test_chat_labels_are_the_answers_and_their_terminator(tmp_path, arithmetic):
    p = prepare(job(tmp_path, f"[{{path: {arithmetic}, format: chat}}]"))
    assert p.summary["records_read"] == 200 and p.summary["train_samples"] == 200
    tok = p.tokenizer
    for row in p.train.select(range(20)):
        trained = [t for i, (t, lab) in enumerate(zip(row["input_ids"], row["labels"])) if lab != IGNORE and i > 0]
        text = tok.decode(trained)
        assert text.rstrip("\n").endswith("<|im_end|>")
        assert "user" not in text and "What is" not in text
        assert text.split("<|im_end|>")[0].lstrip("-").isdigit()


def test_cache_is_reused_and_invalidated_by_what_changes_the_data(tmp_path, arithmetic, monkeypatch):
    text = job(tmp_path, f"[{{path: {arithmetic}, format: chat}}]")
    first = prepare(text)
    import finetune.data.preprocess as pre

    monkeypatch.setattr(pre, "build", lambda *a, **k: pytest.fail("rebuilt a matching cache entry"))
    assert prepare(text).path == first.path
    # output dir is not an input
    assert prepare(text.replace("/run}", "/run2}")).path == first.path
    monkeypatch.undo()
    assert prepare(text.replace("seq_len: 64", "seq_len: 80")).path != first.path
    assert prepare(job(tmp_path, f"[{{path: {arithmetic}, format: chat}}]", train_on="all")).path != first.path
    write_jsonl(arithmetic_records(200, seed=4), arithmetic)  # same file, new content
    assert prepare(text).path != first.path


def test_mixed_formats_weights_and_validation(tmp_path):
    # distinct records only: two generated records with the same text may legitimately fall on both sides
    records = list({json.dumps(r): r for r in arithmetic_records(260, seed=3)}.values())[:200]
    arithmetic = write_jsonl(records, tmp_path / "arith.jsonl")
    alpaca = write_jsonl(
        [{"instruction": f"Repeat {i}", "input": "", "output": f"{i}"} for i in range(50)], tmp_path / "alpaca.jsonl"
    )
    text = job(
        tmp_path,
        f"[{{path: {arithmetic}, format: chat, weight: 0.5}}, {{path: {alpaca}, format: instruction, samples: 80}}]",
        validation=0.1,
    )
    p = prepare(text)
    assert p.summary["records_sampled"] == 100 + 80
    # records repeated by samples: 80 stay on one side of the split: no validation row is in training
    assert 170 <= len(p.train) + len(p.validation) <= 180 and 12 <= len(p.validation) <= 18
    assert not {tuple(r) for r in p.validation["input_ids"]} & {tuple(r) for r in p.train["input_ids"]}
    again = prepare(text, force=True)
    assert again.train["input_ids"] == p.train["input_ids"]  # same seed, same data


def test_overlong_samples_are_truncated_or_dropped_and_counted(tmp_path):
    long = write_jsonl(
        [
            {"messages": [{"role": "user", "content": "word " * n}, {"role": "assistant", "content": "ok"}]}
            for n in (5, 10, 200)
        ],
        tmp_path / "long.jsonl",
    )
    dropped = prepare(job(tmp_path, f"[{{path: {long}, format: chat}}]", overlong="drop"))
    assert dropped.summary["dropped_too_long"] == 1 and dropped.summary["train_samples"] == 2
    cut = prepare(job(tmp_path, f"[{{path: {long}, format: chat}}]", overlong="truncate"))
    # the long prompt is cut before the answer: nothing left to train, so it is dropped and counted
    assert cut.summary["dropped_nothing_to_train"] == 1
    assert max(len(r) for r in cut.train["input_ids"]) <= 64


def test_packing_keeps_samples_whole_and_reports_efficiency(tmp_path, arithmetic):
    p = prepare(job(tmp_path, f"[{{path: {arithmetic}, format: chat}}]", packing=True))
    s = p.summary
    assert s["packed_rows"] == len(p.train) < 200
    assert s["packing_efficiency"] > s["padding_efficiency"]
    for row in p.train:
        assert len(row["input_ids"]) == sum(row["seq_lens"]) <= 64
        starts = [sum(row["seq_lens"][:i]) for i in range(len(row["seq_lens"]))]
        assert all(row["position_ids"][s0] == 0 for s0 in starts)
    assert sum(sum(r) for r in p.train["seq_lens"]) == s["tokens_per_epoch"]


def test_preference_and_prompt_only(tmp_path):
    pref = write_jsonl([{"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"}] * 5, tmp_path / "pref.jsonl")
    text = job(tmp_path, f"[{{path: {pref}, format: preference}}]").replace("output:", "method: {name: dpo}\noutput:")
    p = prepare(text)
    row = p.train[0]
    chosen = p.tokenizer.decode(
        [t for i, (t, lab) in enumerate(zip(row["chosen_input_ids"], row["chosen_labels"])) if lab != IGNORE and i > 0]
    )
    assert chosen.startswith("2") and "<|im_end|>" in chosen and "What" not in chosen
    prompts = write_jsonl([{"question": "What is 2 + 2?", "answer": "4"}] * 3, tmp_path / "q.jsonl")
    grpo = job(tmp_path, f"[{{path: {prompts}, format: prompt_only, columns: {{prompt: question}}}}]").replace(
        "output:",
        "method: {name: grpo, max_new_tokens: 16, rewards: [{function: exact_match}], num_generations: "
        "2}\ntrain: {global_batch_size: 4}\noutput:",
    )
    g = prepare(grpo)
    assert json.loads(g.train[0]["extra"]) == {"answer": "4"}
    assert p.tokenizer.decode(g.train[0]["prompt_ids"]).endswith("<|im_start|>assistant\n")


def test_bad_record_names_file_and_line_and_leaves_no_cache_entry(tmp_path, arithmetic):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{"messages": '
        '[{"role": "wizard", "content": "x"}]}\n'
    )
    text = job(tmp_path, f"[{{path: {arithmetic}, format: chat}}, {{path: {bad}, format: chat}}]")
    with pytest.raises(DataError, match=r"bad.jsonl:2"):
        prepare(text)
    cache = tmp_path / "cache"
    assert not any((d / "summary.json").exists() for d in cache.iterdir() if d.is_dir()) if cache.exists() else True
    skipped = prepare(
        job(tmp_path, f"[{{path: {arithmetic}, format: chat}}, {{path: {bad}, format: chat}}]", skip_bad_records=True)
    )
    assert skipped.summary["skipped_bad_records"] == 1 and skipped.summary["train_samples"] == 201


def test_nothing_left_is_an_error(tmp_path):
    long = write_jsonl(
        [{"messages": [{"role": "user", "content": "word " * 100}, {"role": "assistant", "content": "ok"}]}],
        tmp_path / "long.jsonl",
    )
    with pytest.raises(DataError, match="no training examples left"):
        prepare(job(tmp_path, f"[{{path: {long}, format: chat}}]", overlong="drop"))


@pytest.mark.slow
def test_cli_preprocess_summary_and_preview(tmp_path, arithmetic):
    path = tmp_path / "job.yaml"
    path.write_text(job(tmp_path, f"[{{path: {arithmetic}, format: chat}}]", packing=True))
    r = subprocess.run(
        [sys.executable, "-m", "finetune", "preprocess", str(path), "--preview", "2"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    for needle in (
        "Prepared data",
        "records read",
        "packing efficiency",
        "tokens per epoch",
        "sample 1:",
        "sample 2:",
        "trained (highlighted)",
    ):
        assert needle in r.stdout, r.stdout
    assert "sample 3:" not in r.stdout


@pytest.mark.parametrize(
    "override",
    [
        "data.template=qwen",
        "data.seed=7",
        "data.packing=true",
        "data.overlong=drop",
        "data.add_special_tokens=[<tool>]",
        "data.datasets.0.columns={messages: messages}",
        "data.datasets.0.system_prompt=Be brief.",
        "data.validation=0.1",
    ],
)
def test_every_input_of_the_data_changes_the_fingerprint(tmp_path, arithmetic, override):
    from finetune.data.preprocess import prepare as run

    text = job(tmp_path, f"[{{path: {arithmetic}, format: chat}}]")
    base = run(loads(text))
    assert run(loads(text, overrides=[override])).path != base.path
    assert run(loads(text, overrides=["data.num_proc=2"])).path == base.path  # speed, not content


def test_added_special_tokens_are_reported(tmp_path, arithmetic):
    p = prepare(job(tmp_path, f"[{{path: {arithmetic}, format: chat}}]", add_special_tokens=["<tool>", "<|im_end|>"]))
    assert p.added_tokens == ("<tool>",) and p.summary["added_tokens"] == ["<tool>"]
    assert len(p.tokenizer("<tool>", add_special_tokens=False)["input_ids"]) == 1


def test_validation_from_its_own_dataset(tmp_path, arithmetic):
    held = write_jsonl(arithmetic_records(30, seed=9), tmp_path / "held.jsonl")
    p = prepare(
        job(tmp_path, f"[{{path: {arithmetic}, format: chat}}]").replace(
            "  datasets:", f"  validation: {{path: {held}, format: chat}}\n  datasets:"
        )
    )
    assert len(p.validation) == 30 and len(p.train) == 200


def test_template_rejecting_a_conversation_names_the_record(tmp_path):
    twice = write_jsonl(
        [
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "user", "content": "again"},
                    {"role": "assistant", "content": "b"},
                ]
            },
        ],
        tmp_path / "t.jsonl",
    )
    with pytest.raises(DataError, match=r"t.jsonl:2"):
        prepare(job(tmp_path, f"[{{path: {twice}, format: chat}}]", template="mistral"))


@pytest.mark.slow
def test_concurrent_preprocess_builds_once(tmp_path, arithmetic):
    path = tmp_path / "job.yaml"
    path.write_text(job(tmp_path, f"[{{path: {arithmetic}, format: chat}}]"))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "finetune", "preprocess", str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert sum("built data" in o for o in outs) == 1 and sum("reused cached data" in o for o in outs) == 1
