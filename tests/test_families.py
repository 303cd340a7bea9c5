"""Every decoder family ft supports, as a tiny random model built from transformers' own config class: packed rows keep
samples apart (a packed sample's logits equal the sample's alone) through the attention the planner chooses, a family
that cannot pack on this machine is refused by `ft plan` with the key and the install line, the model class table
matches the installed transformers, and each family trains end to end (LoRA: loss falls, the adapter reloads, the
merge gives the same logits, `ft generate` runs; full fine-tuning and QLoRA: loss falls)."""

from __future__ import annotations

import json

import pytest
import torch

from finetune.errors import PlanError
from tests.helpers import JobText, write_job

BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
LINEAR = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
SLIDING = dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"])
MLA = dict(q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, head_dim=16)
GROUPED = dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
# model_type -> its config's own keys (windows and chunks shorter than the packed rows, so that packing can leak)
TEXT = {
    "llama": {},
    "mistral": dict(sliding_window=16),
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": MOE,
    "qwen3_next": dict(**MOE, **LINEAR, shared_expert_intermediate_size=64),
    "qwen3_5_text": LINEAR,
    "qwen3_5_moe_text": dict(**MOE, **LINEAR, shared_expert_intermediate_size=64),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, **SLIDING),
    "deepseek_v3": dict(**MLA, **GROUPED, num_experts_per_tok=2, moe_intermediate_size=64, num_key_value_heads=2),
    "llama4_text": dict(
        num_local_experts=4,
        num_experts_per_tok=1,
        intermediate_size_mlp=128,
        interleave_moe_layer_step=2,
        attention_chunk_size=16,
        no_rope_layer_interval=2,
    ),
    "gemma2": dict(query_pre_attn_scalar=32, **SLIDING),
    "gemma3_text": dict(query_pre_attn_scalar=32, **SLIDING),
    "gemma4_text": dict(vocab_size_per_layer_input=512, hidden_size_per_layer_input=64, **SLIDING),
    "glm4_moe": dict(**GROUPED, num_experts_per_tok=2, moe_intermediate_size=64),
    "olmo2": {},
    "olmo3": dict(sliding_window=16),
    "smollm3": {},
    "phi3": {},
    "granitemoehybrid": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=64,
        layer_types=["linear_attention", "full_attention"],
        mamba_n_heads=4,
        mamba_d_state=16,
        mamba_d_head=32,
        mamba_chunk_size=16,
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}
# multimodal wrappers: model_type -> (the text tower's model_type, the wrapper's own keys); ft trains the text
VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, patch_size=8)
WRAPPERS = {
    "gemma3": ("gemma3_text", dict(vision_config=dict(model_type="siglip_vision_model", image_size=32, **VISION))),
    "gemma4": (
        "gemma4_text",
        dict(vision_config=dict(num_key_value_heads=2, head_dim=32, **VISION), audio_config=None),
    ),
    "qwen3_5": ("qwen3_5_text", {}),
    "qwen3_5_moe": ("qwen3_5_moe_text", {}),
}
FAMILIES = [*TEXT, *WRAPPERS]
# trained end to end: the text configs of qwen3_5 and qwen3_5_moe build the same classes as their wrappers' configs
TRAINED = [f for f in FAMILIES if f not in ("qwen3_5_text", "qwen3_5_moe_text")]
PACKS_ON_CPU = [f for f in FAMILIES if "linear_attention" not in TEXT[WRAPPERS.get(f, (f,))[0]].get("layer_types", ())]


def tiny_config(family: str, tokenizer, **overrides):
    """transformers' config of a tiny `family` model, with the tokenizer's vocabulary and special ids."""
    from transformers import AutoConfig

    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    if family in WRAPPERS:
        inner, outer = WRAPPERS[family]
        text = {**BASE, "vocab_size": len(tokenizer), **ids, **TEXT[inner], **overrides, "model_type": inner}
        return AutoConfig.for_model(family, text_config=text, **outer, tie_word_embeddings=False)
    return AutoConfig.for_model(family, **{**BASE, "vocab_size": len(tokenizer), **ids, **TEXT[family], **overrides})


def build_family(folder, family: str, seed: int = 0, **overrides):
    """Save a tiny random `family` model with ft's tiny tokenizer to `folder`; returns the folder."""
    from transformers import AutoModelForCausalLM

    from finetune.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, tokenizer, **overrides))
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> its tiny model's folder, built on first use."""
    root, built = tmp_path_factory.mktemp("families"), {}

    def get(family: str, **overrides):
        key = family + (f"-{abs(hash(repr(sorted(overrides.items()))))}" if overrides else "")
        if key not in built:
            built[key] = build_family(root / key, family, **overrides)
        return built[key]

    return get


def job_yaml(tmp_path, folder, adapter: str = "lora", packing: bool = True, steps: int = 8, out: str = "run") -> str:
    """A one-process job on the tiny model in `folder`: 64 arithmetic rows, 8 a step, seq_len 64; the adapter
    as ft's defaults have it (LoRA: `{type: lora}` with only a higher learning rate, so that the loss visibly falls)."""
    from finetune.tiny import arithmetic_records, write_jsonl

    data = write_jsonl(arithmetic_records(64, seed=3), tmp_path / "rows.jsonl")
    lr = 3.0e-3 if adapter == "full" else 2.0e-2
    return JobText(f"""
model: {{name: {folder}}}
data: {{datasets: [{{path: {data}, format: chat}}], seq_len: 64, packing: {str(packing).lower()},
  cache_dir: {tmp_path / "cache"}}}
adapter: {{type: {adapter}}}
train: {{global_batch_size: 8, micro_batch_size: 8, max_steps: {steps}, lr: {lr}, warmup_steps: 1}}
output: {{dir: {tmp_path / out}, log_steps: 1, save_steps: 0}}
""")


def planned(tmp_path, folder, *overrides: str):
    """(config, plan) of the tiny job on this CPU, as `ft plan` makes them."""
    from finetune.config import load
    from finetune.hardware import parse
    from finetune.plan import plan
    from finetune.workflow import model_facts

    config = load(write_job(tmp_path, job_yaml(tmp_path, folder)), list(overrides))
    return config, plan(config, parse("cpu"), model_facts(config.model))


# ---------------------------------------------------------------- the model class table
@pytest.mark.slow
def test_model_class_table_matches_the_installed_transformers():
    """finetune/model_classes.json is what reading each class gives today (rewrite it with
    `python -m finetune.model_class`)."""
    from finetune.model_class import CLASSES, TABLE_TYPES, table_row

    assert set(CLASSES) == set(TABLE_TYPES)
    rows = {t: table_row(t) for t in TABLE_TYPES}
    stale = {t: row for t, row in rows.items() if row != CLASSES[t]}
    assert not stale, f"stale rows, rewrite with `python -m finetune.model_class`: {stale}"


def test_the_model_class_table_ships_as_package_data():
    """The table is a data file of the package, listed next to the catalog in pyproject.toml's package-data."""
    import tomllib

    from finetune.model_class import TABLE_FILE
    from tests.helpers import REPO

    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["finetune"]
    assert TABLE_FILE in data and "catalog.yaml" in data
    assert json.loads((REPO / "finetune" / TABLE_FILE).read_text())["classes"]["gpt_oss"]["name"] == "GptOssForCausalLM"


def test_the_class_facts_that_decide_attention():
    """What the table says of the classes whose attention differs from llama's (read from transformers 5.24)."""
    from finetune.model_class import CLASSES

    assert not CLASSES["gpt_oss"]["sdpa"] and CLASSES["gpt_oss"]["sinks"] and not CLASSES["gpt_oss"]["flash"]
    assert not CLASSES["gemma2"]["sdpa"] and not CLASSES["gemma2"]["sinks"]
    assert not CLASSES["qwen3_5"]["flex"] and CLASSES["qwen3_5"]["mixers"] == ["gated_delta_net"]
    assert CLASSES["granitemoehybrid"]["mixers"] == ["mamba"]
    assert not CLASSES["gemma3"]["flash"] and CLASSES["gemma3_text"]["flash"]  # the wrapper declares no flash
    assert CLASSES["llama4_text"]["chunk_size"] == 8192 and not CLASSES["llama4_text"]["flash"]


# ---------------------------------------------------------------- packing keeps samples apart
LENGTHS = [[20, 30, 9], [40, 17]]  # longer than the 16-token windows and chunks of the tiny configs


def packed_rows(seed: int = 1):
    """Two packed rows of random tokens, and each row's samples."""
    gen = torch.Generator().manual_seed(seed)
    rows, samples = [], []
    for lens in LENGTHS:
        parts = [torch.randint(2, 400, (n,), generator=gen) for n in lens]  # the tiny vocabulary: 421
        ids = torch.cat(parts).tolist()
        rows.append({"input_ids": ids, "labels": ids, "seq_lens": lens})
        samples.append(parts)
    return rows, samples


def split_logits(model, batch: dict, samples) -> list[torch.Tensor]:
    """The logits of each sample in the packed forward pass, in order (varlen batches are one row)."""
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    out, flat = [], logits.shape[0] == 1 and len(samples) > 1
    start = 0
    for r, parts in enumerate(samples):
        start = start if flat else 0
        for part in parts:
            out.append(logits[0 if flat else r, start : start + len(part)])
            start += len(part)
    return out


ATTENTION_ONLY = dict(layer_types=["full_attention", "full_attention"])  # a hybrid family's config without its mixers
PACKING_CASES = [(f, {}) for f in PACKS_ON_CPU] + [("granitemoehybrid", ATTENTION_ONLY)]


@pytest.mark.parametrize(
    ("family", "overrides"), PACKING_CASES, ids=[f"{f}{'-attention' * bool(o)}" for f, o in PACKING_CASES]
)
def test_a_packed_sample_has_the_logits_of_the_sample_alone(family, overrides, folders, tmp_path):
    """Through the attention `ft plan` chooses for packed rows (and the masks it plans), each sample of a packed row
    gets exactly the logits it gets alone; the same rows with every token seeing the whole row differ (the check can
    see a leak)."""
    from transformers import AutoModelForCausalLM

    from finetune.data.collate import collate
    from finetune.models import register_attention

    folder = folders(family, **overrides)
    _, p = planned(tmp_path, folder)
    register_attention(p.attn_implementation)
    model = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation=p.attn_implementation)
    model.eval().config.use_cache = False
    rows, samples = packed_rows()
    batch = collate(rows, 0, p.attn_implementation, masks=p.attention_masks, sample_index=p.sample_index)
    leaky = collate([{k: v for k, v in r.items() if k != "seq_lens"} for r in rows], 0, "sdpa")
    with torch.no_grad():
        packed = split_logits(model, batch, samples)
        alone = [model(input_ids=s[None]).logits[0] for parts in samples for s in parts]
        mixed = split_logits(model, leaky, samples)
    worst = max((a - b).abs().max().item() for a, b in zip(packed, alone))
    assert worst < 1e-4, f"{family} on {p.attn_implementation} {p.attention_masks}: packed differs by {worst:.3g}"
    assert max((a - b).abs().max().item() for a, b in zip(mixed, alone)) > 1e-3


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in PACKS_ON_CPU])
def test_packing_state_space_layers_on_cpu_is_refused_by_ft_plan(family, folders, tmp_path):
    """Gated delta nets and Mamba layers keep packed samples apart only with their CUDA kernels: on this CPU `ft plan`
    refuses data.packing with the install line, and plans the same model unpacked."""
    with pytest.raises(
        PlanError, match=r"data\.packing: .* set data\.packing: false, or train on GPUs with `pip install"
    ):
        planned(tmp_path, folders(family))
    _, p = planned(tmp_path, folders(family), "data.packing=false")
    assert p.attn_implementation == "sdpa" and not p.sample_index


# ---------------------------------------------------------------- training end to end
def trained_family(tmp_path, folder, adapter: str, packing: bool, out: str):
    from tests.helpers import losses, train_here

    train_here(write_job(tmp_path, job_yaml(tmp_path, folder, adapter, packing, out=out), f"{out}.yaml"))
    return tmp_path / out, losses(tmp_path / out)


def generated(tmp_path, run) -> list[dict]:
    """`ft generate` of two chat prompts with the run's model, in this process; the output rows."""
    from finetune.infer.commands import GenerateOptions, run_generate
    from finetune.tiny import write_jsonl

    prompts = write_jsonl([{"messages": [{"role": "user", "content": "What is 2 + 3?"}]}] * 2, tmp_path / "p.jsonl")
    run_generate(
        GenerateOptions(str(run), str(prompts), str(tmp_path / "gen.jsonl"), max_new_tokens=4, processes=1, quiet=True)
    )
    return [json.loads(line) for line in (tmp_path / "gen.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("family", TRAINED)
def test_lora_trains_reloads_merges_and_generates(family, folders, tmp_path):
    """LoRA with ft's defaults (packed rows where the family packs here): the loss falls, the saved adapter reloads onto
    the base and changes its logits, `ft merge-lora` gives those logits, and `ft generate` answers from the run."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from finetune.merge import merge_lora

    run, seen = trained_family(tmp_path, folders(family), "lora", family in PACKS_ON_CPU, "lora")
    assert seen[-1] < seen[0], seen
    tokens = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])  # below the tiny vocabulary's 421
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(str(folders(family))).eval()
        before = base(input_ids=tokens).logits
        adapted = PeftModel.from_pretrained(base, str(run / "final")).eval()(input_ids=tokens).logits
        report = merge_lora(run, tmp_path / "merged")
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()(input_ids=tokens).logits
    assert (adapted - before).abs().max() > 1e-3  # the adapter that reloaded is the trained one
    assert report.max_abs_logit_diff < 5e-4 and (merged - adapted).abs().max() < 5e-4  # fp32 rounding
    rows = generated(tmp_path, run)
    assert len(rows) == 2 and all(isinstance(r["completion"], str) for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["full", "qlora"])
@pytest.mark.parametrize("family", TRAINED)
def test_full_and_qlora_train(family, adapter, folders, tmp_path):
    """Full fine-tuning and QLoRA (a 4-bit base on this CPU) train every family: the loss falls; `ft generate`
    answers from the QLoRA run."""
    run, seen = trained_family(tmp_path, folders(family), adapter, family in PACKS_ON_CPU, adapter)
    assert seen[-1] < seen[0], seen
    if adapter == "qlora":
        assert len(generated(tmp_path, run)) == 2


@pytest.mark.slow
def test_a_run_of_a_class_without_sdpa_consolidates_merges_and_generates(folders, tmp_path):
    """gpt-oss has no SDPA (attention sinks) and trains with eager here: `ft consolidate` builds the model with the
    attention of the run's plan and writes the trained adapter of its step-2 checkpoint; `ft merge-lora` and
    `ft generate` load the run with the kernel transformers picks for the class (eager where SDPA is unsupported)."""
    from safetensors.torch import load_file

    from finetune.consolidate import consolidate
    from finetune.merge import merge_lora
    from tests.helpers import train_here

    text = job_yaml(tmp_path, folders("gpt_oss"), steps=3).replace("save_steps: 0", "save_steps: 2")
    train_here(write_job(tmp_path, text))
    run = tmp_path / "run"
    assert json.loads((run / "plan.json").read_text())["attn_implementation"] == "eager"
    out = consolidate(run)
    consolidated, final = (load_file(str(d / "adapter_model.safetensors")) for d in (out, run / "final"))
    assert {k: v.shape for k, v in consolidated.items()} == {k: v.shape for k, v in final.items()}
    assert any(v.abs().max() > 0 for k, v in consolidated.items() if "lora_B" in k)  # trained: B starts at zero
    assert merge_lora(run, tmp_path / "merged").max_abs_logit_diff < 5e-4
    assert len(generated(tmp_path, run)) == 2


# ---------------------------------------------------------------- the planner's choice, on described classes
def choose(mc, *overrides: str, hardware: str = "cpu", cp: int = 1):
    """plan/attention.py's choice for the described class under MINIMAL with `overrides` (packing on)."""
    from finetune.config import loads
    from finetune.hardware import parse
    from finetune.plan.attention import choose_attention
    from tests.helpers import MINIMAL

    decisions = []
    choice = choose_attention(loads(MINIMAL, overrides=list(overrides), environ={}), parse(hardware), mc, cp, decisions)
    return choice, next(d for d in decisions if d.field == "attn_implementation")


def described(**facts):
    from finetune.model_class import ModelClass

    return ModelClass("x", "XForCausalLM", **facts)


SINKS = dict(
    sdpa=False, sinks=True, flash=False, layer_types=("sliding_attention", "full_attention"), sliding_window=128
)
HYBRID = dict(mixers=("gated_delta_net",), layer_types=("linear_attention", "full_attention"))


def test_sinks_take_flex_on_gpus_and_eager_on_cpu_with_a_mask_per_layer_type():
    gpu, why = choose(described(**SINKS), "data.packing=false", hardware="1xH100-80GB")
    assert gpu.kernel == "flex_attention" and "attention sinks" in why.reason and not gpu.flash_upgrade
    cpu, why = choose(described(**SINKS), "data.packing=false")
    assert cpu.kernel == "eager" and "cannot run attention sinks on CPU" in why.reason
    dropout, _ = choose(described(**SINKS, attention_dropout=0.1), "data.packing=false", hardware="1xH100-80GB")
    assert dropout.kernel == "eager"  # transformers' flex_attention refuses dropout in training
    packed, why = choose(described(**SINKS))  # MINIMAL: seq_len 2048, longer than the 128-token window
    assert packed.kernel == "eager" and packed.masks == {"sliding_attention": {"window": 128}, "full_attention": {}}
    assert "128-token sliding window" in why.reason


def test_windows_and_chunks_no_shorter_than_a_row_are_full_attention():
    llama4 = dict(layer_types=("chunked_attention", "full_attention"), chunk_size=8192, flash=False)
    short, _ = choose(described(**llama4))
    assert short.kernel == "sdpa_varlen" and not short.flash_upgrade  # 2048-token rows: chunks of 8192 are whole
    long, why = choose(described(**llama4), "data.seq_len=16384")
    assert long.kernel == "sdpa" and long.masks == {"chunked_attention": {"chunk": 8192}, "full_attention": {}}
    assert "chunks of 8192 tokens" in why.reason
    window = dict(sdpa=False, layer_types=("sliding_attention", "full_attention"), sliding_window=4096)
    assert choose(described(**window))[0].masks == {}  # gemma2's 4096-token window covers 2048-token rows
    mistral = dict(layer_types=("sliding_attention",), sliding_window=16)
    assert choose(described(**mistral), "model.attn_implementation=eager")[0].masks == {
        "sliding_attention": {"window": 16}
    }


def test_state_space_layers_pack_only_with_their_kernels_on_gpus(monkeypatch):
    from dataclasses import replace

    with pytest.raises(PlanError, match=r"data\.packing: .*gated_delta_net.* on CPU .*pip install flash-linear-atte"):
        choose(described(**HYBRID))
    with pytest.raises(PlanError, match=r"without flash-linear-attention, causal-conv1d .*`pip install flash-linear"):
        choose(described(**HYBRID), hardware="1xH100-80GB")
    ready = replace(described(**HYBRID), kernels_installed=("causal-conv1d", "flash-linear-attention"))
    choice, why = choose(ready, hardware="1xH100-80GB")
    assert choice.kernel == "sdpa_varlen" and choice.sample_index and "sample index" in why.reason
    with pytest.raises(PlanError, match=r"model\.attn_implementation: eager: packed rows .* need sample boundaries"):
        choose(ready, "model.attn_implementation=eager", hardware="1xH100-80GB")
    assert not choose(described(**HYBRID), "data.packing=false")[0].sample_index


@pytest.mark.parametrize(
    ("facts", "overrides", "hardware", "cp", "needle"),
    [
        (SINKS, ["model.attn_implementation=sdpa"], "cpu", 1, r"model\.attn_implementation: sdpa: XForCausalLM does"),
        (SINKS, ["model.attn_implementation=sdpa_varlen"], "cpu", 1, r"set it to auto \(ft picks eager here\)"),
        ({}, ["model.attn_implementation=flash_attention_2"], "cpu", 1, r"flash_attention_2: it needs a CUDA GPU"),
        (dict(flash=False), ["model.attn_implementation=flash_attention_2"], "1xH100-80GB", 1, r"does not support fl"),
        (
            dict(layer_types=("chunked_attention",), chunk_size=16),
            ["model.attn_implementation=sdpa_varlen"],
            "cpu",
            1,
            r"sdpa_varlen: XForCausalLM attends in chunks of 16 tokens",
        ),
        (SINKS, ["data.packing=false"], "cpu", 2, r"distributed\.context_parallel: 2 runs torch's ring attention"),
    ],
)
def test_what_the_class_cannot_run_is_refused_with_the_key_and_the_fix(facts, overrides, hardware, cp, needle):
    with pytest.raises(PlanError, match=needle):
        choose(described(**facts), *overrides, hardware=hardware, cp=cp)


def test_sliding_window_rows_of_sdpa_varlen_equal_masked_sdpa():
    """ft's sdpa_varlen on a sliding-window layer (the window its attention module passes) attends as transformers'
    sliding-window mask does: query i sees the `window` keys up to i of its own sample."""
    import torch.nn.functional as F

    from finetune.attention import sdpa_varlen_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 30, 8, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 12, 30], dtype=torch.int32)
    out, _ = sdpa_varlen_attention(torch.nn.Module().eval(), q, k, v, None, cu_seq_lens_q=cu, sliding_window=4)
    i = torch.arange(30)
    same = (i[:, None] < 12) == (i[None, :] < 12)
    allowed = same & (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 4)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2)
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="sinks"):
        sdpa_varlen_attention(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=cu, s_aux=torch.zeros(2))


# ---------------------------------------------------------------- estimates and parallelism of the chosen attention
def catalog_plan(model, hardware: str, *overrides: str):
    """The plan of AUTO for a catalog model (or ModelFacts) on described hardware."""
    from finetune.catalog import lookup
    from finetune.config import loads
    from finetune.hardware import parse
    from finetune.plan import plan
    from tests.helpers import MINIMAL

    facts = lookup(model) if isinstance(model, str) else model
    auto = MINIMAL.replace(
        "adapter: {type: lora, r: 16, alpha: 32, target_modules: all-linear}", "adapter: {type: auto}"
    )
    config = loads(auto, overrides=[f"model.name={facts.name}", *overrides], environ={})
    return plan(config, parse(hardware), facts)


LONG_ROWS = ("data.seq_len=4096", "data.packing=false", "train.micro_batch_size=1", "train.global_batch_size=8")


@pytest.mark.parametrize(("hardware", "kernel"), [("cpu,host=512GiB", "eager"), ("1xH100-80GB", "flex_attention")])
def test_the_estimate_counts_the_attention_the_planner_chooses_not_the_configs_auto(hardware, kernel):
    """gpt-oss has no SDPA (attention sinks): with model.attn_implementation auto ft runs eager on CPU and flex on GPUs,
    and the estimate counts that kernel against a twin whose class has SDPA (the same shape as a llama): eager's T×T
    scores and probabilities in every stored layer, and their memory traffic in the step time; flex's block masks (one
    per layer type: sliding and full)."""
    from dataclasses import replace

    from finetune.catalog import lookup

    gpt_oss = lookup("openai/gpt-oss-20b")
    chosen = catalog_plan(gpt_oss, hardware, *LONG_ROWS, "train.gradient_checkpointing=false")
    twin = catalog_plan(
        replace(gpt_oss, model_type="llama"), hardware, *LONG_ROWS, "train.gradient_checkpointing=false"
    )
    assert chosen.attn_implementation == kernel
    assert twin.attn_implementation in ("sdpa", "sdpa_varlen")  # SDPA, padded or padding-free (plan/attention.py)
    assert (chosen.micro_batch_size, chosen.checkpoint_layers) == (twin.micro_batch_size, twin.checkpoint_layers)
    gap = chosen.estimate.device["activations"] - twin.estimate.device["activations"]
    if kernel == "eager":
        a = 4 if chosen.precision == "fp32" else 2
        k = chosen.checkpoint_layers
        layers = gpt_oss.num_layers - k + (1 if k else 0)  # stored layers, and the one recomputed
        assert gap == layers * 4096 * 4096 * gpt_oss.num_attention_heads * (2 * a + 4)
        assert chosen.step_seconds["eager scores"] > 0 and "eager scores" not in twin.step_seconds
    else:
        assert gap == 2 * 4 * 4 * (4096 // 128) ** 2  # two block masks of four int32 (32 x 32) index tensors
        assert chosen.step_seconds == twin.step_seconds


def test_context_parallelism_follows_the_attention_the_class_supports():
    """Ring attention replaces SDPA only: at 32k tokens on 8 GPUs auto splits llama's sequences but never gpt-oss's
    (it says why), and an explicit degree for gpt-oss is refused by `ft plan` with the key and the reason."""
    rows = ("data.seq_len=32768", "data.packing=false", "train.global_batch_size=8")
    assert catalog_plan("meta-llama/Llama-3.1-8B", "8xH100-80GB", *rows).context_parallel > 1
    auto = catalog_plan("openai/gpt-oss-20b", "8xH100-80GB", *rows)
    assert auto.context_parallel == 1 and auto.attn_implementation == "flex_attention"
    assert "GptOssForCausalLM does not support SDPA" in auto.decision("context_parallel").reason
    with pytest.raises(PlanError, match=r"distributed\.context_parallel: 2: GptOssForCausalLM does not support SDPA"):
        catalog_plan("openai/gpt-oss-20b", "8xH100-80GB", *rows, "distributed.context_parallel=2")
