"""The chunked loss (finetune/methods/head.py) against the plain one: the same losses, log-probabilities and gradients
for SFT, DPO and GRPO, far less memory at its peak, the same training run; and the fused kernels' refusals. Tiny random
Llamas with a vocabulary large next to their width, so that the logits dominate."""

from __future__ import annotations

import dataclasses
import itertools
import json
from types import SimpleNamespace

import pytest
import torch

from finetune.errors import FtError
from finetune.methods.head import POSITIONS, LossHead, loss_head, trained_positions

VOCAB = 1000


def llama(tied: bool = False, vocab: int = VOCAB, hidden: int = 32, layers: int = 2, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


def sft_batch(trained: bool = True) -> dict:
    """3 rows of 20 tokens, the first 8 of each untrained, the second row not trained at all, the last row padded
    after 14 tokens: 12 + 0 + 6 = 18 trained targets (or none)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 20), generator=gen)
    mask = torch.ones_like(ids)
    mask[2, 14:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :8] = -100
    labels[1] = -100
    if not trained:
        labels[:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def loss_and_grads(model, fn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    value = fn()
    (value if value.dim() == 0 else value.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return value.detach(), grads


def assert_same(a: tuple, b: tuple, rel: float = 1e-5) -> None:
    (va, ga), (vb, gb) = a, b
    assert torch.allclose(va, vb, rtol=rel, atol=rel * max(float(va.abs().max()), 1e-6))
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        scale = max(float(ga[name].abs().max()), 1e-12)
        assert float((ga[name] - gb[name]).abs().max()) <= rel * scale, name


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [1, 6, 7, 1000])  # 18 trained targets: chunks that divide it, that do not, and one
def test_chunked_sft_loss_and_every_gradient_equal_plain(tied, chunk):
    model, batch = llama(tied), sft_batch()
    plain = loss_and_grads(model, lambda: LossHead().summed_nll(model, batch))
    chunked = loss_and_grads(model, lambda: LossHead("chunked", chunk).summed_nll(model, batch))
    assert_same(plain, chunked)
    assert "lm_head.weight" in plain[1] or tied  # the head (or, tied, the embeddings it shares) is trained
    assert float(plain[1]["model.embed_tokens.weight"].abs().max()) > 0


def every_position_nll(model, batch: dict) -> torch.Tensor:
    """The summed next-token loss from the model's own logits of every position, as a hand-written loop computes it."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), batch["labels"][:, 1:].reshape(-1), reduction="sum"
    )


def head_rows(model) -> list[int]:
    """The positions each call of the model's output head runs on (recorded into the returned list)."""
    rows = []
    model.lm_head.register_forward_hook(lambda module, args, output: rows.append(args[0].shape[:-1].numel()))
    return rows


def with_positions(batch: dict, head: LossHead) -> dict:
    """The batch as SFT collates it for `head` (methods/sft.py): its host inputs added."""
    return {**batch, **head.host_inputs(batch)}


def one_row(batch: dict) -> dict:
    """The first and third rows of `batch` concatenated into one, as packed or padding-free micro-batches are (the
    third's padding dropped, its first label IGNORE): 12 + 6 trained targets."""
    lengths = (20, 14)
    row = {k: torch.cat([batch[k][0], batch[k][2][: lengths[1]]])[None] for k in ("input_ids", "attention_mask")}
    labels = batch["labels"][2][: lengths[1]].clone()
    labels[0] = -100
    row["labels"] = torch.cat([batch["labels"][0], labels])[None]
    return row


def test_the_trained_positions_are_built_on_the_host_for_one_row_and_the_plain_loss_only():
    batch = one_row(sft_batch())
    positions = trained_positions(batch["labels"])
    expected = [*range(7, 19), *range(20 + 7, 20 + 13)]  # each predicts a trained label of its own sample
    assert positions.tolist() == expected and positions.device.type == "cpu"
    assert list(LossHead().host_inputs(batch)) == [POSITIONS]
    assert LossHead().host_inputs(sft_batch()) == {}  # several padded rows: every position
    assert LossHead("chunked", 4).host_inputs(batch) == {}
    assert LossHead(whole_rows=False).host_inputs(batch) == {}  # context parallelism: a rank holds part of each row


@pytest.mark.parametrize("tied", [False, True])
def test_plain_loss_asks_the_model_for_the_trained_positions_only_with_the_same_loss_and_gradients(tied):
    model, head = llama(tied), LossHead()
    batch = with_positions(one_row(sft_batch()), head)
    reference = loss_and_grads(model, lambda: every_position_nll(model, batch))
    calls = head_rows(model)
    for _ in range(2):
        assert_same(reference, loss_and_grads(model, lambda: head.summed_nll(model, batch)))
    assert calls == [18, 18]  # one call of the model's own head a pass, on the 18 trained positions


def test_plain_loss_on_the_trained_positions_keeps_what_the_model_does_to_its_logits():
    """A model that transforms its logits after the head (a scale: Cohere's logit_scale, Granite's logits_scaling)
    does so on the positions asked for, as on every position."""
    model, head = llama(), LossHead()

    class Scaled(type(model)):
        def forward(self, *args, logits_to_keep=0, **kwargs):
            out = super().forward(*args, logits_to_keep=logits_to_keep, **kwargs)
            out.logits = out.logits * 2
            return out

    model.__class__ = Scaled
    batch = with_positions(one_row(sft_batch()), head)
    reference = loss_and_grads(model, lambda: every_position_nll(model, batch))
    calls = head_rows(model)
    assert_same(reference, loss_and_grads(model, lambda: head.summed_nll(model, batch)))
    assert calls == [18]


def test_plain_loss_keeps_every_position_for_a_model_whose_forward_takes_no_positions():
    model, head = llama(), LossHead()

    class Older(type(model)):
        def forward(self, input_ids=None, attention_mask=None, labels=None, use_cache=None, **kwargs):
            kwargs.pop("logits_to_keep", None)
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)

    model.__class__ = Older
    batch = with_positions(one_row(sft_batch()), head)
    reference = loss_and_grads(model, lambda: every_position_nll(model, batch))
    calls = head_rows(model)
    assert_same(reference, loss_and_grads(model, lambda: head.summed_nll(model, batch)))
    assert calls == [34]  # the model's own head over every position of the row


def test_a_batch_without_trained_tokens_gives_zero_loss_and_gradients_that_reach_every_parameter():
    model, batch = llama(), sft_batch(trained=False)
    plain = loss_and_grads(model, lambda: LossHead().summed_nll(model, batch))
    chunked = loss_and_grads(model, lambda: LossHead("chunked", 4).summed_nll(model, batch))
    empty = with_positions(one_row(batch), LossHead())
    selected = loss_and_grads(model, lambda: LossHead().summed_nll(model, empty))
    assert float(chunked[0]) == float(plain[0]) == float(selected[0]) == 0.0
    assert chunked[1].keys() == plain[1].keys() == selected[1].keys()  # DDP waits for every gradient, zero or not
    assert all(float(g.abs().max()) == 0 for g in [*chunked[1].values(), *selected[1].values()])


def test_chunked_loss_equals_plain_for_lora_parameters_and_a_lora_wrapped_head():
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
    model, batch = get_peft_model(llama(), config), sft_batch()
    plain = loss_and_grads(model, lambda: LossHead().summed_nll(model, batch))
    chunked = loss_and_grads(model, lambda: LossHead("chunked", 5).summed_nll(model, batch))
    assert_same(plain, chunked)
    assert all("lora_" in n for n in plain[1]) and any("lm_head" in n for n in plain[1])


def test_chunked_token_log_probabilities_equal_plain_in_value_and_gradient():
    model, batch = llama(), sft_batch()
    weights = torch.randn(3, 19, generator=torch.Generator().manual_seed(2))  # any upstream gradient per token

    def weighted(head):
        logps, mask = head.token_logps(model, batch)
        assert logps.shape == mask.shape == (3, 19) and bool((logps[~mask] == 0).all())
        return logps * weights

    assert_same(
        loss_and_grads(model, lambda: weighted(LossHead())),
        loss_and_grads(model, lambda: weighted(LossHead("chunked", 3))),
    )


def preference_batch() -> dict:
    """2 pairs: chosen rows over rejected rows, prompts untrained."""
    from finetune.data.collate import collate

    gen = torch.Generator().manual_seed(3)
    rows = []
    for length, prompt in [(12, 5), (9, 4), (14, 5), (7, 4)]:
        ids = torch.randint(2, VOCAB, (length,), generator=gen).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return {**collate(rows, 0, "sdpa"), "rows": torch.arange(2)}


def test_dpo_loss_and_gradients_with_a_chunked_head_equal_plain():
    from finetune.config.methods import DPOMethod
    from finetune.methods.dpo import DPO, FrozenCopy

    model, batch = llama(), preference_batch()
    section = DPOMethod(name="dpo", beta=0.2, loss="sigmoid")

    def loss(head):
        method = DPO(section, 0, 2, FrozenCopy(llama(seed=1)), head)  # the reference goes through the head too
        return method.loss(model, batch, 2.0)[0]

    assert_same(
        loss_and_grads(model, lambda: loss(LossHead())), loss_and_grads(model, lambda: loss(LossHead("chunked", 4)))
    )


@pytest.mark.parametrize("normalisation", ["sequence", "token"])
def test_grpo_loss_and_gradients_with_a_chunked_head_equal_plain(normalisation):
    from finetune.config.methods import GRPOMethod, RewardSpec
    from finetune.methods.dpo import FrozenCopy
    from finetune.methods.grpo import GRPO

    model, batch = llama(), {**preference_batch(), "advantages": torch.tensor([1.0, -0.5, 0.3, -0.8])}
    section = GRPOMethod(
        name="grpo",
        rewards=[RewardSpec(function="exact_match")],
        num_generations=4,
        max_new_tokens=10,
        kl_coef=0.05,
        loss_normalization=normalisation,
    )
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=1)

    def loss(head):
        method = GRPO(section, tokenizer, 4, None, FrozenCopy(llama(seed=1)), [], head)
        return method.loss(model, batch, float(method.tokens(batch)))[0]

    assert_same(
        loss_and_grads(model, lambda: loss(LossHead())), loss_and_grads(model, lambda: loss(LossHead("chunked", 4)))
    )


def test_evaluation_without_gradients_gives_the_plain_values():
    model, batch = llama(), sft_batch()
    with torch.no_grad():
        assert torch.allclose(LossHead().summed_nll(model, batch), LossHead("chunked", 3).summed_nll(model, batch))


# ---------------------------------------------------------------- memory
def peak_bytes(fn, tmp_path) -> int:
    """The most host memory that tensors allocated inside fn() held at once (torch's profiler, which records every
    CPU allocation and free: what torch.cuda.max_memory_allocated is on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    return max(itertools.accumulate(e["args"]["Bytes"] for e in events))


def test_chunked_loss_keeps_one_chunk_of_logits_where_plain_holds_all_of_them(tmp_path):
    vocab, chunk = 32000, 64
    model = llama(vocab=vocab, hidden=16, layers=1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # gradients already there, as from the step's first micro-batch
    ids = torch.randint(0, vocab, (2, 256), generator=torch.Generator().manual_seed(4))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    targets = 2 * 255
    per_logit = 4 + 8  # fp32 logits (a = 4), their fp32 copy's place and the cross-entropy's: t·V·(a+8)

    plain = peak_bytes(lambda: LossHead().summed_nll(model, batch).backward(), tmp_path)
    chunked = peak_bytes(lambda: LossHead("chunked", chunk).summed_nll(model, batch).backward(), tmp_path)
    assert 0.9 * targets * vocab * per_logit < plain < 1.3 * targets * vocab * per_logit
    assert chunked < 1.3 * chunk * vocab * per_logit
    assert chunked < plain / 5

    # the plain loss on the trained positions only (one row of two samples, a prompt of 160 tokens each): those
    # positions' logits, as the estimate counts them (plan/transients.py logits_bytes: t · trained_share · V · (a + 8))
    head, labels = LossHead(), ids.clone()
    labels[:, :160] = -100
    prompted = {"input_ids": ids.reshape(1, -1), "labels": labels.reshape(1, -1)}
    prompted = with_positions({**prompted, "attention_mask": torch.ones_like(prompted["input_ids"])}, head)
    selected = peak_bytes(lambda: head.summed_nll(model, prompted).backward(), tmp_path)
    trained = 2 * (256 - 160)
    assert 0.9 * trained * vocab * per_logit < selected < 1.3 * trained * vocab * per_logit


# ---------------------------------------------------------------- a training run
@pytest.mark.slow
def test_a_chunked_training_run_gives_the_plain_runs_losses(tmp_path):
    from finetune.config import load
    from finetune.data.preprocess import prepare
    from finetune.hardware import parse
    from finetune.plan import plan
    from finetune.train import setup, train_step
    from finetune.workflow import model_facts
    from tests.helpers import job_text, write_job

    text = job_text(tmp_path, "full", steps=4, batch=8).replace(
        "warmup_steps: 2}", "warmup_steps: 2, loss_implementation: chunked}"
    )
    config = load(write_job(tmp_path, text))
    chunked = plan(config, parse("cpu"), model_facts(config.model))
    assert chunked.loss_implementation == "chunked" and chunked.loss_chunk_tokens > 0
    chunked = dataclasses.replace(chunked, loss_chunk_tokens=16)  # several chunks per micro-batch of the tiny model
    prepared = prepare(config)
    seen = {}
    for p in (chunked, dataclasses.replace(chunked, loss_implementation="plain", loss_chunk_tokens=0)):
        job = setup(config, p, prepared)
        assert job.method.head.implementation == p.loss_implementation
        seen[p.loss_implementation] = [train_step(job)["loss"] for _ in range(4)]
    assert seen["chunked"] == pytest.approx(seen["plain"], rel=1e-5)
    assert seen["chunked"][-1] < seen["chunked"][0]


# ---------------------------------------------------------------- what cannot run, said before training
def plan_for(implementation: str, **kw):
    fields = dict(
        loss_implementation=implementation,
        loss_chunk_tokens=0,
        device="GPU",
        backend="single",
        sharding=None,
        context_parallel=1,
        tensor_parallel=1,
    )
    return SimpleNamespace(**{**fields, **kw})


@pytest.mark.parametrize(
    "implementation, kw, per_token, needle",
    [
        ("liger", {"device": "CPU process"}, False, "runs fused CUDA kernels, and this job runs on CPUs"),
        ("cut_cross_entropy", {"device": "CPU process"}, True, "set train.loss_implementation: chunked"),
    ],
)
def test_fused_kernels_are_refused_on_cpus(implementation, kw, per_token, needle):
    with pytest.raises(FtError, match=needle):
        loss_head(plan_for(implementation, **kw), per_token)


@pytest.mark.parametrize(
    "implementation, package", [("liger", "liger-kernel"), ("cut_cross_entropy", "cut-cross-entropy")]
)
def test_a_missing_fused_kernel_package_names_the_key_and_the_install(implementation, package, monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(
        FtError,
        match=rf"train.loss_implementation: {implementation} needs the {package} package.*pip install {package}",
    ):
        loss_head(plan_for(implementation), False)


def test_fused_kernels_are_refused_where_the_head_is_not_whole_or_liger_cannot_give_per_token_gradients(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # as if installed
    with pytest.raises(FtError, match="ZeRO-3 partitions it"):
        loss_head(plan_for("cut_cross_entropy", backend="deepspeed", sharding="zero3"), False)
    with pytest.raises(FtError, match="per-token log-probabilities"):
        loss_head(plan_for("liger"), True)
    assert loss_head(plan_for("liger"), False).implementation == "liger"
    chunked = plan_for("chunked", loss_chunk_tokens=64, device="CPU process", micro_batch_size=2, seq_len=64)
    assert loss_head(chunked, True).chunk_tokens == 64


def test_a_logit_softcap_is_applied_as_the_model_applies_it():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        final_logit_softcapping=0.5,  # logits = 0.5·tanh(head(h)/0.5)
    )
    model, batch = Gemma2ForCausalLM(config), sft_batch()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # logits large enough that the cap changes them much
    plain = loss_and_grads(model, lambda: LossHead().summed_nll(model, batch))
    assert_same(plain, loss_and_grads(model, lambda: LossHead("chunked", 5).summed_nll(model, batch)))


def test_a_model_whose_logits_are_not_its_plain_head_is_refused_instead_of_trained_wrongly():
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    config = GraniteConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        logits_scaling=8.0,  # logits = head(h) / 8
    )
    with torch.no_grad():
        model = GraniteForCausalLM(config)
        model.lm_head.weight.mul_(10)  # logits large enough that the scale shows
    with pytest.raises(FtError, match="transforms them further.*train.loss_implementation: plain"):
        LossHead("chunked", 8).summed_nll(model, sft_batch())
