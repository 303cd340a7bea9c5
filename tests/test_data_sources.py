"""Reading sources (file types, globs, folders, origins, bad records) and take / mix / split_validation."""

from __future__ import annotations

import json
from collections import Counter

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from finetune.data.formats import normalize_dataset
from finetune.data.sources import SourceStats, load_source, looks_like_hub_id, mix, split_validation, take
from finetune.errors import DataError
from tests.helpers import spec

datasets.disable_progress_bars()


def write_jsonl(path, records) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def numbered(n: int, start: int = 0) -> list[dict]:
    return [{"text": f"record {i}"} for i in range(start, start + n)]


# ---------------------------------------------------------------- file types and origins
def test_jsonl_records_carry_their_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b", "extra": 1}\n')
    ds, stats = load_source(spec(path, "completion"))
    assert ds["text"] == ["a", "b"]
    assert ds["extra"] == [None, 1]  # columns are the union over records
    assert ds["_origin"] == [f"{path}:1", f"{path}:3"]
    assert stats == SourceStats(str(path), 2, 0, (), (str(path),))


def test_json_list_gives_line_numbers(tmp_path):
    path = tmp_path / "train.json"
    path.write_text('[\n  {"text": "a"},\n  {"text": "b",\n   "n": 2}\n]\n')
    ds, _ = load_source(spec(path, "completion"))
    assert ds["text"] == ["a", "b"]
    assert ds["_origin"] == [f"{path}:2", f"{path}:3"]


def test_json_file_may_hold_json_lines(tmp_path):
    path = tmp_path / "train.json"
    path.write_text('{"text": "a"}\n{"text": "b"}\n')
    assert load_source(spec(path, "completion"))[0]["_origin"] == [f"{path}:1", f"{path}:2"]


def test_broken_json_list_names_the_line(tmp_path):
    path = tmp_path / "train.json"
    path.write_text('[\n  {"text": "a"},\n  {"text": "b" "c"}\n]\n')
    with pytest.raises(DataError, match=rf"{path}:3: not valid JSON \(Expecting ',' delimiter at column 16\)"):
        load_source(spec(path, "completion"), skip_bad_records=True)


def test_csv_values_are_strings_with_row_origins(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text('prompt,answer\nWhat is 1+1?,2\n"two\nlines",4\n')
    ds, _ = load_source(spec(path, "prompt_only"))
    assert ds["prompt"] == ["What is 1+1?", "two\nlines"]
    assert ds["answer"] == ["2", "4"]
    assert ds["_origin"] == [f"{path}:row 1", f"{path}:row 2"]


def test_csv_row_with_wrong_column_count(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("prompt,answer\na,1\nb,2,3\nc,3\n")
    with pytest.raises(DataError, match=r"train.csv:row 2: 3 values, but the header names 2 columns"):
        load_source(spec(path, "prompt_only"))
    ds, stats = load_source(spec(path, "prompt_only"), skip_bad_records=True)
    assert ds["prompt"] == ["a", "c"] and stats.records_skipped == 1


def test_parquet(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["p1", "p2"], "completion": ["c1", "c2"]}), path)
    ds, stats = load_source(spec(path, "prompt_completion"))
    assert ds["completion"] == ["c1", "c2"]
    assert ds["_origin"] == [f"{path}:row 1", f"{path}:row 2"]
    assert stats.records_read == 2


def test_txt_is_one_record_per_line(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("first line\n\nsecond line\r\n")
    ds, _ = load_source(spec(path, "completion"))
    assert ds["text"] == ["first line", "second line"]
    assert ds["_origin"] == [f"{path}:1", f"{path}:3"]


def test_glob_reads_matching_files_sorted(tmp_path):
    b = write_jsonl(tmp_path / "data" / "b.jsonl", numbered(1, 10))
    a = write_jsonl(tmp_path / "data" / "a.jsonl", numbered(2))
    (tmp_path / "data" / "notes.md").write_text("not data")
    ds, stats = load_source(spec(tmp_path / "data" / "*", "completion"))
    assert ds["_origin"] == [f"{a}:1", f"{a}:2", f"{b}:1"]
    assert stats.files == (a, b) and stats.records_read == 3


def test_folder_reads_supported_files_recursively(tmp_path):
    root = tmp_path / "data"
    write_jsonl(root / "x" / "one.jsonl", numbered(1))
    (root / "two.txt").write_text("hello\n")
    write_jsonl(root / ".hidden" / "skip.jsonl", numbered(5))
    (root / "README.md").write_text("ignored")
    ds, stats = load_source(spec(root, "completion"))
    assert sorted(ds["text"]) == ["hello", "record 0"]
    # sorted by path: data/two.txt < data/x/...
    assert [f.rsplit("/", 1)[-1] for f in stats.files] == [
        "two.txt",
        "one.jsonl",
    ]


def test_glob_without_matches(tmp_path):
    with pytest.raises(DataError, match=r"no .* files match this pattern"):
        load_source(spec(tmp_path / "*.jsonl"))


def test_mixed_value_types_are_kept(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": "two"}])
    ds, _ = load_source(spec(path, "prompt_only"))
    assert ds["answer"] == [1, "two"]


# ---------------------------------------------------------------- bad input
def test_bad_json_line_names_file_line_and_fix(tmp_path):
    path = tmp_path / "data" / "train.jsonl"
    write_jsonl(path, numbered(16))
    with path.open("a") as f:
        f.write('{"text": "x" "oops": 1}\n{"text": "y"}\n')
    with pytest.raises(DataError) as e:
        load_source(spec(path, "completion"))
    assert str(e.value).startswith(f"{path}:17: not valid JSON (Expecting ',' delimiter at column 14)")
    assert "data.skip_bad_records: true" in str(e.value)


def test_skip_bad_records_counts_them(tmp_path):
    path = tmp_path / "train.jsonl"
    lines = ['{"text": "ok"}'] + ["{bad"] * 6 + ["[1, 2]", '{"text": "ok2"}']
    path.write_text("\n".join(lines) + "\n")
    ds, stats = load_source(spec(path, "completion"), skip_bad_records=True)
    assert ds["text"] == ["ok", "ok2"]
    assert (stats.records_read, stats.records_skipped) == (2, 7)
    assert len(stats.skipped_examples) == 5
    assert stats.skipped_examples[0].startswith(f"{path}:2: not valid JSON")


def test_record_that_is_not_an_object(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "a"}\n["a", "list"]\n')
    with pytest.raises(DataError, match=r"train.jsonl:2: a record must be a JSON object .*got a list"):
        load_source(spec(path, "completion"))


def test_non_utf8_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    with pytest.raises(DataError, match=r"train.jsonl:2: not UTF-8 text"):
        load_source(spec(path, "completion"))


def test_non_utf8_csv_names_the_line(tmp_path):
    path = tmp_path / "train.csv"
    path.write_bytes(b"prompt,answer\na,1\nb\xff,2\n")
    with pytest.raises(DataError, match=r"train.csv:3: not UTF-8 text\n    fix: save the file as UTF-8"):
        load_source(spec(path, "prompt_only"))


def test_empty_file_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DataError, match=rf"{path}: the file holds no records"):
        load_source(spec(path, "completion"))


def test_empty_file_inside_a_glob_is_named(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", numbered(2))
    (tmp_path / "b.jsonl").write_text("")
    with pytest.raises(DataError, match=r"b.jsonl: the file holds no records"):
        load_source(spec(tmp_path / "*.jsonl", "completion"))


def test_source_with_only_bad_records(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("{\n{\n")
    with pytest.raises(DataError, match=r"bad.jsonl: no usable records: all 2 were bad; first: .*bad.jsonl:1"):
        load_source(spec(path, "completion"), skip_bad_records=True)


def test_missing_file_says_the_path(tmp_path):
    with pytest.raises(DataError, match=r"data file not found: .*nope.jsonl"):
        load_source(spec(tmp_path / "nope.jsonl"))


def test_unsupported_file_type(tmp_path):
    path = tmp_path / "data.xlsx"
    path.write_text("x")
    with pytest.raises(DataError, match=r"unsupported file type '.xlsx'"):
        load_source(spec(path))


def test_a_string_that_reads_as_json_stays_a_string_beside_a_number(tmp_path):
    """One number among strings must not retype the column: "1" stays "1" (the bad record alone is bad)."""
    records = [{"prompt": f"q{i}", "completion": str(i)} for i in range(40)]
    records[30]["completion"] = 5
    ds, _ = load_source(spec(write_jsonl(tmp_path / "t.jsonl", records), "prompt_completion"))
    assert ds["completion"][:3] == ["0", "1", "2"] and ds["completion"][30] == 5
    with pytest.raises(DataError, match=r"t.jsonl:31: 'completion' must be text, got a number"):
        normalize_dataset(ds, spec(tmp_path / "t.jsonl", "prompt_completion"))
    out, skipped = normalize_dataset(ds, spec(tmp_path / "t.jsonl", "prompt_completion"), skip_bad_records=True)
    assert skipped == 1 and out["completion"][:3] == ["0", "1", "2"]


def test_csv_quoting_errors_name_the_row_start(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text('prompt,answer\nq1,a1\nq2,"a2\nq3,a3\n')
    with pytest.raises(
        DataError,
        match=r"t.csv:3: not valid CSV \(unexpected end of data; the row that starts on this line runs to line 4\)",
    ):
        load_source(spec(path, "prompt_only"))


def test_check_paths_names_the_key_and_the_path(tmp_path):
    from finetune.config import loads
    from finetune.data.sources import check_paths

    good = write_jsonl(tmp_path / "good.jsonl", numbered(2))
    config = loads(f"""
model: {{name: ft-tiny}}
data:
  datasets: [{{path: {good}, format: completion}}, {{path: {tmp_path / "missing.jsonl"}, format: completion}},
    {{path: org/name, format: chat}}]
  validation: {{path: {tmp_path / "nothing-*.jsonl"}, format: completion}}
output: {{dir: {tmp_path / "run"}}}
""")
    problems = check_paths(config)
    assert len(problems) == 2
    assert problems[0].startswith(f"data.datasets[1].path: data file not found: {tmp_path / 'missing.jsonl'}")
    assert problems[1].startswith(f"data.validation.path: {tmp_path / 'nothing-*.jsonl'}: no ")


def test_reserved_origin_column(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "a", "_origin": "x"}])
    with pytest.raises(DataError, match=r"'_origin' is reserved"):
        load_source(spec(path, "completion"))


@pytest.mark.parametrize(
    "path, hub",
    [
        ("HuggingFaceH4/ultrachat_200k", True),
        ("gsm8k", True),
        ("org/name-v2.1", True),
        ("data/train.jsonl", False),
        ("./org/name", False),
        ("/abs/org", False),
        ("data/*", False),
        ("a/b/c", False),
    ],
)
def test_looks_like_hub_id(path, hub):
    assert looks_like_hub_id(path) is hub


def test_hub_dataset_rows_get_origins(monkeypatch):
    calls = []

    def fake_load(path, name=None, split=None, revision=None):
        calls.append((path, name, split, revision))
        return datasets.Dataset.from_dict({"question": ["q1", "q2"]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    ds, stats = load_source(spec("openai/gsm8k", "prompt_only", subset="main", split="test", revision="abc"))
    assert calls == [("openai/gsm8k", "main", "test", "abc")]
    assert ds["_origin"] == ["openai/gsm8k[test]:row 1", "openai/gsm8k[test]:row 2"]
    assert stats == SourceStats("openai/gsm8k", 2, 0)


def test_unreachable_hub_dataset(monkeypatch):
    def fail(*a, **k):
        raise ConnectionError("Couldn't reach 'org/name' on the Hub (offline)")

    monkeypatch.setattr(datasets, "load_dataset", fail)
    with pytest.raises(
        DataError,
        match=r"org/name: no such local file or folder, and loading it as a hub dataset failed: Couldn't reach",
    ):
        load_source(spec("org/name"))


# ---------------------------------------------------------------- take
def source(n: int, name: str = "src.jsonl") -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {"text": [f"r{i}" for i in range(n)], "_origin": [f"{name}:{i + 1}" for i in range(n)]}
    )


@pytest.mark.parametrize(
    "n, weight, expected", [(10, 1.0, 10), (10, 0.5, 5), (5, 0.5, 3), (10, 2.0, 20), (10, 1.5, 15), (10, 0.01, 1)]
)
def test_take_weight_counts(n, weight, expected):
    ds = source(n)
    out = take(ds, spec("src.jsonl", weight=weight), seed=1)
    counts = Counter(out["text"])
    assert len(out) == expected
    whole = expected // n
    assert all(counts[t] in (whole, whole + 1) for t in ds["text"])  # whole repeats plus a distinct rest
    assert sum(1 for t in ds["text"] if counts[t] > whole) == expected % n


@pytest.mark.parametrize("n, samples", [(10, 3), (10, 10), (10, 25)])
def test_take_samples_counts(n, samples):
    out = take(source(n), spec("src.jsonl", samples=samples), seed=1)
    counts = Counter(out["text"])
    assert len(out) == samples
    assert sorted(counts.values(), reverse=True) == [samples // n + 1] * (samples % n) + [samples // n] * (
        n - samples % n if samples >= n else 0
    )


def test_take_is_deterministic_per_seed():
    ds, s = source(100), spec("src.jsonl", weight=0.3)
    assert take(ds, s, 7)["text"] == take(ds, s, 7)["text"]
    assert take(ds, s, 7)["text"] != take(ds, s, 8)["text"]


# ---------------------------------------------------------------- mix
def test_mix_concatenates_and_shuffles_deterministically():
    a, b = source(5, "a.jsonl"), source(5, "b.jsonl")
    out = mix([a, b], seed=3)
    assert sorted(out["_origin"]) == sorted(a["_origin"][:] + b["_origin"][:])
    assert out["_origin"] == mix([a, b], seed=3)["_origin"]
    assert out["_origin"] != mix([a, b], seed=4)["_origin"]


def test_mix_casts_compatible_types():
    a = datasets.Dataset.from_dict({"text": ["x"], "note": ["n"], "_origin": ["a:1"]})
    b = datasets.Dataset.from_dict({"text": ["y"], "note": [None], "_origin": ["b:1"]})
    assert sorted(mix([a, b], 0)["text"]) == ["x", "y"]


def test_mix_of_different_shapes_is_a_clear_error():
    a = source(2, "a.jsonl")
    b = datasets.Dataset.from_dict({"prompt": ["p"], "_origin": ["b.jsonl:1"]})
    with pytest.raises(DataError) as e:
        mix([a, b], seed=0)
    msg = str(e.value)
    assert "source 1 (a.jsonl:1) has text: Value('string')" in msg and "source 2 (b.jsonl:1) has prompt" in msg
    assert "fix:" in msg


# ---------------------------------------------------------------- split_validation
def test_split_validation_sizes_and_determinism():
    ds = source(10)
    assert split_validation(ds, 0.0, 1) == (ds, None)
    train, val = split_validation(ds, 0.2, 1)
    assert (len(train), len(val)) == (8, 2)
    assert set(train["text"]).isdisjoint(val["text"])
    assert split_validation(ds, 0.2, 1)[1]["text"] == val["text"]
    assert (
        split_validation(ds, 0.2, 2)[1]["text"] != val["text"] or split_validation(ds, 0.2, 3)[1]["text"] != val["text"]
    )
    assert len(split_validation(ds, 0.01, 1)[1]) == 1  # at least one record held out


def test_split_validation_needs_training_records():
    with pytest.raises(DataError, match=r"data.validation: .* leaves no training records"):
        split_validation(source(1), 0.5, 0)


def test_repeated_records_never_straddle_the_split():
    ds = take(source(20), spec("src.jsonl", weight=2.0), seed=0)
    train, val = split_validation(mix([ds], seed=0), 0.25, seed=0)
    assert set(train["_origin"]).isdisjoint(val["_origin"])
    assert len(val) == len(set(val["_origin"])) == 5
    assert len(train) == 30


# ---------------------------------------------------------------- end to end
def test_two_file_glob_mixes_and_splits_deterministically(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"instruction": f"a{i}", "output": f"A{i}"} for i in range(6)])
    write_jsonl(tmp_path / "b.jsonl", [{"instruction": f"b{i}", "input": "x", "output": f"B{i}"} for i in range(4)])
    s = spec(tmp_path / "*.jsonl", "instruction", weight=1.5)

    def run(seed):
        ds, stats = load_source(s)
        ds, skipped = normalize_dataset(ds, s)
        return split_validation(mix([take(ds, s, seed)], seed), 0.2, seed), stats

    (train, val), stats = run(5)
    assert stats.records_read == 10 and 11 <= len(train) <= 13 and len(val) == 2
    assert len(set(val["_origin"])) == 2 and set(train["_origin"]).isdisjoint(val["_origin"])
    assert {o.rsplit("/", 1)[1].split(":")[0] for o in train["_origin"]} == {"a.jsonl", "b.jsonl"}
    (train2, val2), _ = run(5)
    assert train2[:] == train[:] and val2[:] == val[:]
    assert run(6)[0][0]["_origin"] != train["_origin"]
