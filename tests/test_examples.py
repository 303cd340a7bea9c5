"""Every example validates, plans to what its `# expect:` line says, and matches the committed JSON Schema."""

from __future__ import annotations

import json
import re
from typing import get_args

import pytest
import yaml

from finetune.config import load
from finetune.config.docs import json_schema_text, markdown_reference
from finetune.config.methods import Method
from finetune.workflow import compile_plan
from tests.helpers import REPO

EXAMPLES = sorted((REPO / "examples" / "yaml").glob("*.yaml"))
SCHEMA_LINE = "# yaml-language-server: $schema=../../schemas/ft.schema.json"


def test_there_are_examples_for_each_method_and_adapter():
    configs = [load(p) for p in EXAMPLES]
    methods = {get_args(cls.model_fields["name"].annotation)[0] for cls in get_args(get_args(Method)[0])}
    assert {"sft", "dpo", "grpo"} <= methods
    assert {c.method.name for c in configs} == methods  # every method has an example
    assert {"full", "lora", "qlora"} <= {c.adapter.type for c in configs}
    assert (REPO / "examples" / "yaml" / "quickstart.yaml") in EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_plans_as_its_header_says(path):
    text = path.read_text()
    assert text.splitlines()[0] == SCHEMA_LINE
    hardware = re.search(r"^# ft plan \S+ --hardware (\S+)$", text, re.M)
    expect = re.search(r"^# expect: (.+)$", text, re.M)
    assert hardware and expect, f"{path.name} needs '# ft plan ... --hardware H' and '# expect: k=v ...' lines"
    plan = compile_plan(path, hardware=hardware.group(1)).to_json()
    for item in expect.group(1).split():
        key, value = item.split("=")
        assert str(plan[key]) == value, f"{path.name}: {key} is {plan[key]}, header expects {value}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_leaves_room_for_the_estimates_error(path):
    from finetune.plan.search import ROOMY

    hardware = re.search(r"^# ft plan \S+ --hardware (\S+)$", path.read_text(), re.M).group(1)
    plan = compile_plan(path, hardware=hardware)
    assert plan.estimate.device_bytes <= ROOMY * plan.device_capacity_bytes, plan.decision("memory_headroom").reason


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_passes_ft_validate(path):
    """What `ft validate` checks beyond the schema: every data path resolves (a local pattern matches files)."""
    from finetune.data.sources import check_paths

    assert check_paths(load(path)) == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_matches_the_json_schema(path):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(yaml.safe_load(path.read_text()), json.loads((REPO / "schemas" / "ft.schema.json").read_text()))


def test_committed_json_schema_is_current():
    committed = (REPO / "schemas" / "ft.schema.json").read_text()
    assert committed == json_schema_text(), "schemas/ft.schema.json is stale: run `ft schema --markdown docs/config.md`"


def test_committed_key_reference_is_current():
    committed = (REPO / "docs" / "config.md").read_text()
    assert committed == markdown_reference(), "docs/config.md is stale: run `ft schema --markdown docs/config.md`"


def test_json_schema_rejects_what_the_loader_rejects():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(json_schema_text())
    good = yaml.safe_load((REPO / "examples" / "yaml" / "quickstart.yaml").read_text())
    bad = {**good, "train": {**good["train"], "lrr": 1}}
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
