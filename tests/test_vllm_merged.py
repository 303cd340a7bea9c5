"""The folder `ft merge-lora` writes loads in vLLM as it is (no --tokenizer, nothing copied in): its dtype, generation
config, tokenizer and chat template are there, and vLLM's greedy output on CPU equals transformers' on the same folder.

Runs in the environment with vLLM's CPU build (scripts/setup-vllm.sh); the main one has no vLLM and this file skips:
    OMP_NUM_THREADS=1 .venv-vllm/bin/python -m pytest -q -m vllm tests/test_vllm_merged.py
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_NEW = 12
PROMPTS = 8


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """{base, merged}: the varied tiny model, and a LoRA adapter on it (random B matrices) merged by ft merge-lora."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.merge import merge_lora
    from tests.helpers import varied_tiny_model

    root = tmp_path_factory.mktemp("vllm-merged")
    base = varied_tiny_model(root / "base")
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32),
        LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0),
    )
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=gen)
    model.save_pretrained(str(root / "adapter"))
    report = merge_lora(root / "adapter", root / "merged")  # the base from adapter_config.json, dtype auto
    assert report.max_abs_logit_diff < 1e-4
    return {"base": base, "merged": root / "merged"}


def _prompts(folder) -> list[list[int]]:
    """Chat prompts as token ids, by the folder's own tokenizer and chat template."""
    from transformers import AutoTokenizer

    from finetune.tiny import arithmetic_records

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    records = arithmetic_records(PROMPTS, seed=11)
    return [
        list(
            tokenizer.apply_chat_template(
                r["messages"][:1], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for r in records
    ]


def _transformers_greedy(folder, prompts) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            done = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False)
            out.append(done[0, len(ids) :].tolist())
    return out


def test_the_merged_folder_holds_what_vllm_reads(merged):
    folder = merged["merged"]
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == "float32" and config["architectures"] == ["LlamaForCausalLM"]
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "model.safetensors"):
        assert (folder / name).is_file(), name
    assert not any(p.name.startswith("adapter") for p in folder.iterdir())


def test_vllm_greedy_output_on_the_merged_folder_equals_transformers(merged):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process (starts in seconds)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    folder = merged["merged"]
    prompts = _prompts(folder)
    expected = _transformers_greedy(folder, prompts)
    base = _transformers_greedy(merged["base"], prompts)
    assert sum(a != b for a, b in zip(expected, base)) > PROMPTS // 2, "the adapter must change the answers"
    assert len({tuple(e) for e in expected}) > 1, expected  # prompts get different answers: the check can fail

    llm = LLM(model=str(folder), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=2**28, seed=0)
    vllm_tokenizer = llm.get_tokenizer()  # the folder's own tokenizer and chat template, as vLLM reads them
    records = [vllm_tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in _messages()]
    assert [list(getattr(r, "input_ids", r)) for r in records] == prompts
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=ids) for ids in prompts],
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
        use_tqdm=False,
    )
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == expected


def _messages() -> list[list[dict]]:
    from finetune.tiny import arithmetic_records

    return [r["messages"][:1] for r in arithmetic_records(PROMPTS, seed=11)]
