"""Schema checks for tests/data/memory_calibration.yaml, the table of published, measured peak GPU memory.

Each row must name a catalog model, a hardware description that finetune.hardware.parse() reads, a URL source
with a quote, a measured figure with its unit and what was measured, and the run's settings in ft's vocabulary.
These tests check the data only; how close ft's planner comes to the figures is tested elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from finetune.catalog import lookup
from finetune.hardware import parse

TABLE = Path(__file__).resolve().parent / "data" / "memory_calibration.yaml"

ROW_FIELDS = {
    "id",
    "source",
    "quote",
    "model",
    "gpu",
    "measured",
    "unit",
    "measured_gib",
    "measure",
    "settings",
    "notes",
}
EXCLUDED_FIELDS = {"id", "source", "quote", "reason"}
MEASURES = {"max_memory_allocated", "max_memory_reserved", "nvidia-smi", "unknown"}
UNITS = {"GiB", "GB"}
UNKNOWN = "unknown"

# Settings: allowed values per key; None in a set allows null, `int` / `bool` a value of that type.
ENUMS = {
    "adapter": {"full", "lora", "qlora"},
    "quantization": {"none", "nf4", "int8"},
    "precision": {"bf16", "fp16", "fp32", "bf16-pure"},
    "optimizer": {"adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"},
    "loss": {"plain", "chunked", "fused"},
    "backend": {"single", "ddp", "fsdp", "deepspeed"},
    "sharding": {"none", "full_shard", "shard_grad_op", "zero1", "zero2", "zero3"},
    "offload": {"none", "optimizer", "all"},
    "data": {"packed", "fixed_length", "variable"},
}
BOOLS = {"optimizer_in_backward", "gradient_checkpointing", "activation_offload", "compile"}
POSITIVE_INTS = {"micro_batch_size", "seq_len", "gradient_accumulation", "world_size"}
LORA_KEYS = {"lora_r", "lora_alpha", "lora_targets"}
SETTINGS_KEYS = set(ENUMS) | BOOLS | POSITIVE_INTS | LORA_KEYS


def _load() -> dict:
    with TABLE.open() as f:
        return yaml.safe_load(f)


DATA = _load()
ROWS = DATA["rows"]
EXCLUDED = DATA["excluded"]


def _ids(rows: list[dict]) -> list[str]:
    return [row.get("id", f"row{i}") for i, row in enumerate(rows)]


def test_table_has_both_lists_and_enough_rows():
    assert set(DATA) == {"rows", "excluded"}
    assert len(ROWS) >= 25, f"{TABLE.name}: only {len(ROWS)} usable rows"


def test_ids_are_unique_across_both_lists():
    ids = _ids(ROWS) + _ids(EXCLUDED)
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    assert not duplicates, f"{TABLE.name}: repeated ids {duplicates}"


def _assert_source(row: dict) -> None:
    assert isinstance(row["source"], str) and row["source"].startswith("https://"), (
        f"{row['id']}: source must start with a https:// URL, got {row['source']!r}"
    )
    assert isinstance(row["quote"], str) and row["quote"].strip(), f"{row['id']}: quote is empty"


@pytest.mark.parametrize("row", ROWS, ids=_ids(ROWS))
def test_row_fields_source_model_and_gpu(row):
    assert set(row) == ROW_FIELDS, f"{row.get('id')}: fields differ from the schema by {set(row) ^ ROW_FIELDS}"
    _assert_source(row)
    assert lookup(row["model"]) is not None, f"{row['id']}: model {row['model']!r} is not in ft's catalog"
    hardware = parse(row["gpu"])
    assert hardware.accelerator is not None, f"{row['id']}: gpu {row['gpu']!r} describes no GPU"
    assert hardware.world_size == row["settings"]["world_size"], f"{row['id']}: gpu count != settings.world_size"


@pytest.mark.parametrize("row", ROWS, ids=_ids(ROWS))
def test_row_measurement(row):
    assert row["unit"] in UNITS, f"{row['id']}: unit {row['unit']!r} not in {sorted(UNITS)}"
    assert row["measure"] in MEASURES, f"{row['id']}: measure {row['measure']!r} not in {sorted(MEASURES)}"
    measured, gib = row["measured"], row["measured_gib"]
    assert isinstance(measured, (int, float)) and measured > 0, f"{row['id']}: measured must be a positive number"
    assert isinstance(gib, (int, float)) and 0 < gib <= parse(row["gpu"]).accelerator.memory_bytes / 1024**3 + 1, (
        f"{row['id']}: measured_gib {gib} is not a per-GPU figure that fits the card"
    )
    if row["unit"] == "GiB":
        assert gib == measured, f"{row['id']}: unit GiB but measured_gib {gib} != measured {measured}"


def _bad_setting(key: str, value) -> str | None:
    if value == UNKNOWN:
        return None
    if key in ENUMS and value not in ENUMS[key]:
        return f"{value!r} not in {sorted(ENUMS[key])}"
    if key in BOOLS and not isinstance(value, bool):
        return f"{value!r} is not true/false"
    if key in POSITIVE_INTS and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return f"{value!r} is not a positive integer"
    return None


@pytest.mark.parametrize("row", ROWS, ids=_ids(ROWS))
def test_row_settings(row):
    settings = row["settings"]
    assert set(settings) == SETTINGS_KEYS, f"{row['id']}: settings keys differ by {set(settings) ^ SETTINGS_KEYS}"
    problems = {k: p for k, v in settings.items() if (p := _bad_setting(k, v))}
    assert not problems, f"{row['id']}: bad settings {problems}"
    adapted = settings["adapter"] in ("lora", "qlora")
    for key in LORA_KEYS:
        assert (settings[key] is not None) == adapted, f"{row['id']}: {key} must be set exactly for LoRA/QLoRA rows"
    if adapted:
        targets = settings["lora_targets"]
        assert targets in ("all-linear", UNKNOWN) or (isinstance(targets, list) and targets), row["id"]
    assert (settings["quantization"] == "nf4") == (settings["adapter"] == "qlora"), f"{row['id']}: qlora means nf4"
    single = settings["world_size"] == 1
    assert (settings["backend"] == "single") == single, f"{row['id']}: backend 'single' iff world_size 1"


@pytest.mark.parametrize("row", EXCLUDED, ids=_ids(EXCLUDED))
def test_excluded_rows_say_why(row):
    assert set(row) == EXCLUDED_FIELDS, (
        f"{row.get('id')}: fields differ from the schema by {set(row) ^ EXCLUDED_FIELDS}"
    )
    _assert_source(row)
    assert isinstance(row["reason"], str) and len(row["reason"]) > 20, f"{row['id']}: give the reason in a sentence"
