"""`ft generate` and `ft eval` with `--engine vllm` on CPU (vLLM's CPU build): greedy output equal to transformers' (an
adapter included), byte-identical at 1 and 2 processes, resumable, and scored alike.

Runs in an environment with vLLM (the main one has none, and this file skips there):
    OMP_NUM_THREADS=1 /path/to/vllm-env/bin/python -m pytest -q tests/test_vllm_generate.py
vLLM is imported once into this process (about 10 s) and each engine starts in about 3 s, so most tests generate here.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from finetune.artifacts import resolve  # noqa: E402
from finetune.errors import FtError  # noqa: E402
from finetune.infer.engines import Sampling  # noqa: E402
from finetune.infer.generate import generate  # noqa: E402
from finetune.infer.job import GenerateJob  # noqa: E402
from finetune.infer.prompts import PromptSpec  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_NEW = 8
PROMPTS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.helpers import varied_tiny_model

    return varied_tiny_model(tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory):
    """A LoRA adapter on the model, its B matrices random (peft starts them at zero), so that it changes the output."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("vllm-adapter")
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=gen)
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    """Chat prompts of varied lengths, with ids and an extra field."""
    from finetune.tiny import arithmetic_records, write_jsonl

    records = [
        {
            "id": f"q{i:03d}",
            "messages": [{"role": "user", "content": r["messages"][0]["content"] + " please" * (i % 5)}],
        }
        for i, r in enumerate(arithmetic_records(PROMPTS, seed=3))
    ]
    return write_jsonl(records, tmp_path_factory.mktemp("vllm-prompts") / "prompts.jsonl")


def job(source: str, prompts, out, engine: str) -> GenerateJob:
    return GenerateJob(
        resolve(source),
        PromptSpec(str(prompts)),
        str(out),
        Sampling(max_new_tokens=MAX_NEW),
        batch_size=4,
        engine=engine,
    )


def completions(path) -> list[str]:
    return [json.loads(line)["completion"] for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def outputs(model_dir, adapter_dir, prompts_file, tmp_path_factory):
    """{(source, engine): output file} for the model and the adapter, by transformers and by vLLM, in this process."""
    folder, found = tmp_path_factory.mktemp("vllm-outputs"), {}
    for source in ("model", "adapter"):
        for engine in ("transformers", "vllm"):
            out = folder / f"{source}-{engine}.jsonl"
            where = str(model_dir if source == "model" else adapter_dir)
            result = generate(job(where, prompts_file, out, engine), processes=1, progress=False)
            assert result.engine == engine and result.rows == PROMPTS and result.processes == 1
            found[source, engine] = out
    return found


def test_vllm_greedy_output_equals_transformers(outputs):
    base = completions(outputs["model", "transformers"])
    assert len(set(base)) > PROMPTS // 2, base  # the prompts get different answers: the comparison can fail
    assert outputs["model", "vllm"].read_bytes() == outputs["model", "transformers"].read_bytes()


def test_an_adapter_served_as_a_lora_request_equals_transformers_and_peft(outputs):
    tuned = completions(outputs["adapter", "transformers"])
    assert sum(a != b for a, b in zip(tuned, completions(outputs["model", "transformers"]))) > PROMPTS // 2
    assert outputs["adapter", "vllm"].read_bytes() == outputs["adapter", "transformers"].read_bytes()


def test_two_processes_write_the_same_bytes_as_one(outputs, model_dir, prompts_file, tmp_path):
    out = tmp_path / "two.jsonl"
    result = generate(job(str(model_dir), prompts_file, out, "vllm"), processes=2, progress=False)
    assert result.processes == 2 and result.engine == "vllm" and result.generated == PROMPTS
    assert out.read_bytes() == outputs["model", "vllm"].read_bytes()


def test_an_interrupted_run_resumes_to_the_same_file(outputs, model_dir, prompts_file, tmp_path, monkeypatch):
    out = tmp_path / "resumed.jsonl"
    parts = out.with_name("resumed.jsonl.parts")
    hook = tmp_path / "stop_hook.py"  # after its third batch, the process stops with that batch's last row cut short
    hook.write_text(
        "import pathlib\n\n\ndef hook(rank, batches_done):\n    if batches_done == 3:\n"
        f"        (part,) = pathlib.Path({str(parts)!r}).glob('part-*.jsonl')\n"
        "        part.write_bytes(part.read_bytes()[:-5])\n        raise KeyboardInterrupt\n"
    )
    monkeypatch.setenv("FT_BATCH_HOOK", f"{hook}:hook")
    with pytest.raises(KeyboardInterrupt):
        generate(job(str(model_dir), prompts_file, out, "vllm"), processes=1, progress=False)
    monkeypatch.delenv("FT_BATCH_HOOK")
    (part,) = parts.glob("part-*.jsonl")
    assert not out.exists() and part.read_text().count("\n") == 3 * 4 - 1
    # the third batch is generated again, whole, and only its last prompt's row is kept
    resumed = generate(job(str(model_dir), prompts_file, out, "vllm"), processes=1, progress=False)
    assert resumed.rows == PROMPTS and resumed.generated == PROMPTS - (3 * 4 - 1)
    assert out.read_bytes() == outputs["model", "vllm"].read_bytes() and not parts.exists()


def test_sampled_batches_longer_than_one_engine_step_on_a_cpu(model_dir, tmp_path):
    """24 seeded prompts of ~300 tokens sampled in one batch: more prompt tokens than vLLM prefills in one step. With
    chunked prefill, vLLM cuts the last prefill short and rewinds that request's own generator, which a CPU generator
    cannot do ("CPU Generator does not use offset": the engine dies). ft's CPU engines schedule without cutting; the
    same seeds give the same file again."""
    from finetune.tiny import write_jsonl

    long = [{"id": f"l{i:02d}", "prompt": f"{i} + {i} = " + "and then " * 100} for i in range(24)]
    prompts = write_jsonl(long, tmp_path / "long.jsonl")
    sampled = Sampling(max_new_tokens=MAX_NEW, temperature=1.0, seed=5)
    files = []
    for name in ("first", "again"):
        out = tmp_path / f"{name}.jsonl"
        spec = GenerateJob(
            resolve(str(model_dir)), PromptSpec(str(prompts)), str(out), sampled, batch_size=24, engine="vllm"
        )
        result = generate(spec, processes=1, progress=False)
        assert result.rows == 24 and result.generated == 24
        files.append(out.read_bytes())
    assert files[0] == files[1]
    assert len(set(completions(tmp_path / "first.jsonl"))) > 12  # sampled, not one answer for all


def test_a_hybrid_model_builds_an_engine_with_fts_cpu_settings(tmp_path):
    """vLLM caches a hybrid model's prefixes (linear-attention layers' states) only with chunked prefill and refuses the
    engine otherwise; ft's CPU settings, which turn chunked prefill off, turn prefix caching off with it. vLLM's own
    configuration of a tiny Qwen3-Next (one linear-attention layer, one full) is built from them."""
    from transformers import Qwen3NextConfig
    from vllm.engine.arg_utils import EngineArgs

    from finetune.infer.engines import cpu_engine_args
    from finetune.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(str(tmp_path))
    Qwen3NextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        max_position_embeddings=512,
    ).save_pretrained(str(tmp_path))
    config = EngineArgs(model=str(tmp_path), max_model_len=256, **cpu_engine_args()).create_engine_config()
    assert config.model_config.is_hybrid
    assert not config.scheduler_config.enable_chunked_prefill and not config.cache_config.enable_prefix_caching


def test_ft_eval_with_vllm_scores_like_transformers(outputs, model_dir, prompts_file, tmp_path):
    from finetune.infer.commands import EvalOptions, run_eval

    answers = completions(outputs["model", "transformers"])
    data = tmp_path / "data.jsonl"  # half the references are transformers' own answers, half are wrong
    data.write_text(
        "".join(
            json.dumps({**json.loads(line), "answer": answers[i] if i % 2 == 0 else "no such answer"}) + "\n"
            for i, line in enumerate(prompts_file.read_text().splitlines())
        )
    )
    results = {
        engine: run_eval(
            EvalOptions(
                str(model_dir),
                data=str(data),
                metrics=("exact_match", "contains"),
                max_new_tokens=MAX_NEW,
                batch_size=4,
                engine=engine,
                predictions=str(tmp_path / f"{engine}.jsonl"),
                quiet=True,
            )
        )
        for engine in ("transformers", "vllm")
    }
    assert results["vllm"].generation["engine"] == "vllm"
    assert results["vllm"].metrics == results["transformers"].metrics
    assert results["vllm"].metrics["exact_match"] == 0.5
    assert (tmp_path / "vllm.jsonl").read_bytes() == (tmp_path / "transformers.jsonl").read_bytes()


def test_vllm_refuses_an_adapter_it_cannot_serve(model_dir, adapter_dir, prompts_file, tmp_path):
    import shutil

    dora = tmp_path / "dora"
    shutil.copytree(adapter_dir, dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(FtError, match="vLLM cannot serve an adapter with DoRA"):
        generate(job(str(dora), prompts_file, tmp_path / "o.jsonl", "vllm"), processes=1, progress=False)


def _vllm_reads_images() -> bool:
    """vLLM's LLaVA imports transformers' image processors that need torchvision, which the CPU test environment
    leaves out (its CUDA build breaks `import vllm` without CUDA)."""
    try:
        import vllm.model_executor.models.llava  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _vllm_reads_images(), reason="vLLM's vision models need torchvision, not installed here")
def test_prompts_with_images_give_transformers_greedy_answers_on_vllm(tmp_path):
    """The prompts' image tokens (the processor's expansion) and their images reach vLLM, which gives the answers
    transformers' generate gives the same model."""
    from finetune.tiny import build_vlm, image_records, write_jsonl

    build_vlm(tmp_path / "model")
    prompts = write_jsonl(image_records(8, tmp_path / "data", seed=2), tmp_path / "data" / "prompts.jsonl")
    for engine in ("transformers", "vllm"):
        generate(job(str(tmp_path / "model"), prompts, tmp_path / f"{engine}.jsonl", engine), 1, progress=False)
    assert (tmp_path / "vllm.jsonl").read_bytes() == (tmp_path / "transformers.jsonl").read_bytes()


def test_vllm_refuses_images_of_a_model_it_cannot_serve_them_for(tmp_path):
    """Llama 3.2 Vision: vLLM has no model of it and its Transformers backend cannot count its image tokens, so
    `--engine vllm` with image prompts is refused before any engine starts, naming the fix."""
    from finetune.tiny import image_records, write_jsonl
    from tests.vlm_builders import build_mllama_vlm

    build_mllama_vlm(tmp_path / "model")
    prompts = write_jsonl(image_records(2, tmp_path / "data", seed=1), tmp_path / "data" / "prompts.jsonl")
    job = GenerateJob(
        resolve(str(tmp_path / "model")), PromptSpec(str(prompts)), str(tmp_path / "out.jsonl"), engine="vllm"
    )
    with pytest.raises(
        FtError,
        match=r"--engine vllm: vLLM .* no model of MllamaForConditionalGeneration[\s\S]*"
        r"fix: --engine transformers",
    ):
        generate(job, processes=1, progress=False)
    assert not (tmp_path / "out.jsonl").exists()
