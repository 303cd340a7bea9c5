"""LoRA on mixture-of-experts models, and their router's numerics (finetune/experts.py, finetune/methods/router.py).

Tiny random models of each family with fused experts (hidden 64, 2 layers, 4 experts), built from transformers' own
config classes: what `all-linear` adapts in each, training at ft's defaults (the adapter saves, reloads and merges
with the same logits), QLoRA with 16-bit experts, the load-balancing loss against transformers' own, expert use in
metrics.jsonl, and the refusals `ft validate` and `ft plan` give before a step runs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from finetune.errors import ConfigError
from tests.helpers import JobText, launch_here, metric_rows, setup_job, train_here, write_job

SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    moe_intermediate_size=64,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
FAMILIES = {  # each family's own config keys for 4 experts (2 per token); layer 0 dense where the family has them
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_next": dict(
        num_experts=4,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=64,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"],
    ),
    "deepseek_v3": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        kv_lora_rank=64,  # bitsandbytes' 4-bit CPU kernels take inputs in multiples of 64
        q_lora_rank=64,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        head_dim=8,
        num_key_value_heads=4,  # multi-head latent attention: as many key/value heads as query heads
    ),
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128),
    "gpt_oss": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=32,
    ),
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1),
    # Gemma 4's MoE block: experts beside the dense MLP in every layer, a router with no weight of its own
    "gemma4_text": dict(
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        vocab_size_per_layer_input=512,  # at least the vocabulary (the tiny tokenizer: 421)
        hidden_size_per_layer_input=64,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=32,
    ),
}

ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LATENT = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj")
LINEAR_ATTENTION = ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba", "linear_attn.out_proj")


def experts(block: str) -> tuple[str, ...]:
    where = f"{block}." if block else ""
    return f"{where}experts.gate_up_proj", f"{where}experts.down_proj"


def mlp(prefix: str) -> tuple[str, ...]:
    return f"{prefix}.gate_proj", f"{prefix}.up_proj", f"{prefix}.down_proj"


# what all-linear adapts in layers 0 and 1 of each tiny model: never a router (mlp.gate, mlp.router,
# feed_forward.router) nor Qwen3-Next's shared_expert_gate
ADAPTED = {
    "mixtral": [ATTENTION + experts("mlp")] * 2,
    "qwen3_moe": [ATTENTION + experts("mlp")] * 2,
    "qwen3_next": [
        LINEAR_ATTENTION + experts("mlp") + mlp("mlp.shared_expert"),
        ATTENTION + experts("mlp") + mlp("mlp.shared_expert"),
    ],
    "deepseek_v3": [
        LATENT + ("self_attn.o_proj",) + mlp("mlp"),
        LATENT + ("self_attn.o_proj",) + experts("mlp") + mlp("mlp.shared_experts"),
    ],
    "llama4_text": [ATTENTION + experts("feed_forward") + mlp("feed_forward.shared_expert")] * 2,
    "gpt_oss": [ATTENTION + experts("mlp")] * 2,
    "glm4_moe": [ATTENTION + mlp("mlp"), ATTENTION + experts("mlp") + mlp("mlp.shared_experts")],
    # its experts sit in the decoder layer itself; the router's inner projection (router.proj) is not adapted
    "gemma4_text": [ATTENTION + experts("") + mlp("mlp") + ("per_layer_input_gate", "per_layer_projection")] * 2,
}


def tiny_moe(family: str, vocab: int = 512):
    """A random tiny model of `family` (seed 0), in fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, vocab_size=vocab, **{**SHAPE, **FAMILIES[family]})
    return AutoModelForCausalLM.from_config(config)


def save_moe(folder: Path, family: str) -> Path:
    """tiny_moe(family) with ft's tiny tokenizer, saved to `folder`."""
    from finetune.tiny import build_tokenizer

    if (folder / "config.json").exists():
        return folder
    tokenizer = build_tokenizer()
    model = tiny_moe(family, len(tokenizer))
    model.config.update(dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """models(family) -> the folder of that family's tiny model, built once for this module."""
    root = tmp_path_factory.mktemp("moe")
    return lambda family: save_moe(root / family, family)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from finetune.tiny import arithmetic_records, write_jsonl

    return write_jsonl(arithmetic_records(128, seed=5), tmp_path_factory.mktemp("moe-data") / "arith.jsonl")


def job_text(tmp_path, model, data, adapter: str = "{type: lora, r: 8, alpha: 16}", train: str = "", out="run"):
    """SFT of `model` with `adapter` (ft's default dropout unless it sets one), 8 rows a step in micro-batches of 4,
    logged every step, into tmp_path/out; `train`: more keys of the train section."""
    train = f"global_batch_size: 8, micro_batch_size: 4, max_steps: 12, lr: 2.0e-2, warmup_steps: 1, {train}"
    return JobText(f"""
model: {{name: {model}}}
data: {{datasets: [{{path: {data}, format: chat}}], seq_len: 48, cache_dir: {tmp_path / "cache"}}}
adapter: {adapter}
train: {{{train.rstrip(", ")}}}
output: {{dir: {tmp_path / out}, log_steps: 1, save_steps: 0}}
""")


def adapted(peft_model) -> list[set[str]]:
    """Per decoder layer: what carries an adapter, as the layer's module path (a fused expert weight: its
    parameter's path), however peft wraps it (lora.Linear, or lora.ParamWrapper around a parameter)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    layers: dict[int, set[str]] = {}
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer) or ".layers." not in name:
            continue
        path = name.split(".layers.", 1)[1].replace(".base_layer", "")
        index, where = path.split(".", 1)
        param = getattr(module, "parameter_name", "weight") if isinstance(module, ParamWrapper) else "weight"
        layers.setdefault(int(index), set()).add(where if param == "weight" else f"{where}.{param}")
    return [layers.get(i, set()) for i in range(len(layers))]


def lora_plan(**kw):
    fields = dict(adapter="lora", quantization="none", precision="fp32", head=None, train_embeddings=False)
    return SimpleNamespace(**{**fields, "pure_bf16": False, **kw})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_all_linear_adapts_attention_mlps_and_experts_and_never_a_router(family):
    from finetune.adapters import apply_adapter
    from finetune.config.schema import AdapterSection

    model = apply_adapter(tiny_moe(family, 256), AdapterSection(type="lora", r=4, alpha=8), lora_plan())
    assert adapted(model) == [set(layer) for layer in ADAPTED[family]]
    assert model.peft_config["default"].lora_dropout == 0  # ParamWrapper has none; ft's default 0.05 is replaced
    assert not model.peft_config["default"].rank_pattern  # every target at rank r, as asked
    batch = torch.randint(0, 256, (2, 8))
    model(input_ids=batch).logits.float().pow(2).mean().backward()  # every adapter is on the gradient's path
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all(".lora_" in n for n in lora)
    assert all(p.grad is not None for n, p in lora.items() if "lora_A" in n), family


def test_a_list_of_targets_is_resolved_as_peft_resolves_names_and_the_experts_only_when_named():
    from finetune.adapters import apply_adapter
    from finetune.config.schema import AdapterSection

    attention = AdapterSection(type="lora", target_modules=["q_proj", "v_proj"], dropout=0.1)
    model = apply_adapter(tiny_moe("glm4_moe", 256), attention, lora_plan())
    assert adapted(model) == [{"self_attn.q_proj", "self_attn.v_proj"}] * 2
    assert model.peft_config["default"].lora_dropout == 0.1  # no expert weight: the dropout applies
    down = AdapterSection(type="lora", target_modules=["down_proj"])
    model = apply_adapter(tiny_moe("glm4_moe", 256), down, lora_plan())
    # the dense MLP's and the shared experts' down_proj layers keep theirs (peft alone would drop them)
    assert adapted(model) == [{"mlp.down_proj"}, {"mlp.experts.down_proj", "mlp.shared_experts.down_proj"}]


def test_the_load_balancing_loss_is_transformers_own_and_ignores_padding_as_it_does():
    """On a padded batch (2-D mask) the recorded loss equals the model's aux_loss; on the same rows packed into one
    (a 4-D mask, where transformers' own computation fails) it is the same, since the same tokens count."""
    from finetune.data.collate import collate
    from finetune.methods.router import Routing, token_mask

    model = tiny_moe("mixtral", 256).eval()
    routing = Routing.attach(model, "auto")
    assert routing.coef == model.config.router_aux_loss_coef == 0.001
    rows = [{"input_ids": list(range(5, 5 + n)), "labels": list(range(5, 5 + n))} for n in (9, 4, 6)]
    padded = collate(rows, 0, "sdpa")
    assert padded["attention_mask"].dim() == 2 and not padded["attention_mask"].all()
    with torch.enable_grad(), routing.recording(padded):
        model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"])
        ours = routing.aux()
    own = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"], output_router_logits=True)
    assert ours.item() == pytest.approx(own.aux_loss.item(), rel=1e-6)
    unmasked = model(input_ids=padded["input_ids"], output_router_logits=True).aux_loss  # padding counted
    assert abs(unmasked.item() - ours.item()) > 1e-4  # so the mask matters on this batch

    packed_rows = [
        {"input_ids": rows[1]["input_ids"] + rows[2]["input_ids"], "labels": [0] * 10, "seq_lens": [4, 6]},
        {**rows[0], "seq_lens": [9]},
    ]
    packed = collate(packed_rows, 0, "sdpa")
    assert packed["attention_mask"].dim() == 4
    assert token_mask(packed).tolist() == [[1] * 10, [1] * 9 + [0]]
    with torch.enable_grad(), routing.recording(packed):
        model(
            input_ids=packed["input_ids"], attention_mask=packed["attention_mask"], position_ids=packed["position_ids"]
        )
        assert routing.aux().item() == pytest.approx(own.aux_loss.item(), rel=1e-5)


def test_the_load_balancing_loss_is_found_behind_fsdp2s_wrapper_class():
    """fully_shard puts a class of torch's in front of the model's (torch.distributed.fsdp): the family's loss function
    is still found, so FSDP2 runs add the same loss as one process."""
    from torch.distributed.fsdp import FSDPModule

    from finetune.methods.router import Routing

    model = tiny_moe("qwen3_moe", 256)
    wrapped = type(f"FSDP{type(model).__name__}", (FSDPModule, type(model)), {"__module__": FSDPModule.__module__})
    model.__class__ = wrapped  # as fully_shard does
    routing = Routing.attach(model, "auto")
    assert routing.coef > 0 and routing.aux_fn is not None


def test_nothing_is_recorded_without_gradients_nor_outside_a_training_forward():
    from finetune.methods.router import Routing

    model = tiny_moe("qwen3_moe", 256)
    routing = Routing.attach(model, "auto")
    ids = torch.randint(0, 256, (2, 6))
    model(input_ids=ids)  # not recording: a generation, a validation pass
    with torch.no_grad(), routing.recording({"input_ids": ids}):
        model(input_ids=ids)  # a reference model's or a KL baseline's pass
    assert routing.aux() is None and routing.counts is None
    with routing.recording({"input_ids": ids}):
        model(input_ids=ids)
    counts = routing.utilisation(SimpleNamespace(world_size=1))
    assert [sum(layer) for layer in counts["experts/tokens"]] == [2 * 12, 2 * 12]  # top-2 of 12 tokens, each layer
    assert routing.aux() is not None


def test_a_dense_model_gets_no_routing_and_a_family_without_a_load_balancing_loss_none_by_default():
    from finetune.errors import FtError
    from finetune.methods.router import Routing
    from tests.helpers import tiny_llama

    assert not Routing.attach(tiny_llama("sdpa"), "auto").active
    with pytest.raises(FtError, match="train.router_aux_loss_coef"):
        Routing.attach(tiny_llama("sdpa"), 0.01)
    deepseek = Routing.attach(tiny_moe("deepseek_v3", 256), "auto")  # balances its experts with a routing bias
    assert deepseek.active and deepseek.coef == 0
    with pytest.raises(FtError, match="no load-balancing loss"):
        Routing.attach(tiny_moe("glm4_moe", 256), 0.01)


def test_gemma4s_router_declares_its_experts_in_its_config_and_expert_use_is_counted(tmp_path, models, data):
    """Gemma 4's router has no weight of its own (a norm, a scale and an inner projection): the expert count and top-k
    come from its config; each token's top-2 experts are counted; transformers defines no load-balancing loss for it,
    so `auto` adds none and a number is refused by `ft validate` and by the rank side."""
    from finetune.errors import FtError
    from finetune.methods.router import Routing
    from finetune.workflow import check_job

    model = tiny_moe("gemma4_text", 256)
    routing = Routing.attach(model, "auto")
    assert (routing.layers, routing.experts, routing.top_k, routing.coef) == (2, 4, 2, 0)
    ids = torch.randint(0, 256, (2, 6))
    with routing.recording({"input_ids": ids}):
        model(input_ids=ids)
    counts = routing.utilisation(SimpleNamespace(world_size=1))["experts/tokens"]
    assert [len(layer) for layer in counts] == [4, 4] and [sum(layer) for layer in counts] == [2 * 12, 2 * 12]
    with pytest.raises(FtError, match="no load-balancing loss"):
        Routing.attach(model, 0.01)
    coef = job_text(tmp_path, models("gemma4_text"), data, train="router_aux_loss_coef: 0.01")
    with pytest.raises(ConfigError, match="train.router_aux_loss_coef: transformers defines no load-balancing"):
        check_job(write_job(tmp_path, coef))


def test_validate_refuses_a_dropout_the_experts_cannot_take_naming_the_key_and_the_reason(tmp_path, models, data):
    from finetune.workflow import check_job, compile_plan

    model = models("mixtral")
    bad = write_job(tmp_path, job_text(tmp_path, model, data, "{type: lora, r: 8, alpha: 16, dropout: 0.1}"))
    for run in (lambda: check_job(bad), lambda: compile_plan(bad, hardware="cpu")):  # ft validate, ft plan
        with pytest.raises(ConfigError) as e:
            run()
        assert "adapter.dropout" in str(e.value) and "ParamWrapper" in str(e.value)
        assert "fix: remove adapter.dropout" in str(e.value)
    dora = write_job(tmp_path, job_text(tmp_path, model, data, "{type: lora, dora: true}"), "dora.yaml")
    with pytest.raises(ConfigError, match="adapter.dora"):
        check_job(dora)
    attention = "{type: lora, dropout: 0.1, target_modules: [q_proj, k_proj, v_proj, o_proj]}"
    check_job(write_job(tmp_path, job_text(tmp_path, model, data, attention), "attention.yaml"))  # no experts: fine
    coef = job_text(tmp_path, models("deepseek_v3"), data, train="router_aux_loss_coef: 0.01")
    with pytest.raises(ConfigError, match="train.router_aux_loss_coef: transformers defines no load-balancing"):
        check_job(write_job(tmp_path, coef, "coef.yaml"))


def test_the_plan_says_what_ft_chose_for_an_moe_model_and_why(tmp_path, models, data):
    from finetune.workflow import compile_plan

    plan = compile_plan(write_job(tmp_path, job_text(tmp_path, models("mixtral"), data)), hardware="cpu")
    said = {d.field: (str(d.value), d.reason) for d in plan.decisions}
    assert said["adapter.dropout"][0] == "0" and "ParamWrapper" in said["adapter.dropout"][1]
    assert "routers" in said["adapter.target_modules"][1]
    assert "aux_loss" in said["train.router_aux_loss_coef"][1]


def test_the_plan_records_the_dropout_trained_with_and_the_model_card_shows_it(tmp_path, models, data):
    """ft's default adapter.dropout (0.05) becomes 0 where the adapter reaches the fused experts: Plan.lora_dropout
    says so, the model card shows it (not the config's default), and the rank side gives peft the same; where the
    adapter stays off the experts the dropout applies."""
    from finetune.adapters import apply_adapter
    from finetune.config import load
    from finetune.modelcard import model_card
    from finetune.workflow import compile_plan

    moe = write_job(tmp_path, job_text(tmp_path, models("mixtral"), data))
    plan = compile_plan(moe, hardware="cpu")
    assert plan.moe and plan.lora_dropout == 0.0
    config = load(moe)
    assert config.adapter.dropout == 0.05
    card = model_card({"config": config, "plan": plan.to_json(), "artifact": "adapter"})
    assert "| dropout | 0.0 |" in card
    peft_model = apply_adapter(tiny_moe("mixtral", 256), config.adapter, lora_plan())
    assert peft_model.peft_config["default"].lora_dropout == plan.lora_dropout
    attention = "{type: lora, target_modules: [q_proj, k_proj, v_proj, o_proj]}"
    kept = compile_plan(
        write_job(tmp_path, job_text(tmp_path, models("mixtral"), data, attention), "a.yaml"), hardware="cpu"
    )
    assert kept.lora_dropout == 0.05
    legacy = {k: v for k, v in plan.to_json().items() if k != "lora_dropout"}  # a plan written before it was recorded
    assert "| dropout | 0.05 |" in model_card({"config": config, "plan": legacy, "artifact": "adapter"})


def test_a_4bit_base_reads_the_models_structure_only_where_the_plan_says_it_is_moe(tmp_path, models, data):
    """What bitsandbytes leaves unquantized comes from the model's own structure on an MoE model (its output head and
    what peft adapts by parameter); on a dense one the plan already says there is nothing more, and loading reads
    nothing for it (no config, no hub)."""
    import dataclasses

    from finetune.config import load
    from finetune.models import kept_modules
    from finetune.workflow import compile_plan

    job = write_job(tmp_path, job_text(tmp_path, models("deepseek_v3"), data, "{type: qlora, r: 8, alpha: 16}"))
    config, plan = load(job), compile_plan(job, hardware="cpu")
    assert plan.moe and plan.quantization == "nf4"
    kept = kept_modules(config.model, plan, str(models("deepseek_v3")))
    # the dense MLP and the shared experts stay 16-bit exactly where the installed peft adapts them by parameter
    by_parameter = adapted_by_parameter(models("deepseek_v3"), ("model.layers.0.mlp.down_proj", SHARED_UP))
    assert "lm_head" in kept
    for name in ("model.layers.0.mlp.down_proj", SHARED_UP):
        assert (re.escape(name) in kept) == (name in by_parameter), (name, kept)
    assert kept_modules(config.model, dataclasses.replace(plan, moe=False), str(tmp_path / "not-a-model")) == []
    dense = compile_plan(
        write_job(tmp_path, job_text(tmp_path, "ft-tiny", data, "{type: qlora}"), "d.yaml"), hardware="cpu"
    )
    assert not dense.moe


SHARED_UP = "model.layers.1.mlp.shared_experts.up_proj"


def adapted_by_parameter(folder, names: tuple[str, ...]) -> set[str]:
    """Those of the linear layers `names` that the installed peft's conversion of targets for transformers 5 MoE
    checkpoints takes out of target_modules (peft 0.21 does for a dense MLP's and the shared experts' down/up
    projections, peft issue 3711; 0.22 keeps them): ft then adapts their weights through target_parameters."""
    from peft import LoraConfig
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)))
    gates = [n.replace(".up_proj", ".gate_proj") for n in names if n.endswith(".up_proj")]  # fused with up_proj
    trial = LoraConfig(target_modules=[*names, *gates])
    convert_peft_config_for_transformers(trial, lm, None)
    return {n for n in names if n not in set(trial.target_modules or ())}


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lora_at_ft_defaults_trains_saves_reloads_and_merges(tmp_path, models, data, family):
    """Loss falls; the adapter (and nothing else) changes; the saved adapter and the merged model give the trained
    model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from finetune.merge import merge_lora
    from finetune.train import save_final, train_step

    folder = models(family)
    config, plan, prepared, job = setup_job(tmp_path, job_text(tmp_path, folder, data))
    before = snapshot(job.inner)
    losses = [train_step(job)["loss"] for _ in range(12)]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.05, losses
    after = snapshot(job.inner)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    trained = {n for n, p in job.inner.named_parameters() if p.requires_grad}
    assert changed == trained and all(".lora_" in n for n in trained)

    final = save_final(job, tmp_path / "run", prepared.tokenizer)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    job.inner.eval()
    with torch.no_grad():
        want = job.inner(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(str(folder))
        reloaded = PeftModel.from_pretrained(base, str(final)).eval()
        torch.testing.assert_close(reloaded(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    report = merge_lora(final, tmp_path / "merged", base=str(folder))
    assert report.max_abs_logit_diff < 1e-4
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_qlora_on_an_moe_model_keeps_the_experts_and_what_peft_adapts_by_parameter_in_16_bit(tmp_path, models, data):
    import bitsandbytes as bnb

    from finetune.train import train_step

    text = job_text(tmp_path, models("deepseek_v3"), data, "{type: qlora, r: 8, alpha: 16}")
    config, plan, prepared, job = setup_job(tmp_path, text)
    assert plan.quantization == "nf4"
    net = job.inner.get_base_model()
    layers = net.model.layers
    assert isinstance(layers[1].self_attn.o_proj.base_layer, bnb.nn.Linear4bit)  # attention: 4-bit
    experts = layers[1].mlp.experts
    while hasattr(experts, "base_layer"):
        experts = experts.base_layer
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float32  # fused experts: never quantized
    by_parameter = adapted_by_parameter(models("deepseek_v3"), ("model.layers.0.mlp.down_proj", SHARED_UP))
    for name, linear in (
        ("model.layers.0.mlp.down_proj", layers[0].mlp.down_proj),
        (SHARED_UP, layers[1].mlp.shared_experts.up_proj),
    ):
        assert hasattr(linear, "base_layer"), name  # adapted, however the installed peft reaches it
        if name in by_parameter:  # lora.ParamWrapper adapts a plain weight: bitsandbytes must leave it as it is
            assert type(linear.base_layer) is torch.nn.Linear and linear.base_layer.weight.dtype == torch.float32
        else:  # an adapted linear layer over a 4-bit base, like the attention's
            assert isinstance(linear.base_layer, bnb.nn.Linear4bit), name
    losses = [train_step(job)["loss"] for _ in range(8)]
    assert losses[-1] < losses[0], losses


@pytest.mark.slow
def test_the_load_balancing_loss_is_added_and_logged_with_expert_use(tmp_path, models, data):
    """The step's loss is the method's plus coef × aux_loss (the same first step with and without it); metrics.jsonl
    has aux_loss and each layer's tokens per expert: top-k of every non-padding token of the logged steps."""
    from finetune.train import train_step

    folder = models("qwen3_moe")
    first = {}
    for coef, checkpointing in ((0, "false"), (10, "false"), (10, "true")):
        keys = f"router_aux_loss_coef: {coef}, gradient_checkpointing: {checkpointing}"
        first[coef, checkpointing] = train_step(setup_job(tmp_path, job_text(tmp_path, folder, data, train=keys))[3])
    plain, added, recomputed = first.values()
    assert "aux_loss" not in plain and added["aux_loss"] > 0
    assert added["loss"] - plain["loss"] == pytest.approx(10 * added["aux_loss"], rel=1e-4)
    assert added["grad_norm"] != pytest.approx(plain["grad_norm"], rel=1e-3)  # it trains the router's inputs too
    # checkpointed layers recomputed in the backward pass: the routers are not recorded twice, the gradient is kept
    assert recomputed["loss"] == pytest.approx(added["loss"], rel=1e-6)
    assert recomputed["grad_norm"] == pytest.approx(added["grad_norm"], rel=1e-5)

    train_here(write_job(tmp_path, job_text(tmp_path, folder, data)), "--set", "train.max_steps=3")
    rows = [r for r in metric_rows(tmp_path / "run") if "loss" in r]
    assert len(rows) == 3
    for row in rows:
        assert row["aux_loss"] > 0
        assert [sum(layer) for layer in row["experts/tokens"]] == [2 * row["tokens"]] * 2  # top-2, both layers
        assert 0 <= row["experts/min_share"] <= 0.25 <= row["experts/max_share"] <= 1


@pytest.mark.slow
def test_two_processes_train_as_one_with_the_load_balancing_loss_and_count_every_ranks_tokens(tmp_path, models, data):
    """The loss is a mean over micro-batches weighted by their trained tokens, and expert use is summed over ranks:
    a step split over two ranks (one micro-batch each) logs what one process logs (two micro-batches)."""
    folder = models("mixtral")
    train_here(
        write_job(tmp_path, job_text(tmp_path, folder, data, out="one"), "one.yaml"), "--set", "train.max_steps=3"
    )
    two = write_job(tmp_path, job_text(tmp_path, folder, data, out="two"), "two.yaml")
    launch_here(two, "--set", "train.max_steps=3")  # ft train --hardware cpu:2, this process the launcher
    one, two = ([r for r in metric_rows(tmp_path / name) if "loss" in r] for name in ("one", "two"))
    for a, b in zip(one, two, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-4)
        assert b["experts/tokens"] == a["experts/tokens"]


@pytest.mark.slow
def test_dpo_on_an_moe_model_adds_the_policy_passes_load_balancing_loss_only(tmp_path, models):
    """The reference (the base with the adapter off) runs without gradients: only the policy's chosen and rejected
    sequences are routed into the figures."""
    from finetune.tiny import preference_records, write_jsonl

    pairs = write_jsonl(preference_records(64, seed=3), tmp_path / "pairs.jsonl")
    text = f"""
model: {{name: {models("mixtral")}}}
data: {{datasets: [{{path: {pairs}, format: preference}}], seq_len: 48, cache_dir: {tmp_path / "cache"}}}
method: {{name: dpo, beta: 0.1}}
adapter: {{type: lora, r: 8, alpha: 16}}
train: {{global_batch_size: 8, micro_batch_size: 4, max_steps: 2, lr: 5.0e-4}}
output: {{dir: {tmp_path / "run"}, log_steps: 1, save_steps: 0}}
"""
    train_here(write_job(tmp_path, text))
    rows = [r for r in metric_rows(tmp_path / "run") if "loss" in r]
    for row in rows:
        assert row["aux_loss"] > 0 and "rewards/margin" in row
        assert [sum(layer) for layer in row["experts/tokens"]] == [2 * row["tokens"]] * 2
    assert json.loads((tmp_path / "run" / "final" / "adapter_config.json").read_text())["lora_dropout"] == 0


def test_progress_lines_show_the_load_balancing_loss_and_expert_shares():
    from finetune.progress import step_line

    row = {"loss": 1.5, "aux_loss": 2.0123, "experts/min_share": 0.125, "experts/max_share": 0.41, "experts/tokens": []}
    assert step_line(3, 10, row).endswith("loss 1.5000 aux 2.012 experts 12%-41%")
