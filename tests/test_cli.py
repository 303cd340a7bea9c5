"""The `ft` command as a user runs it: exit codes, messages without tracebacks, fast start."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import MINIMAL, REPO

QUICKSTART = str(REPO / "examples" / "yaml" / "quickstart.yaml")


def ft(*args, cwd=None, env=None):
    return subprocess.run(
        [sys.executable, "-m", "finetune", *args],
        capture_output=True,
        text=True,
        cwd=cwd or REPO,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_help_lists_the_verbs():
    r = ft("--help")
    assert r.returncode == 0
    for verb in ("train", "preprocess", "merge-lora", "validate", "plan", "schema", "explain"):
        assert verb in r.stdout
    assert "--install-completion" in r.stdout


def test_validate_and_plan_do_not_import_heavy_libraries():
    code = (
        "import sys; from finetune.cli import app; from finetune.config import load; from finetune.workflow import "
        f"compile_plan;compile_plan({QUICKSTART!r}, hardware='8xH100-80GB'); load({QUICKSTART!r});"
        "heavy = [m for m in ('torch', 'transformers', 'peft', 'datasets', 'bitsandbytes', 'gguf', 'llama_cpp') "
        "if m in sys.modules]; "
        "print(heavy); assert not heavy"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_validate_ok_and_bad(write_yaml):
    assert ft("validate", QUICKSTART).returncode == 0
    bad = write_yaml(MINIMAL.replace("  lr: 2.0e-4", "  lrr: 2.0e-4").replace("format: chat", "format: chatt"))
    r = ft("validate", str(bad))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "2 problems" in r.stderr
    assert f"{bad}:15" in r.stderr and "did you mean 'lr'" in r.stderr and "did you mean 'chat'" in r.stderr


def test_validate_with_set_and_env(write_yaml):
    path = write_yaml(
        MINIMAL.replace("max_steps: 1000", "max_steps: ${FT_TEST_STEPS}").replace(
            "data/train.jsonl", "'${FT_TEST_DATA}'"
        )
    )
    (path.parent / "train.jsonl").write_text("")  # ft validate checks that local data files exist
    env = {"FT_TEST_STEPS": "10", "FT_TEST_DATA": str(path.parent / "train.jsonl")}
    assert ft("validate", str(path), env=env).returncode == 0
    r = ft("validate", str(path), "--set", "train.lr=fast", env=env)
    assert r.returncode == 2 and "--set train.lr=fast" in r.stderr


def test_plan_json_for_described_hardware():
    r = ft("plan", QUICKSTART, "--hardware", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert (
        plan["backend"] == "single"
        and plan["world_size"] == 1
        and plan["launch"][:3] == ["python", "-m", "finetune.rank"]
    )


def test_plan_table_shows_decisions_memory_and_launch():
    r = ft("plan", str(REPO / "examples" / "yaml" / "llama3.3-70b-qlora-2gpu.yaml"), "--hardware", "2xA6000-48GB")
    assert r.returncode == 0, r.stderr
    for needle in ("Decisions", "qlora", "fsdp", "Memory per GPU", "total", "Launch: torchrun", "--nproc-per-node=2"):
        assert needle in r.stdout


@pytest.mark.slow
def test_plan_on_this_machine_probes_it():
    r = ft("plan", QUICKSTART, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["precision"] == "fp32"  # no GPU in CI


@pytest.mark.parametrize(
    "args, needle",
    [
        (["plan", QUICKSTART, "--hardware", "9xPotato"], "Accepted forms"),
        pytest.param(  # slow: resolving an unknown model name takes seconds
            ["plan", QUICKSTART, "--set", "model.name=no-such-model-anywhere"], "model.name", marks=pytest.mark.slow
        ),
        (
            [
                "plan",
                QUICKSTART,
                "--set",
                "adapter.type=lora",
                "--set",
                "model.name=meta-llama/Llama-3.1-70B",
                "--hardware",
                "cpu,host=16GB",
            ],
            "does not fit",
        ),
        (["validate", "missing.yaml"], "config file not found"),
        (["explain", "train.lrr"], "did you mean"),
    ],
)
def test_user_errors_exit_2_without_traceback(args, needle):
    r = ft(*args, env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_schema_and_explain():
    r = ft("schema", "--output", "-")
    assert r.returncode == 0 and json.loads(r.stdout)["title"] == "ft job"
    r = ft("explain", "train.micro_batch_size")
    assert r.returncode == 0 and "auto | int (>= 1, <= 2^20)" in r.stdout and "largest that fits" in r.stdout
    assert "grpo" in ft("explain", "method").stdout


# ---------------------------------------------------------------- the top-level handler
def _ft_raising(exc: str, *args, tmp_path):
    """`ft ARGS` in a subprocess where planning raises `exc` (a Python expression)."""
    code = (
        f"import sys, finetune.workflow as w\ndef boom(*a, **k):\n    raise {exc}\nw.compile_plan = boom\n"
        f"sys.argv = ['ft', *{list(args)!r}]\nfrom finetune.cli import main\nmain()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )


def test_an_unexpected_error_is_one_message_with_the_traceback_in_a_log(tmp_path):
    r = _ft_raising("ValueError('kaboom')", "plan", QUICKSTART, "--hardware", "cpu", tmp_path=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "failed: ValueError: kaboom" in r.stderr and "this is a bug in ft or an unexpected input" in r.stderr
    (log,) = tmp_path.glob("ft-error-*.log")
    assert f"traceback: {log}" in r.stderr and "kaboom" in log.read_text() and "Traceback" in log.read_text()


def test_debug_prints_the_traceback(tmp_path):
    r = _ft_raising("ValueError('kaboom')", "--debug", "plan", QUICKSTART, tmp_path=tmp_path)
    assert r.returncode == 1 and "Traceback" in r.stderr and "kaboom" in r.stderr
    assert not list(tmp_path.glob("ft-error-*.log"))


def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    r = _ft_raising("KeyboardInterrupt", "plan", QUICKSTART, tmp_path=tmp_path)
    assert (
        r.returncode == 130
        and "Traceback" not in r.stderr
        and r.stderr.strip().count("\n") == 0
        and "interrupted" in r.stderr
    )


def test_an_os_error_is_an_input_error(tmp_path):
    r = _ft_raising("PermissionError(13, 'Permission denied', '/data/x.jsonl')", "plan", QUICKSTART, tmp_path=tmp_path)
    assert r.returncode == 2 and "/data/x.jsonl" in r.stderr and "Traceback" not in r.stderr


def test_run_main_writes_the_log_into_the_run_folder(tmp_path, capsys):
    from finetune.errors import run_main, set_run_dir

    def fail():
        raise RuntimeError("rank broke")

    try:
        with pytest.raises(SystemExit) as info:
            run_main(fail, what="rank 0", run_dir=tmp_path)
    finally:
        set_run_dir(None)
    assert info.value.code == 1
    (log,) = tmp_path.glob("ft-error-*.log")
    assert "rank broke" in log.read_text() and str(log) in capsys.readouterr().err


def test_validate_names_missing_local_data_files(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(
        f"model: {{name: ft-tiny}}\ndata: {{datasets: [{{path: {tmp_path / 'nope.jsonl'}, format: "
        f"chat}}]}}\noutput: {{dir: {tmp_path / 'run'}}}\n"
    )
    r = ft("validate", str(job))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "data.datasets[0].path" in r.stderr and "nope.jsonl" in r.stderr


def test_ft_generate_and_eval_options_are_their_dataclass_fields_with_the_jobs_defaults():
    """Every option of ft generate / ft eval (the node flags aside) is a field of GenerateOptions / EvalOptions with
    the same default, and none is on one side only; where an option has a default value, the job classes' field of the
    same name has the same default."""
    import dataclasses

    import typer

    from finetune.cli import app
    from finetune.infer.commands import EvalOptions, GenerateOptions
    from finetune.infer.engines import Sampling
    from finetune.infer.evaluation import EvalJob
    from finetune.infer.job import GenerateJob
    from finetune.infer.prompts import PromptSpec

    required, node_flags = object(), {"nnodes", "node_rank", "master_addr", "master_port", "rdzv_id"}
    commands = typer.main.get_command(app).commands
    for name, options, jobs in (
        ("generate", GenerateOptions, (Sampling, PromptSpec, GenerateJob)),
        ("eval", EvalOptions, (PromptSpec, EvalJob)),
    ):
        cli = {p.name: required if p.required else p.default for p in commands[name].params}
        assert node_flags <= set(cli), name
        fields = {
            f.name: required if f.default is dataclasses.MISSING else f.default for f in dataclasses.fields(options)
        }
        assert {k: v for k, v in cli.items() if k not in node_flags} == fields, name
        for job in jobs:
            for f in dataclasses.fields(job):
                if fields.get(f.name) not in (None, required):
                    assert f.default == fields[f.name], (
                        f"{name} {f.name}: {fields[f.name]!r}, {job.__name__} {f.default!r}"
                    )
