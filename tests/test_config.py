"""The loader: YAML + --set + ${ENV} -> Config, and every kind of mistake reported with key, line and fix."""

from __future__ import annotations

import pydantic
import pytest

from finetune.config import load, loads
from finetune.errors import ConfigError, FtError
from tests.conftest import MINIMAL


def problems(text: str, overrides=(), environ=None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        loads(text, name="job.yaml", overrides=overrides, environ=environ or {})
    return info.value


def test_contract_file_validates_with_its_values():
    c = loads(MINIMAL, environ={})
    assert c.model.name == "meta-llama/Llama-3.1-8B"
    assert c.data.datasets[0].format == "chat" and c.data.packing is True and c.data.seq_len == 2048
    assert c.method.name == "sft" and c.adapter.type == "lora" and c.adapter.r == 16
    assert c.train.micro_batch_size == "auto" and c.train.max_steps == 1000 and c.train.lr == 2e-4
    assert (c.distributed.backend, c.distributed.sharding, c.distributed.offload) == ("auto", "auto", "auto")
    assert c.model.trust_remote_code is False


def test_config_is_frozen():
    c = loads(MINIMAL, environ={})
    with pytest.raises(pydantic.ValidationError):
        c.train.lr = 1.0


def test_misspelled_key_names_line_and_suggests():
    err = problems(MINIMAL.replace("  lr: 2.0e-4", "  lrr: 2.0e-4"))
    (p,) = err.problems
    assert p.keys == (("train", "lrr"),)
    assert p.where == ("job.yaml:15",)
    assert "did you mean 'lr'" in p.fix


def test_key_in_the_wrong_section_points_to_the_right_one():
    err = problems(MINIMAL.replace("  max_steps: 1000", "  max_steps: 1000\n  seq_len: 512"))
    assert "data.seq_len" in err.problems[0].fix


def test_wrong_type_says_what_was_expected_and_got():
    err = problems(MINIMAL.replace("global_batch_size: 32", "global_batch_size: lots"))
    (p,) = err.problems
    assert p.keys == (("train", "global_batch_size"),) and p.where == ("job.yaml:10",)
    assert "integer" in p.message and "'lots'" in p.message


def test_auto_or_int_fields_report_once_not_per_union_member():
    err = problems(MINIMAL.replace("micro_batch_size: auto", "micro_batch_size: huge"))
    (p,) = err.problems
    assert "'auto'" in p.message and "integer" in p.message


def test_bad_choice_suggests_closest_value():
    err = problems(MINIMAL.replace("format: chat", "format: chatt"))
    (p,) = err.problems
    assert p.keys == (("data", "datasets", 0, "format"),) and "'chat'" in p.fix
    assert "data.datasets[0].format" in str(err)


def test_unknown_method_name_lists_methods():
    err = problems(MINIMAL.replace("method: {name: sft}", "method: {name: ppo}"))
    assert "'ppo'" in str(err) and "sft" in str(err) and "dpo" in str(err) and "grpo" in str(err)


def test_method_specific_keys_are_checked_per_method():
    err = problems(MINIMAL.replace("method: {name: sft}", "method: {name: sft, beta: 0.1}"))
    assert err.problems[0].keys == (("method", "beta"),)
    c = loads(MINIMAL.replace("method: {name: sft}", "method: {name: dpo, beta: 0.2}").replace("format: chat", "format: preference").replace("  packing: true\n", ""), environ={})
    assert c.method.beta == 0.2


def test_conflict_names_both_keys_and_lines():
    err = problems(MINIMAL.replace("adapter: {type: lora, r: 16, alpha: 32, target_modules: all-linear}", "adapter: {type: full}").replace("quantization: {type: auto}", "quantization: {type: nf4}"))
    (p,) = err.problems
    assert p.keys == (("quantization", "type"), ("adapter", "type"))
    assert p.where == ("job.yaml:8", "job.yaml:7")
    assert "conflicts with" in p.render() and "qlora" in p.fix


@pytest.mark.parametrize("edit, keys", [
    (("max_steps: 1000", "max_steps: 1000\n  epochs: 2"), {("train", "max_steps"), ("train", "epochs")}),
    (("global_batch_size: 32", "global_batch_size: 32\n  global_batch_tokens: 65536"), {("train", "global_batch_size"), ("train", "global_batch_tokens")}),
    (("sharding: auto", "sharding: zero3").__class__(("backend: auto, sharding: auto", "backend: fsdp, sharding: zero3")), {("distributed", "sharding"), ("distributed", "backend")}),
    (("backend: auto, sharding: auto, offload: auto", "backend: ddp, sharding: auto, offload: all"), {("distributed", "offload"), ("distributed", "backend")}),
    (("method: {name: sft}", "method: {name: dpo}"), {("data", "datasets", 0, "format"), ("method", "name")}),
])
def test_conflicts(edit, keys):
    err = problems(MINIMAL.replace(*edit))
    assert any(set(p.keys) == keys for p in err.problems), str(err)


def test_all_problems_at_once_including_conflicts_beside_type_errors():
    text = (MINIMAL.replace("  lr: 2.0e-4", "  lrr: 2.0e-4")
            .replace("global_batch_size: 32", "global_batch_size: -4")
            .replace("adapter: {type: lora, r: 16, alpha: 32, target_modules: all-linear}", "adapter: {type: full, r: 8}"))
    err = problems(text, overrides=["train.warmup_ratio=2"])
    found = {k for p in err.problems for k in p.keys}
    assert {("train", "lrr"), ("train", "global_batch_size"), ("train", "warmup_ratio"), ("adapter", "r")} <= found
    assert len(err.problems) >= 4 and str(err).startswith(f"job.yaml: {len(err.problems)} problems")


def test_set_overrides_and_parses_yaml_values():
    c = loads(MINIMAL, overrides=["train.lr=1e-4", "data.datasets.0.path=other.jsonl", "adapter.target_modules=[q_proj, v_proj]", "distributed.nodes=2"], environ={})
    assert c.train.lr == 1e-4 and c.data.datasets[0].path == "other.jsonl"
    assert c.adapter.target_modules == ["q_proj", "v_proj"] and c.distributed.nodes == 2


@pytest.mark.parametrize("override, needle", [
    ("train.lr", "is not KEY=VALUE"),
    ("=3", "is not KEY=VALUE"),
    ("train.lr=abc", "should be 'auto' or a valid number"),
    ("model.name.x=1", "is not a section or list"),
    ("data.datasets.3.path=x", "out of range"),
    ("train.lr=[1, 2", "not valid YAML"),
])
def test_bad_set_is_reported_with_the_argument(override, needle):
    err = problems(MINIMAL, overrides=[override])
    assert needle in str(err) and f"--set {override}" in str(err)


def test_env_vars_expand_with_types_and_defaults():
    text = MINIMAL.replace("max_steps: 1000", "max_steps: ${STEPS}").replace("output: {dir: runs/llama8b-lora}", "output:\n  dir: ${OUT:-runs/default}/x")
    c = loads(text, environ={"STEPS": "250"})
    assert c.train.max_steps == 250 and c.output.dir == "runs/default/x"


def test_missing_env_var_names_key_line_and_variable():
    err = problems(MINIMAL.replace("max_steps: 1000", "max_steps: ${STEPS}"))
    (p,) = err.problems
    assert p.keys == (("train", "max_steps"),) and p.where == ("job.yaml:16",) and "STEPS" in p.message


def test_yaml_syntax_error_gives_line_and_column():
    err = problems(MINIMAL.replace("  seq_len: 2048", "  seq_len: [2048"))
    assert "YAML syntax error" in str(err) and "job.yaml:" in str(err)


def test_duplicate_key_is_an_error_not_a_silent_override():
    err = problems(MINIMAL.replace("  max_steps: 1000", "  max_steps: 1000\n  max_steps: 10"))
    assert "written twice" in str(err) and "line 16" in str(err)


def test_missing_required_section_and_empty_file():
    err = problems(MINIMAL.replace("output: {dir: runs/llama8b-lora}\n", ""))
    assert err.problems[0].keys == (("output",),) and "required" in err.problems[0].message
    assert "empty" in str(problems(""))


def test_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(FtError, match="config file not found"):
        load(tmp_path / "nope.yaml")


def test_load_reads_files_and_reports_their_name(write_yaml):
    path = write_yaml(MINIMAL.replace("  lr: 2.0e-4", "  lrr: 2.0e-4"))
    with pytest.raises(ConfigError) as info:
        load(path)
    assert f"{path}:15" in str(info.value)
