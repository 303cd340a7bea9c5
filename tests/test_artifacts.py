"""finetune.artifacts: what each kind of SOURCE resolves to (run folder, model folder, adapter folder, hub id,
ft-tiny), where an adapter's base comes from, and loading: tokenizer, fit check, attach and merge."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from finetune.artifacts import (
    AdapterSource,
    ModelSource,
    RunFolder,
    check_fits,
    find_adapter,
    find_tokenizer,
    first_line,
    load_model,
    load_tokenizer,
    resolve,
)
from finetune.errors import FtError
from tests.helpers import random_llama

TOKENS = torch.arange(2, 14).reshape(2, 6)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits.float()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{base, adapter, ref}: a tiny Llama, a LoRA adapter on it saved by peft (its B matrices random, so it changes the
    outputs), and the logits of base+adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("artifacts")
    random_llama(root / "base", hidden=32, layers=1, intermediate=64, heads=2)
    base = AutoModelForCausalLM.from_pretrained(str(root / "base"), dtype=torch.float32).eval()
    plain = _logits(base)
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    ref = _logits(peft_model.eval())
    assert (ref - plain).abs().max() > 1e-3, "the adapter must change the outputs for the test to mean anything"
    peft_model.save_pretrained(str(root / "adapter"))
    return {"root": root, "base": root / "base", "adapter": root / "adapter", "ref": ref}


def _run(root, final_from, config: str, plan: dict | None = None):
    """A run folder as ft train leaves it: config.yaml, plan.json and final/ (a copy of `final_from`)."""
    run = root / "run"
    shutil.copytree(final_from, run / "final")
    (run / "config.yaml").write_text(config)
    (run / "plan.json").write_text(json.dumps(plan or {}))
    return run


# ---------------------------------------------------------------- what a SOURCE names
def test_a_model_folder_is_the_model(models):
    src = resolve(str(models["base"]))
    assert src == ModelSource(str(models["base"]), None, (), "tokenizer", str(models["base"]), False)
    assert src.describe() == str(models["base"])
    with pytest.raises(FtError, match="--base is for adapters, but .* holds a full model"):
        resolve(str(models["base"]), base=str(models["base"]))


def test_an_adapter_folder_finds_its_base_in_adapter_config(models):
    src = resolve(str(models["adapter"]))
    assert (src.model, src.adapter, src.template) == (str(models["base"]), str(models["adapter"]), "tokenizer")
    assert src.where == f"base_model_name_or_path in {models['adapter'] / 'adapter_config.json'}"
    assert src.tokenizer_dirs == (str(models["adapter"]),)
    given = resolve(str(models["adapter"]), base=str(models["base"]))
    assert given.model == str(models["base"]) and given.where == "--base"


def test_an_adapter_that_names_no_base_needs_base(models, tmp_path):
    adapter = shutil.copytree(models["adapter"], tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    with pytest.raises(FtError, match="(?s)does not name its base model.*fix: pass --base"):
        resolve(str(adapter))
    with pytest.raises(FtError, match="the base model folder ./no/such does not exist"):
        resolve(str(adapter), base="./no/such")
    assert resolve(str(adapter), base=str(models["base"])).model == str(models["base"])


def test_a_run_folder_with_an_adapter_takes_the_runs_base_and_template(models, tmp_path, monkeypatch):
    monkeypatch.setenv("FT_TEST_BASE", str(models["base"]))
    run = _run(
        tmp_path,
        models["adapter"],
        "model: {name: '${FT_TEST_BASE}', trust_remote_code: true}\nadapter: {type: lora}\ndata: {template: chatml}\n",
        {"adapter": "lora"},
    )
    src = resolve(str(run))
    assert (src.model, src.adapter, src.template) == (str(models["base"]), str(run / "final"), "chatml")
    assert src.where == f"model.name in {run / 'config.yaml'}"
    assert src.trust_remote_code is False  # the run's config.yaml says true: only the invocation decides
    assert resolve(str(run), trust_remote_code=True).trust_remote_code is True
    adapter = find_adapter(run)
    assert adapter.run == run and adapter.adapter == run / "final" and not adapter.qlora
    assert adapter.run_config["model"]["name"] == str(models["base"])  # ${VAR} expanded from this environment


def test_a_run_folder_with_a_full_model_is_that_model(models, tmp_path):
    run = _run(tmp_path, models["base"], "model: {name: ft-tiny}\nadapter: {type: full}\n", {"adapter": "full"})
    assert resolve(str(run)) == ModelSource(str(run / "final"), None, (), "tokenizer", str(run / "final"), False)
    with pytest.raises(FtError, match="trained all weights"):
        find_adapter(run)
    shutil.rmtree(run / "final")
    with pytest.raises(FtError, match="no final/ folder: training has not finished"):
        resolve(str(run))


def test_hub_ids_ft_tiny_and_missing_folders():
    from finetune.tiny import ensure_model

    assert resolve("org/some-model") == ModelSource("org/some-model", None, (), "tokenizer", "the model argument")
    assert resolve("ft-tiny").model == str(ensure_model())
    with pytest.raises(FtError, match="--base is for adapters, but org/some-model names a model"):
        resolve("org/some-model", base="x")
    with pytest.raises(FtError, match="no such folder"):
        resolve("./no/such/folder")


def test_find_adapter_refuses_what_is_not_an_adapter(models, tmp_path):
    with pytest.raises(FtError, match="full model, there is nothing to merge"):
        find_adapter(models["base"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FtError, match="neither an adapter folder nor an ft run folder"):
        find_adapter(tmp_path / "empty")
    weights = shutil.copytree(models["adapter"], tmp_path / "weights")
    (weights / "adapter_model.safetensors").unlink()
    with pytest.raises(FtError, match="no adapter_model.safetensors"):
        find_adapter(weights)


@pytest.mark.parametrize(
    "config, plan, expected",
    [
        ({"adapter": {"type": "qlora"}}, {}, True),
        ({"adapter": {"type": "lora"}, "quantization": {"type": "nf4"}}, {}, True),
        ({"adapter": {"type": "auto"}}, {"adapter": "qlora", "quantization": "nf4"}, True),
        (
            {"adapter": {"type": "lora"}, "quantization": {"type": "none"}},
            {"adapter": "lora", "quantization": "none"},
            False,
        ),
        ({}, {}, False),
    ],
)
def test_qlora_detection(config, plan, expected, tmp_path):
    """Moved from tests/test_merge.py with the detection it tests."""
    src = AdapterSource(adapter=tmp_path, run=tmp_path, run_config=config, run_plan=plan, tokenizer_dirs=())
    assert src.qlora is expected


def test_run_folder_paths(tmp_path):
    run = RunFolder(tmp_path)
    assert (run.config_path, run.final, run.checkpoint(12)) == (
        tmp_path / "config.yaml",
        tmp_path / "final",
        tmp_path / "checkpoints" / "step-00000012",
    )
    assert run.plan_dict() == {} and not run.is_run()


# ---------------------------------------------------------------- loading
def test_an_adapter_source_loads_merged_into_its_base(models):
    src = resolve(str(models["adapter"]))
    tokenizer = load_tokenizer(src)
    assert tokenizer.pad_token_id is not None
    model = load_model(src, tokenizer, torch.float32, torch.device("cpu"))
    assert not any("lora" in k for k in model.state_dict())
    assert (_logits(model) - models["ref"]).abs().max() < 1e-4


def test_find_tokenizer_takes_the_first_folder_that_has_one(models, tmp_path):
    (tmp_path / "none").mkdir()
    _, where = find_tokenizer([tmp_path / "none", models["base"]], "org/unused", False)
    assert where == str(models["base"])
    assert find_tokenizer([tmp_path / "none"], str(tmp_path / "none"), False) == (None, "")


def test_an_adapter_that_does_not_fit_its_base_is_explained(models, tmp_path):
    from transformers import AutoModelForCausalLM

    random_llama(tmp_path / "wider", hidden=64, layers=1, intermediate=64, heads=2)
    wider = AutoModelForCausalLM.from_pretrained(str(tmp_path / "wider"))
    with pytest.raises(FtError) as err:
        check_fits(wider, models["adapter"], str(tmp_path / "wider"), "--base")
    assert "trained for a base with hidden size 32; --base points at a model with 64" in str(err.value)
    check_fits(AutoModelForCausalLM.from_pretrained(str(models["base"])), models["adapter"], "base", "--base")


def test_first_line():
    assert first_line(ValueError("\n  one\ntwo")) == "one"
    assert first_line(RuntimeError("x\nsize mismatch a\nsize mismatch b")) == "size mismatch a (and 1 more)"
    assert first_line(KeyError()) == "KeyError"
