"""The loader: YAML + --set + ${ENV} -> Config, and every kind of mistake reported with key, line and fix."""

from __future__ import annotations

import pydantic
import pytest

from finetune.config import load, loads
from finetune.errors import ConfigError, FtError
from tests.helpers import MINIMAL


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
    c = loads(
        MINIMAL.replace("method: {name: sft}", "method: {name: dpo, beta: 0.2}")
        .replace("format: chat", "format: preference")
        .replace("  packing: true\n", ""),
        environ={},
    )
    assert c.method.beta == 0.2


def test_conflict_names_both_keys_and_lines():
    err = problems(
        MINIMAL.replace(
            "adapter: {type: lora, r: 16, alpha: 32, target_modules: all-linear}", "adapter: {type: full}"
        ).replace("quantization: {type: auto}", "quantization: {type: nf4}")
    )
    (p,) = err.problems
    assert p.keys == (("quantization", "type"), ("adapter", "type"))
    assert p.where == ("job.yaml:8", "job.yaml:7")
    assert "conflicts with" in p.render() and "qlora" in p.fix


@pytest.mark.parametrize(
    "edit, keys",
    [
        (("max_steps: 1000", "max_steps: 1000\n  epochs: 2"), {("train", "max_steps"), ("train", "epochs")}),
        (
            ("global_batch_size: 32", "global_batch_size: 32\n  global_batch_tokens: 65536"),
            {("train", "global_batch_size"), ("train", "global_batch_tokens")},
        ),
        (
            ("sharding: auto", "sharding: zero3").__class__(
                ("backend: auto, sharding: auto", "backend: fsdp, sharding: zero3")
            ),
            {("distributed", "sharding"), ("distributed", "backend")},
        ),
        (
            ("backend: auto, sharding: auto, offload: auto", "backend: ddp, sharding: auto, offload: all"),
            {("distributed", "offload"), ("distributed", "backend")},
        ),
        (("method: {name: sft}", "method: {name: dpo}"), {("data", "datasets", 0, "format"), ("method", "name")}),
    ],
)
def test_conflicts(edit, keys):
    err = problems(MINIMAL.replace(*edit))
    assert any(set(p.keys) == keys for p in err.problems), str(err)


def test_all_problems_at_once_including_conflicts_beside_type_errors():
    text = (
        MINIMAL.replace("  lr: 2.0e-4", "  lrr: 2.0e-4")
        .replace("global_batch_size: 32", "global_batch_size: -4")
        .replace("adapter: {type: lora, r: 16, alpha: 32, target_modules: all-linear}", "adapter: {type: full, r: 8}")
    )
    err = problems(text, overrides=["train.warmup_ratio=2"])
    found = {k for p in err.problems for k in p.keys}
    assert {("train", "lrr"), ("train", "global_batch_size"), ("train", "warmup_ratio"), ("adapter", "r")} <= found
    assert len(err.problems) >= 4 and str(err).startswith(f"job.yaml: {len(err.problems)} problems")


def test_set_overrides_and_parses_yaml_values():
    c = loads(
        MINIMAL,
        overrides=[
            "train.lr=1e-4",
            "data.datasets.0.path=other.jsonl",
            "adapter.target_modules=[q_proj, v_proj]",
            "distributed.nodes=2",
        ],
        environ={},
    )
    assert c.train.lr == 1e-4 and c.data.datasets[0].path == "other.jsonl"
    assert c.adapter.target_modules == ["q_proj", "v_proj"] and c.distributed.nodes == 2


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.lr", "is not KEY=VALUE"),
        ("=3", "is not KEY=VALUE"),
        ("train.lr=abc", "should be 'auto' or a valid number"),
        ("model.name.x=1", "is not a section or list"),
        ("data.datasets.3.path=x", "out of range"),
        ("train.lr=[1, 2", "not valid YAML"),
    ],
)
def test_bad_set_is_reported_with_the_argument(override, needle):
    err = problems(MINIMAL, overrides=[override])
    assert needle in str(err) and f"--set {override}" in str(err)


def test_env_vars_expand_with_types_and_defaults():
    text = MINIMAL.replace("max_steps: 1000", "max_steps: ${STEPS}").replace(
        "output: {dir: runs/llama8b-lora}", "output:\n  dir: ${OUT:-runs/default}/x"
    )
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


# ---------------------------------------------------------------- bounded reading, strict values, ${VAR}
def test_nested_env_defaults_expand():
    text = MINIMAL.replace("output: {dir: runs/llama8b-lora}", 'output: {dir: "${A:-${B:-runs/x}}"}').replace(
        "max_steps: 1000", "max_steps: ${S:-${T:-7}}"
    )
    assert loads(text, environ={}).output.dir == "runs/x"
    assert loads(text, environ={"B": "runs/b"}).output.dir == "runs/b"
    c = loads(text, environ={"A": "runs/a", "B": "runs/b", "T": "9"})
    assert c.output.dir == "runs/a" and c.train.max_steps == 9
    err = problems(MINIMAL.replace("max_steps: 1000", "max_steps: ${S:-${T}}"))
    assert "environment variable T is not set" in str(err) and err.problems[0].keys == (("train", "max_steps"),)


def test_values_read_from_the_environment_are_recorded_with_their_reference():
    text = MINIMAL.replace("{name: meta-llama/Llama-3.1-8B}", '{name: "${MODEL}"}').replace(
        "max_steps: 1000", "max_steps: ${STEPS:-5}"
    )
    text = text.replace("output: {dir: runs/llama8b-lora}", 'output: {dir: "runs/${RUN}", run_name: "${NAME:-x}"}')
    c = loads(text, overrides=["output.dir=runs/cli"], environ={"MODEL": "org/secret-model", "RUN": "r1"})
    assert c.model.name == "org/secret-model" and c.output.dir == "runs/cli"
    assert c.env_references() == {("model", "name"): "${MODEL}"}  # defaults read nothing; --set replaced output.dir
    assert c.env_variables() == {"MODEL": "org/secret-model"}


@pytest.mark.parametrize(
    "edit, key, needle",
    [
        (("max_steps: 1000", "max_steps: true"), ("train", "max_steps"), "not the boolean true"),
        (("r: 16", "r: true"), ("adapter", "r"), "not the boolean true"),
        (("lr: 2.0e-4", "lr: false"), ("train", "lr"), "not the boolean false"),
        (
            ("max_steps: 1000", "max_steps: 1000\n  warmup_steps: 1000000000000000000000000000000"),
            ("train", "warmup_steps"),
            "less than or equal to 1000000000",
        ),
        (("lr: 2.0e-4", "lr: 1.0e+30"), ("train", "lr"), "less than or equal to 10"),
        (("lr: 2.0e-4", "lr: .inf"), ("train", "lr"), "finite number"),
        (
            ("global_batch_size: 32", "global_batch_size: 1000000000"),
            ("train", "global_batch_size"),
            "less than or equal to 1048576",
        ),
        (("packing: true", "packing: true\n  template: chatt"), ("data", "template"), "did you mean 'chatml'"),
        (("{name: meta-llama/Llama-3.1-8B}", '{name: "a\\0b"}'), ("model", "name"), "control character NUL"),
        (("{name: meta-llama/Llama-3.1-8B}", "{name: " + "m" * 5000 + "}"), ("model", "name"), "5,000 characters"),
        (("seq_len: 2048", "seq_len: " + "9" * 5000), ("data", "seq_len"), "5,000 characters is not allowed"),
    ],
)
def test_strict_and_bounded_values(edit, key, needle):
    err = problems(MINIMAL.replace(*edit))
    assert any(key in p.keys for p in err.problems) and needle in str(err), str(err)


@pytest.mark.parametrize(
    "template",
    [
        "tokenizer",
        "chatml",
        "llama3",
        "plain",
        "templates/mine.jinja",
        "./x",
        "~/t.j2",
        "{% for m in messages %}{{ m.content }}{% endfor %}",
    ],
)
def test_templates_by_name_path_or_jinja_are_accepted(template):
    assert (
        loads(MINIMAL.replace("packing: true", f"packing: true\n  template: {template!r}"), environ={}).data.template
        == template
    )


@pytest.mark.parametrize(
    "snippet, needle",
    [
        ("x: !!python/object/apply:os.system ['true']", "job.yaml:19"),
        ("x: !custom 1", "job.yaml:19"),
        (
            "x-bomb:\n  - &a [a, a, a, a, a, a, a, a, a, a]\n"
            + "".join(f"  - &{n} [{', '.join(['*' + p] * 10)}]\n" for p, n in zip("abcdef", "bcdefg")),
            "more than 100,000 values",
        ),
        ("x: &r [1, *r]", "job.yaml:19"),
        ("x: " + "[" * 100 + "]" * 100, "nested more than 64 levels"),
        ("x: ok\0", "job.yaml:19:6: control character NUL"),
        ("a: 1\n---\nb: 2", "more than one YAML document"),
    ],
)
def test_yaml_is_read_under_limits_and_without_tags(snippet, needle):
    err = problems(MINIMAL + snippet + "\n")
    assert needle in str(err), str(err)


def test_aliases_within_the_budget_still_work():
    text = MINIMAL.replace(
        "datasets: [{path: data/train.jsonl, format: chat}]", "datasets: [&d {path: data/train.jsonl, format: chat}]"
    )
    c = loads(text.replace("  packing: true", "  packing: true\n  validation: *d"), environ={})
    assert c.data.validation.path == "data/train.jsonl"


def test_files_that_are_not_utf8_or_too_big_name_the_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_bytes(MINIMAL.encode() + b"# caf\xe9\n")
    with pytest.raises(FtError, match=rf"{path}:19:6: not UTF-8 text \(byte 0xe9 at offset \d+\)"):
        load(path)
    path.write_bytes(MINIMAL.encode() + b"#" * (1 << 20))
    with pytest.raises(FtError, match="larger than 1 MiB"):
        load(path)


def test_set_values_are_read_under_the_same_limits():
    err = problems(
        MINIMAL,
        overrides=["model.name=!!python/name:os.system", "train.max_steps=" + "9" * 100, ".".join("a" * 40) + "=1"],
    )
    text = str(err)
    assert (
        "tag !!python/name:os.system is not allowed" in text
        and "100 characters is not allowed" in text
        and "40 dotted parts" in text
    )


def test_an_edit_of_the_job_text_that_finds_nothing_fails():
    """The tests' job texts (tests/helpers.JobText) refuse an edit whose text is not there, so that a renamed key
    cannot leave a test checking the unedited job."""
    from tests.helpers import MINIMAL

    assert "lrr: 2.0e-4" in MINIMAL.replace("  lr: 2.0e-4", "  lrr: 2.0e-4")
    with pytest.raises(AssertionError, match="holds no"):
        MINIMAL.replace("  learning_rate: 2.0e-4", "  lr: 1")
