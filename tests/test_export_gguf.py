"""ft export --gguf: the exported file, run by llama.cpp on the CPU, answers as transformers does on the merged model.

Round trips: a LoRA run on a tiny Llama (the adapter really merged) and tiny models of other families built from
their config classes: greedy completions token for token equal for f16 files, logits close for q8_0, q4 files load
and answer. A file written with the wrong query/key row order is caught. Refusals: reward models, mixture-of-experts
models, checkpoints not yet consolidated, unknown quantization kinds.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from finetune.errors import FtError
from tests.helpers import LORA, job, qwen_style_tokenizer, tiny_family, train_here, varied_tiny_model

# llama.cpp runs the files: llama-cpp-python, in the test extra (scripts/setup.sh installs it)
needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="needs llama-cpp-python: pip install 'finetune[export]'"
)

PROMPTS = (
    [{"role": "user", "content": "What is 12 + 7?"}],
    [{"role": "user", "content": "Reverse 3141"}],
    [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 40 + 2?"}],
    [{"role": "user", "content": "how many questions about text data?"}],
)
NEW_TOKENS = 12
# llama.cpp vs transformers on these models (random weights of std 0.1: logits of a few units), measured here:
F16_TOLERANCE = 0.05  # max |logit difference| of an f16 file (measured 0.002-0.008; f32 files too: an f16 KV cache)
BF16_TOLERANCE = 0.1  # of a bf16 file (measured 0.02-0.04: 8 bits of mantissa)
Q8_TOLERANCE = 0.3  # of a q8_0 file (measured 0.06-0.16: llama.cpp also rounds activations to 8 bits)
Q8_AGREEMENT = 0.9  # transformers' greedy tokens that llama.cpp ranks first too, teacher forced (measured 0.94-1.0);
# greedy completions of 12 tokens, where one near-tie changes the rest, are whole on at least half the prompts


def _hf(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(folder))


def _prompt_ids(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def _greedy_hf(model, ids: list[int]) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            out.append(int(model(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


def _llama(path: Path):
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=2)


def _greedy_cpp(llm, ids: list[int]) -> list[int]:
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(NEW_TOKENS):
        out.append(int(llm.scores[llm.n_tokens - 1].argmax()))
        llm.eval([out[-1]])
    return out


@dataclasses.dataclass
class Compared:
    same: list[bool]  # per prompt: llama.cpp's greedy completion equals transformers', token for token
    diff: float  # max |logit difference| over the prompts' and transformers' completions' positions
    agree: float  # fraction of those completions' tokens that llama.cpp also ranks first (teacher forced)


def _compare(path: Path, model, tokenizer) -> Compared:
    llm = _llama(path)
    try:
        same, diff, agree = [], 0.0, []
        for messages in PROMPTS:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text)["input_ids"]
            assert llm.tokenize(text.encode(), add_bos=True, special=True) == ids
            ours = _greedy_hf(model, ids)
            same.append(_greedy_cpp(llm, ids) == ours)
            llm.reset()
            llm.eval(ids + ours)
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids + ours])).logits[0]
            theirs = torch.tensor(llm.scores[: len(ids) + len(ours)])
            diff = max(diff, float((theirs - logits).abs().max()))
            agree += (theirs[len(ids) - 1 : -1].argmax(-1) == torch.tensor(ours)).tolist()
    finally:
        llm.close()
    return Compared(same, diff, sum(agree) / len(agree))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A 3-step LoRA run on ft-tiny's shape with varied weights (greedy answers differ by prompt), and the merged
    model written by ft merge-lora (the reference)."""
    from finetune.merge import merge_lora

    root = tmp_path_factory.mktemp("gguf")
    base = varied_tiny_model(root / "base")
    config = job(root, "run", steps=3)
    train_here(config, *LORA, "--set", f"model.name={base}", "--set", "train.lr=0.05")
    run = root / "run"
    merge_lora(run, root / "merged")
    return {"root": root, "run": run, "merged": root / "merged"}


@pytest.mark.slow
@needs_llama_cpp
def test_lora_run_f16_round_trip(lora_run):
    from finetune.export.gguf import export_gguf

    report = export_gguf(lora_run["run"], kind="f16")
    assert report.path == lora_run["run"] / "export" / "gguf-f16" / "model-f16.gguf" and report.path.is_file()
    assert report.arch == "llama" and report.template == "chatml" and report.tokenizer.startswith("gpt2 (starcoder)")
    assert report.merge_logit_diff < 1e-4 and report.top_token_agreement == 1.0
    model, tokenizer = _hf(lora_run["merged"])
    got = _compare(report.path, model, tokenizer)
    print(f"f16 llama: {got}, report {report.max_abs_logit_diff:.3g}")
    assert all(got.same) and got.diff < F16_TOLERANCE
    text = (report.modelfile).read_text()
    assert "FROM ./model-f16.gguf" in text and "<|im_start|>{{ .Role }}" in text
    assert 'PARAMETER stop "<|im_end|>"' in text
    assert json.loads((report.path.parent / "ft_export.json").read_text())["kind"] == "f16"
    bf16 = export_gguf(lora_run["merged"], lora_run["root"] / "bf16", kind="bf16", check=False)
    got = _compare(bf16.path, model, tokenizer)
    print(f"bf16 llama: {got}")
    assert bf16.tensor_types.get("BF16") == 4 * 7 + 1 and all(got.same) and got.diff < BF16_TOLERANCE


@pytest.mark.slow
@needs_llama_cpp
def test_qlora_run_is_dequantized(lora_run, tmp_path):
    """A QLoRA run's adapter is merged into its base loaded unquantized (as ft merge-lora does): the file answers as
    the merged transformers model."""
    from finetune.export.gguf import export_gguf
    from finetune.merge import merge_lora
    from tests.helpers import job_text, write_job

    config = write_job(tmp_path, job_text(tmp_path, adapter="qlora", steps=2))
    train_here(config, "--set", f"model.name={lora_run['root'] / 'base'}")
    report = export_gguf(tmp_path / "run", kind="f16")
    assert any("dequantized" in note for note in report.notes)
    merge_lora(tmp_path / "run", tmp_path / "merged")
    model, tokenizer = _hf(tmp_path / "merged")
    got = _compare(report.path, model, tokenizer)
    assert all(got.same) and got.diff < F16_TOLERANCE


@pytest.mark.slow
@needs_llama_cpp
def test_full_fine_tuning_run(one_process, tmp_path):
    """A fully fine-tuned run's final/ is exported as it is (no adapter), with the run's template."""
    from finetune.export.gguf import export_gguf

    report = export_gguf(one_process, tmp_path / "out", kind="f16")
    assert report.template == "chatml" and report.top_token_agreement == 1.0
    model, tokenizer = _hf(one_process / "final")
    got = _compare(report.path, model, tokenizer)
    assert all(got.same) and got.diff < F16_TOLERANCE


@pytest.mark.slow
@needs_llama_cpp
def test_q8_0_logits_close_and_q4_answers(lora_run, tmp_path):
    from finetune.export.gguf import export_gguf

    model, tokenizer = _hf(lora_run["merged"])
    q8 = export_gguf(lora_run["merged"], tmp_path / "q8", kind="q8_0")
    assert q8.tensor_types.get("Q8_0", 0) >= 4 * 7  # every matrix of the 4 layers
    got = _compare(q8.path, model, tokenizer)
    print(f"q8_0 llama: {got}")
    assert got.diff < Q8_TOLERANCE and got.agree >= Q8_AGREEMENT and sum(got.same) >= len(got.same) / 2
    for kind in ("q4_k_m", "q4_0"):
        report = export_gguf(lora_run["merged"], tmp_path / kind, kind=kind, check=False)
        print(f"{kind}: tensor types {report.tensor_types}")
        assert set(report.tensor_types) - {"F32"}, report.tensor_types
        llm = _llama(report.path)
        try:
            answer = _greedy_cpp(llm, _prompt_ids(tokenizer, PROMPTS[0]))
        finally:
            llm.close()
        assert len(answer) == NEW_TOKENS and all(0 <= t < len(tokenizer) for t in answer)
    assert "Q4_0" in report.tensor_types


@pytest.mark.slow
@needs_llama_cpp
def test_k_quants_where_rows_fit_and_fall_back_where_not(lora_run, tmp_path):
    """q4_k_m stores rows in blocks of 256: ft-tiny's rows of 128 and 384 fall back tensor by tensor (to a type of
    blocks of 32); a model 256 wide gets q4_K (and q6_K where llama.cpp keeps more bits)."""
    from finetune.export.gguf import export_gguf

    narrow = export_gguf(lora_run["merged"], tmp_path / "narrow", kind="q4_k_m", check=False)
    wide_model = tiny_family(tmp_path / "wide", "llama", hidden_size=256, intermediate_size=512, head_dim=64)
    wide = export_gguf(wide_model, tmp_path / "wide-out", kind="q4_k_m", check=False)
    print(f"q4_k_m tensor types: 128 wide {narrow.tensor_types}, 256 wide {wide.tensor_types}")
    assert "Q4_K" not in narrow.tensor_types and "Q4_K" in wide.tensor_types
    model, tokenizer = _hf(wide_model)
    llm = _llama(wide.path)
    try:
        answer = _greedy_cpp(llm, _prompt_ids(tokenizer, PROMPTS[0]))
    finally:
        llm.close()
    assert len(answer) == NEW_TOKENS


@pytest.mark.slow
@needs_llama_cpp
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text"])
def test_other_families_f16_and_q8_0(kind, tmp_path):
    from finetune.export.gguf import export_gguf

    extra = {"attention_bias": True} if kind == "qwen2" else {}
    tokenizer = qwen_style_tokenizer() if kind.startswith("qwen") else None
    folder = tiny_family(tmp_path / "model", kind, tokenizer, **extra)
    model, tokenizer = _hf(folder)
    f16 = export_gguf(folder, tmp_path / "f16", kind="f16")
    f16_got = _compare(f16.path, model, tokenizer)
    q8 = export_gguf(folder, tmp_path / "q8", kind="q8_0", check=False)
    q8_got = _compare(q8.path, model, tokenizer)
    print(f"{kind}: f16 {f16_got}; q8_0 {q8_got}")
    assert all(f16_got.same) and f16_got.diff < F16_TOLERANCE
    assert q8_got.diff < Q8_TOLERANCE and q8_got.agree >= Q8_AGREEMENT and sum(q8_got.same) >= len(q8_got.same) / 2


@pytest.mark.slow
@needs_llama_cpp
def test_sentencepiece_tokenizer(tmp_path):
    """A sentencepiece BPE (as Llama 2, Mistral and Gemma have) is written as llama.cpp's "llama" tokenizer: without a
    prefix space (Gemma's way) llama.cpp tokenizes and answers as transformers. With one that transformers puts only
    before the whole text, llama.cpp (which puts it after every special token too) would tokenize chat prompts
    otherwise: the check refuses to publish that file."""
    pytest.importorskip("sentencepiece")
    from finetune.export.gguf import export_gguf
    from tests.helpers import sentencepiece_tokenizer

    tokenizer = sentencepiece_tokenizer(tmp_path / "spm")
    folder = tiny_family(tmp_path / "model", "mistral", tokenizer, bos_token_id=tokenizer.bos_token_id)
    report = export_gguf(folder, tmp_path / "out", kind="f16")
    assert report.tokenizer.startswith("llama (default)") and report.template == "chatml"
    model, tokenizer = _hf(folder)
    got = _compare(report.path, model, tokenizer)
    print(f"sentencepiece f16: {got}")
    assert all(got.same) and got.diff < F16_TOLERANCE
    prefixed = sentencepiece_tokenizer(tmp_path / "spm-prefix", prefix_space=True)
    folder = tiny_family(tmp_path / "model-prefix", "mistral", prefixed, bos_token_id=prefixed.bos_token_id)
    with pytest.raises(FtError, match="llama.cpp tokenizes text otherwise"):
        export_gguf(folder, tmp_path / "out-prefix", kind="f16")
    assert not (tmp_path / "out-prefix" / "model-f16.gguf").exists()


@pytest.mark.slow
@needs_llama_cpp
def test_wrong_query_key_order_is_caught(lora_run, tmp_path):
    """Written without the query/key reordering Llama needs, the file computes other logits: the check sees it. (Even
    an f32 file differs from transformers by ~1e-2: llama.cpp keeps its attention cache in f16.)"""
    from finetune.export import checks
    from finetune.export.families import family
    from finetune.export.gguf_file import write_gguf

    model, tokenizer = _hf(lora_run["merged"])
    row = family(model.config, "merged")
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    meta = {"name": "m", "chat_template": tokenizer.chat_template}
    good = write_gguf(tmp_path / "good.gguf", model, tokenizer, tmp_path / "tok", row, "f32", meta)
    bad = write_gguf(
        tmp_path / "bad.gguf",
        model,
        tokenizer,
        tmp_path / "tok",
        dataclasses.replace(row, rope_pairs=False),
        "f32",
        meta,
    )
    right, wrong = (checks.check(w.path, model, tokenizer, None) for w in (good, bad))
    print(f"f32 max |logit diff|: right order {right.max_abs_logit_diff:.3g}, wrong {wrong.max_abs_logit_diff:.3g}")
    assert right.max_abs_logit_diff < 0.05 and wrong.max_abs_logit_diff > 1.0  # measured 0.007 and 4.1


# ---------------------------------------------------------------- tokenizers and templates (no llama.cpp)
def test_pre_tokenizers_and_templates_map():
    from transformers import PreTrainedTokenizerFast

    from finetune.export.ollama import builtin_for, modelfile
    from finetune.export.vocab import pre_tokenizer_name
    from finetune.templates import BUILTIN
    from finetune.tiny import build_tokenizer

    tiny, qwen = build_tokenizer(), qwen_style_tokenizer()
    spec = {t: json.loads(t.backend_tokenizer.to_str()) for t in (tiny, qwen)}
    assert pre_tokenizer_name(spec[tiny], Path("tiny")) == "starcoder"  # digits one by one, then GPT-2's split
    assert pre_tokenizer_name(spec[qwen], Path("qwen")) == "qwen2"
    prefix = dict(spec[tiny], pre_tokenizer={"type": "ByteLevel", "add_prefix_space": True, "use_regex": True})
    with pytest.raises(FtError, match="llama.cpp knows no pre-tokenizer"):
        pre_tokenizer_name(prefix, Path("prefix"))
    assert builtin_for(tiny.chat_template, tiny) == "chatml"  # ft-tiny's own ChatML, written otherwise
    assert tiny.chat_template != BUILTIN["chatml"].jinja
    for name in ("chatml", "qwen", "llama3", "mistral", "gemma", "phi3"):
        assert builtin_for(BUILTIN[name].jinja, tiny) == name
    custom = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert builtin_for(custom, tiny) is None
    text = modelfile("model-q8_0.gguf", None, "<|endoftext|>")
    assert "FROM ./model-q8_0.gguf" in text and not any(line.startswith("TEMPLATE") for line in text.splitlines())
    assert 'PARAMETER stop "<|endoftext|>"' in text
    gemma = modelfile("m.gguf", "gemma", "<eos>")
    assert "<start_of_turn>model" in gemma and 'PARAMETER stop "<end_of_turn>"' in gemma
    assert isinstance(tiny, PreTrainedTokenizerFast)


# ---------------------------------------------------------------- refusals
def test_unknown_kind_and_missing_format(tmp_path):
    from typer.testing import CliRunner

    from finetune.cli import app
    from finetune.export.gguf import export_gguf

    with pytest.raises(FtError, match="--quant 'q9_9': not a kind ft writes"):
        export_gguf(tmp_path, tmp_path / "out", kind="q9_9")
    result = CliRunner().invoke(app, ["export", str(tmp_path)])
    assert isinstance(result.exception, FtError) and "--gguf" in str(result.exception)


def test_unconsolidated_checkpoint_names_the_consolidate_command(tmp_path):
    from finetune.export.gguf import export_gguf

    run = tmp_path / "run"
    step = run / "checkpoints" / "step-00000006"
    step.mkdir(parents=True)
    (step / "state.json").write_text(json.dumps({"step": 6, "format": "dcp"}))
    (run / "config.yaml").write_text("model: {name: ft-tiny}\n")
    (run / "plan.json").write_text(json.dumps({"tensor_parallel": 2, "backend": "fsdp2"}))
    for source in (run, step):
        with pytest.raises(FtError) as e:
            export_gguf(source, tmp_path / "out")
        message = str(e.value)
        assert "tensor-parallel over 2 ranks" in message
        assert f"ft consolidate {run} --step 6" in message
        assert f"ft export {run / 'consolidated' / 'step-00000006'} --gguf" in message


@pytest.mark.slow
def test_reward_model_and_moe_are_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from finetune.export.gguf import export_gguf
    from finetune.tiny import build_tokenizer
    from tests.helpers import tiny_moe

    tok = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
    )
    LlamaForSequenceClassification(config).save_pretrained(str(tmp_path / "reward"))
    tok.save_pretrained(str(tmp_path / "reward"))
    with pytest.raises(FtError, match="reward model"):
        export_gguf(tmp_path / "reward", tmp_path / "out")
    moe = tiny_moe(tmp_path / "moe")
    with pytest.raises(FtError, match="mixture-of-experts"):
        export_gguf(moe, tmp_path / "out")
    phi = tiny_family(tmp_path / "phi", "phi3")
    with pytest.raises(FtError, match="does not write the model family 'phi3'"):
        export_gguf(phi, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.slow
def test_existing_files_need_overwrite_and_others_stay(lora_run, tmp_path):
    from finetune.export.gguf import export_gguf

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    export_gguf(lora_run["merged"], out, kind="f16", check=False)
    with pytest.raises(FtError, match="already holds model-f16.gguf, Modelfile, ft_export.json"):
        export_gguf(lora_run["merged"], out, kind="f16", check=False)
    export_gguf(lora_run["merged"], out, kind="f16", check=False, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", "ft_export.json", "model-f16.gguf", "notes.txt"]
