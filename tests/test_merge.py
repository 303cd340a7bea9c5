"""ft merge-lora on a tiny Llama: merged logits equal base+adapter, sharding, run folders, refusals, QLoRA."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from finetune.errors import FtError
from finetune.merge import MergeReport, merge_lora, read_record

TOKENS = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(123))


def _perturbed_lora(model, seed: int = 1):
    """A LoRA (all-linear, r 8) on model whose B matrices are random, so the adapter changes outputs."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return peft_model.eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits.float()


def _load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{base, adapter, ref}: a tiny base, a non-trivial adapter on it, and base+adapter logits on TOKENS."""
    from finetune.tiny import build_model

    root = tmp_path_factory.mktemp("merge")
    build_model(root / "base")
    base = _load(root / "base")
    plain = _logits(base)
    peft_model = _perturbed_lora(base)
    ref = _logits(peft_model)
    assert (ref - plain).abs().max() > 1e-2, "the adapter must change the outputs for the test to mean anything"
    peft_model.save_pretrained(str(root / "adapter"))
    return {"root": root, "base": root / "base", "adapter": root / "adapter", "ref": ref}


def test_merged_logits_equal_base_plus_adapter(tiny, tmp_path):
    report = merge_lora(tiny["adapter"], tmp_path / "out", base=str(tiny["base"]))
    assert isinstance(report, MergeReport)
    assert report.dtype == "fp32" and report.shards == 1 and not report.qlora
    assert report.max_abs_logit_diff < 1e-4
    merged = _load(tmp_path / "out")
    diff = (_logits(merged) - tiny["ref"]).abs().max().item()
    print(f"fp32: report max_abs_logit_diff={report.max_abs_logit_diff:.3g}, reloaded vs base+adapter={diff:.3g}")
    assert diff < 1e-4
    assert not any("lora" in k for k in merged.state_dict())
    assert report.params == sum(p.numel() for p in merged.parameters())
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()  # from the base: the adapter folder has none
    assert read_record(tmp_path / "out")["max_abs_logit_diff"] < 1e-4  # in the folder's card, README.md
    # only what transformers writes for a model and its tokenizer, and the card: the folder loads as it is elsewhere
    written = {p.name for p in (tmp_path / "out").iterdir()}
    assert written <= {
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    }, written
    assert "max |logit" in str(report)


def test_base_from_adapter_config_and_sharding(tiny, tmp_path):
    report = merge_lora(tiny["adapter"], tmp_path / "out", max_shard_size="200KB")  # base from adapter_config.json
    assert report.base == str(tiny["base"])
    shards = sorted((tmp_path / "out").glob("*.safetensors"))
    assert report.shards == len(shards) > 1
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert (_logits(_load(tmp_path / "out")) - tiny["ref"]).abs().max() < 1e-4


def test_bf16_merge(tiny, tmp_path):
    report = merge_lora(tiny["adapter"], tmp_path / "out", base=str(tiny["base"]), dtype="bf16")
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert report.dtype == "bf16" and merged.dtype == torch.bfloat16
    diff = (_logits(merged) - tiny["ref"]).abs().max().item()
    print(f"bf16: report max_abs_logit_diff={report.max_abs_logit_diff:.3g}, reloaded vs fp32 base+adapter={diff:.3g}")
    assert report.max_abs_logit_diff < 0.1 and diff < 0.1


def test_run_folder(tiny, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny["adapter"], run / "final")
    from finetune.tiny import build_tokenizer

    build_tokenizer(run / "final")
    (run / "config.yaml").write_text(
        f"model: {{name: {tiny['base']}}}\nadapter: {{type: lora, r: 8}}\noutput: {{dir: {run}}}\n"
    )
    report = merge_lora(run, tmp_path / "out")
    assert report.base == str(tiny["base"]) and report.adapter == run / "final"
    assert report.tokenizer == str(run / "final") and report.max_abs_logit_diff < 1e-4
    assert (_logits(_load(tmp_path / "out")) - tiny["ref"]).abs().max() < 1e-4


def test_mismatched_hidden_size_is_explained(tiny, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "base64"))
    with pytest.raises(FtError) as err:
        merge_lora(tiny["adapter"], tmp_path / "out", base=str(tmp_path / "base64"))
    msg = str(err.value)
    assert "trained for a base with hidden size 128" in msg and "model with 64" in msg and "fix:" in msg
    assert not (tmp_path / "out").exists()


def test_base_without_the_target_modules(tiny, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(
        GPT2Config(vocab_size=512, n_embd=32, n_layer=1, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0)
    ).save_pretrained(str(tmp_path / "gpt2"))
    with pytest.raises(FtError, match="the base has no module model.layers"):
        merge_lora(tiny["adapter"], tmp_path / "out", base=str(tmp_path / "gpt2"))


def test_base_with_more_layers(tiny, tmp_path):
    # ft-tiny's sizes, 6 layers not 4
    deeper = _llama(tmp_path / "deeper", hidden=128, intermediate=384, layers=6, head_dim=32)
    with pytest.raises(FtError, match="has no weights for .* adapter modules"):
        merge_lora(tiny["adapter"], tmp_path / "out", base=str(deeper))


def test_refusals(tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FtError, match="(?s)not empty.*--overwrite"):
        merge_lora(tiny["adapter"], out)
    assert (out / "keep.txt").is_file()
    (tmp_path / "weights_only").mkdir()
    shutil.copy(tiny["adapter"] / "adapter_model.safetensors", tmp_path / "weights_only")
    with pytest.raises(FtError, match="no adapter_config.json"):
        merge_lora(tmp_path / "weights_only", tmp_path / "o2")
    with pytest.raises(FtError, match="neither an adapter folder nor an ft run folder"):
        merge_lora(tmp_path / "out", tmp_path / "o3")
    with pytest.raises(FtError, match="full model"):
        merge_lora(tiny["base"], tmp_path / "o4")
    with pytest.raises(FtError, match="dtype"):
        merge_lora(tiny["adapter"], tmp_path / "o5", dtype="int4")
    with pytest.raises(FtError, match="merge reads"):
        merge_lora(tiny["adapter"], tiny["adapter"], overwrite=True)


def test_overwrite_never_replaces_a_run_folder(tiny, tmp_path):
    run = tmp_path / "other-run"
    (run / "checkpoints" / "step-00000010").mkdir(parents=True)
    (run / ".ft-run").write_text("marker")
    (run / "config.yaml").write_text("model: {name: ft-tiny}\n")
    with pytest.raises(FtError, match="(?s)is an ft run folder.*new folder"):
        merge_lora(tiny["adapter"], run, overwrite=True, check_inputs=0)
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "step-00000010").is_dir()


def test_overwrite_replaces_and_failure_leaves_nothing(tiny, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("x")
    merge_lora(tiny["adapter"], out, overwrite=True, check_inputs=0)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()

    import finetune.merge as merge

    def broken_save(model, tokenizer, tmp, max_shard_size, processor=None):
        (tmp / "model.safetensors").write_text("half")
        raise OSError("disk full")

    monkeypatch.setattr(merge, "_save", broken_save)  # our own function, to simulate a failed write
    with pytest.raises(OSError):
        merge_lora(tiny["adapter"], tmp_path / "new")
    assert not (tmp_path / "new").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp folder left behind


def test_full_run_refused(tmp_path):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "config.yaml").write_text("model: {name: x}\nadapter: {type: auto}\n")
    (run / "plan.json").write_text(json.dumps({"adapter": "full"}))
    with pytest.raises(FtError, match="trained all weights"):
        merge_lora(run, tmp_path / "out")


def _bnb_4bit_works() -> bool:
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig  # noqa: F401
    except Exception:
        return False
    return True


def _llama(folder: Path, hidden: int, intermediate: int, layers: int = 2, head_dim: int | None = None) -> Path:
    """A tiny Llama with the given sizes (random weights, the tiny tokenizer's vocabulary size)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim or hidden // 4,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=1,
    )
    LlamaForCausalLM(cfg).save_pretrained(str(folder))
    return folder


@pytest.mark.skipif(
    not _bnb_4bit_works(), reason="bitsandbytes 4-bit is not available here; the QLoRA merge is checked where it is"
)
def test_qlora_adapter_merges_into_unquantized_base(tmp_path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    # bitsandbytes' CPU 4-bit matmul needs every input size to be a multiple of its block size (64)
    base = _llama(tmp_path / "base", hidden=128, intermediate=256)
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    base4 = AutoModelForCausalLM.from_pretrained(str(base), quantization_config=quant, dtype=torch.float32).eval()
    quant_error = (_logits(base4) - _logits(_load(base))).abs().max().item()  # 4-bit vs fp32 base, no adapter
    peft4 = _perturbed_lora(base4, seed=2)
    ref4 = _logits(peft4)
    run = tmp_path / "run"
    peft4.save_pretrained(str(run / "final"))
    (run / "config.yaml").write_text(f"model: {{name: {base}}}\nadapter: {{type: auto}}\n")
    (run / "plan.json").write_text(json.dumps({"adapter": "qlora", "quantization": "nf4"}))  # the plan resolved auto
    report = merge_lora(run, tmp_path / "out")
    assert report.qlora and report.dtype == "fp32" and "dequantized" in str(report)
    merged = _load(tmp_path / "out")
    diff = (_logits(merged) - ref4).abs().max().item()
    without = (_logits(_load(base)) - ref4).abs().max().item()
    print(
        f"qlora: report max_abs_logit_diff={report.max_abs_logit_diff:.3g}, merged fp32 vs 4-bit+adapter={diff:.3g}, "
        f"4-bit vs fp32 base={quant_error:.3g}, fp32 base without adapter vs 4-bit+adapter={without:.3g}"
    )
    assert report.max_abs_logit_diff < 1e-4
    assert diff < 2 * quant_error + 1e-3  # what separates them is the quantization error of the base
    assert diff < 0.5 * without  # and the adapter is in the merged weights
    assert not any("lora" in k or "absmax" in k for k in merged.state_dict())
