"""KTO: its loss and gradients against trl (the oracle) on the same batch, the unpaired data format and its errors,
the config checks, and (slow) that a short run from an SFT'd model separates desirable from undesirable answers."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import datasets
import pytest
import torch

from finetune.config.methods import KTOMethod
from finetune.data.collate import IGNORE, collate
from finetune.errors import ConfigError, DataError
from finetune.methods.dpo import AdapterDisabled, FrozenCopy
from finetune.methods.kto import KTO, mismatched
from finetune.tiny import unpaired_records, write_jsonl
from tests.helpers import policy_and_reference

trl = pytest.importorskip("trl")

BETA, WEIGHTS = 0.3, (1.0, 1.5)


@pytest.fixture(scope="module")
def base():
    """The tiny model, perturbed (the policy), its unperturbed copy (the reference), and the tokenizer."""
    return policy_and_reference()


def trl_models(base, adapter: str) -> dict:
    """What trl's trainer is given: for full fine-tuning the perturbed policy and a frozen reference; for LoRA the
    base and an adapter config (trl then wraps it, and its reference is the base with the adapter disabled, as ft's)."""
    policy, reference, _ = base
    if adapter == "full":
        return {"model": copy.deepcopy(policy), "ref_model": copy.deepcopy(reference)}
    from peft import LoraConfig

    torch.manual_seed(1)  # init_lora_weights=False: B is not zero, so the adapter changes the outputs
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return {"model": copy.deepcopy(reference), "peft_config": lora}


def trained_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_kto_loss_and_gradients_equal_trl_on_the_same_batch(base, adapter, tmp_path):
    from trl import KTOConfig, KTOTrainer

    tok = base[2]
    args = KTOConfig(
        output_dir=str(tmp_path),
        report_to=[],
        beta=BETA,
        desirable_weight=WEIGHTS[0],
        undesirable_weight=WEIGHTS[1],
        per_device_train_batch_size=6,
        max_length=64,
        use_cpu=True,
        bf16=False,
    )
    records = unpaired_records(4, seed=1)[:6]
    assert {r["label"] for r in records} == {True, False}
    trainer = KTOTrainer(
        **trl_models(base, adapter),
        args=args,
        train_dataset=datasets.Dataset.from_list(records),
        processing_class=tok,
    )
    model = trainer.model  # the same model (and adapter) for both
    ours_reference = FrozenCopy(trainer.ref_model) if adapter == "full" else AdapterDisabled(model)
    examples = [trainer.train_dataset[i] for i in range(6)]  # trl's tokens, with its rotated KL completions
    model.train()
    theirs = trainer._compute_loss(trainer.model, trainer.data_collator(examples), return_outputs=False)
    theirs.backward()
    their_grads = trained_grads(model)
    model.zero_grad()

    rows = datasets.Dataset.from_list(
        [
            {
                "input_ids": e["prompt_ids"] + e["completion_ids"],
                "labels": [IGNORE] * len(e["prompt_ids"]) + e["completion_ids"],
                "desirable": bool(e["label"]),
            }
            for e in examples
        ]
    )
    section = KTOMethod(name="kto", beta=BETA, desirable_weight=WEIGHTS[0], undesirable_weight=WEIGHTS[1])
    method = KTO(section, tok.pad_token_id, 6, 64, ours_reference)  # ft pairs the mismatched completions itself
    (batch,) = method.micro_batches(rows, list(range(6)))
    ours, metrics = method.loss(model, batch, normaliser=6.0)  # the mean over rows
    ours.backward()
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5)
    at_reference = sum(0.5 * WEIGHTS[0 if e["label"] else 1] for e in examples) / 6  # every log-ratio 0
    assert abs(float(theirs) - at_reference) > 1e-3  # the policy is not its reference
    ours_grads = trained_grads(model)
    assert ours_grads.keys() == their_grads.keys()
    for name, grad in ours_grads.items():
        torch.testing.assert_close(grad, their_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    assert metrics["kl"] >= 0 and metrics["rewards/margin"] == pytest.approx(
        metrics["rewards/chosen"] - metrics["rewards/rejected"]
    )


def test_the_kl_baseline_is_the_whole_steps(base):
    """Every micro-batch of a step uses z from all the step's mismatched pairs (so ranks and accumulation agree)."""
    reference, policy, tok = base  # this way round z > 0 on these rows (the clamp leaves it)
    rows = [
        {"input_ids": [5, 6, 7, 8 + i, 9 + 2 * i], "labels": [IGNORE, IGNORE, IGNORE, 8 + i, 9 + 2 * i]}
        for i in range(6)
    ]
    dataset = datasets.Dataset.from_list([{**r, "desirable": i % 2 == 0} for i, r in enumerate(rows)])
    method = KTO(KTOMethod(name="kto", beta=BETA), tok.pad_token_id, 3, 64, FrozenCopy(reference))
    batches = method.micro_batches(dataset, list(range(6)))
    assert len(batches) == 2
    with torch.no_grad():
        kls = [method.loss(policy, b, normaliser=6.0)[1]["kl"] for b in batches]
        pairs = [collate(mismatched(rows[i : i + 3], 64), tok.pad_token_id, "sdpa") for i in (0, 3)]
        ratios = torch.cat([method.sequence_logps(policy, p) - method.sequence_logps(reference, p) for p in pairs])
    assert kls[0] == kls[1] == pytest.approx(float(ratios.mean()), rel=1e-5) and kls[0] > 0.01


def test_mismatched_pairs_rotate_completions_by_one_within_the_micro_batch():
    rows = [
        {"input_ids": [1, 2, 3], "labels": [IGNORE, IGNORE, 3]},
        {"input_ids": [4, 5, 6, 7], "labels": [IGNORE, 5, 6, 7]},
        {"input_ids": [8, 9], "labels": [IGNORE, 9]},
    ]
    got = mismatched(rows, seq_len=4)
    assert [r["input_ids"] for r in got] == [[1, 2, 9], [4, 3], [8, 5, 6, 7]]
    assert [r["labels"] for r in got] == [[IGNORE, IGNORE, 9], [IGNORE, 3], [IGNORE, 5, 6, 7]]
    assert mismatched(rows, seq_len=3)[2] == {"input_ids": [8, 5, 6], "labels": [IGNORE, 5, 6]}


@pytest.mark.parametrize("label", ['"yes"', "1", "null"])
def test_a_row_whose_label_is_not_a_boolean_is_named_by_file_and_line(tmp_path, label):
    from finetune.data.formats import normalize_dataset
    from finetune.data.sources import load_source
    from tests.helpers import spec

    data = tmp_path / "feedback.jsonl"
    data.write_text(
        '{"prompt": "What is 1 + 1?", "completion": "2", "label": true}\n'
        f'{{"prompt": "What is 2 + 2?", "completion": "5", "label": {label}}}\n'
    )
    source = spec(data, "unpaired")
    raw, _ = load_source(source)
    with pytest.raises(DataError) as e:
        normalize_dataset(raw, source, key="data.datasets[0]")
    assert f"{data}:2: 'label'" in str(e.value)
    assert "true or false" in str(e.value) or "null" in str(e.value)


def test_unpaired_rows_read_text_or_messages_and_keep_the_label(tmp_path):
    from finetune.data.formats import normalize_dataset
    from finetune.data.sources import load_source
    from tests.helpers import spec

    data = write_jsonl(
        [
            {"prompt": "What is 1 + 1?", "completion": "2", "label": True},
            {"prompt": [{"role": "user", "content": "Hi"}], "completion": "3", "label": False},
        ],
        tmp_path / "feedback.jsonl",
    )
    source = spec(data, "unpaired", system_prompt="Be brief.")
    out, skipped = normalize_dataset(load_source(source)[0], source)
    assert skipped == 0 and out["label"][:] == [True, False]
    assert out[0]["prompt"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1 + 1?"},
    ]
    assert out[1]["completion"] == [{"role": "assistant", "content": "3"}]


def kto_job(data: str, method: str = "{name: kto}", micro: str = "auto", fmt: str = "unpaired") -> str:
    return f"""
model: {{name: ft-tiny}}
data: {{datasets: [{{path: {data}, format: {fmt}}}], seq_len: 48}}
method: {method}
adapter: {{type: full}}
train: {{global_batch_size: 8, micro_batch_size: {micro}}}
output: {{dir: runs/kto}}
"""


def test_kto_config_checks(tmp_path):
    from finetune.config.load import loads

    data = write_jsonl(unpaired_records(2), tmp_path / "d.jsonl")
    config = loads(kto_job(data))
    assert config.method.reference_kind("full") == "copy" and config.method.reference_kind("lora") == "adapter"
    problems = {
        "format": kto_job(data, fmt="preference"),
        "micro_batch_size": kto_job(data, micro="1"),
        "adapter to disable": kto_job(data, method="{name: kto, reference: adapter_disabled}"),
    }
    for words, text in problems.items():
        with pytest.raises(ConfigError) as e:
            loads(text)
        assert words in str(e.value), str(e.value)


def test_a_precomputed_reference_is_planned_for_full_fine_tuning_and_allows_one_row_micro_batches(tmp_path):
    from finetune.config.load import loads
    from finetune.hardware import parse
    from finetune.plan import plan
    from finetune.workflow import model_facts

    data = write_jsonl(unpaired_records(2), tmp_path / "d.jsonl")
    for micro in ("auto", "1"):  # with pairs fixed by the data, a micro-batch of 1 row has its KL pair
        config = loads(kto_job(data, method="{name: kto, reference: precomputed}", micro=micro))
        assert config.method.reference_kind("full") == "precomputed"
        made = plan(config, parse("cpu"), model_facts(config.model))
        assert made.reference == "precomputed"


def fixed_pair_rows(n: int = 5) -> datasets.Dataset:
    """Rows of different prompt and completion lengths, desirable and not."""
    rows = []
    for i in range(n):
        prompt, completion = [5 + i] * (2 + i % 3), [20 + 3 * i + k for k in range(1 + i % 2)]
        rows.append(
            {
                "input_ids": prompt + completion,
                "labels": [IGNORE] * len(prompt) + completion,
                "desirable": i % 2 == 0,
            }
        )
    return datasets.Dataset.from_list(rows)


def kto_created(reference_model, dataset, micro: int, runtime=None, validation=None):
    """KTO built as a job builds it, with a precomputed reference scored by `reference_model`."""
    import contextlib

    from finetune.methods import Context

    plan = SimpleNamespace(
        micro_batch_size=micro, seq_len=64, reference="precomputed", loss_implementation="plain", loss_chunk_tokens=0
    )
    context = Context(
        plan=plan,
        tokenizer=None,
        pad_id=0,
        attn="sdpa",
        engine=SimpleNamespace(model=reference_model),
        device="cpu",
        runtime=runtime or SimpleNamespace(rank=0, world_size=1),
        autocast=contextlib.nullcontext,
        dataset=dataset,
        frozen_copy=None,
        validation=validation,
    )
    return KTO.create(KTOMethod(name="kto", beta=BETA, reference="precomputed"), context)


def test_the_precomputed_table_holds_the_reference_logps_of_each_row_and_its_fixed_pair(base, monkeypatch):
    """Row i is paired with row i−1 of the dataset (row 0 with the last); each of two ranks scores its share."""
    _, reference, _ = base
    dataset = fixed_pair_rows(5)
    rows = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in dataset]
    pairs = mismatched(rows, 64, [rows[i - 1] for i in range(5)])
    scorer = KTO(KTOMethod(name="kto"), 0, 5, 64, None)
    with torch.no_grad():
        own = scorer.sequence_logps(reference, collate(rows, 0, "sdpa"))
        paired = scorer.sequence_logps(reference, collate(pairs, 0, "sdpa"))
    expected = torch.stack([own, paired], dim=1)
    one = kto_created(reference, dataset, micro=2)
    torch.testing.assert_close(one.reference.table, expected[:, :1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(one.kl_reference.table, expected[:, 1:], rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda table: None)  # each rank's share, not yet summed
    shares = [kto_created(reference, dataset, 2, SimpleNamespace(rank=r, world_size=2)) for r in (0, 1)]
    summed = torch.cat(
        [
            shares[0].reference.table + shares[1].reference.table,
            shares[0].kl_reference.table + shares[1].kl_reference.table,
        ],
        dim=1,
    )
    torch.testing.assert_close(summed, expected, rtol=1e-5, atol=1e-6)


def test_a_precomputed_reference_trains_like_a_frozen_copy_with_the_same_pairs(base):
    """What a run with `precomputed` does equals a frozen copy given the same fixed pairs: loss, metrics, gradients."""
    policy, reference = copy.deepcopy(base[0]).requires_grad_(True), base[1]  # another test freezes base[0]
    dataset = fixed_pair_rows(6)
    pre = kto_created(reference, dataset, micro=1)  # a micro-batch of 1 row: its pair comes from the dataset
    copy_ = KTO(KTOMethod(name="kto", beta=BETA), 0, 1, 64, FrozenCopy(copy.deepcopy(reference)), fixed_pairs=True)
    results = []
    for method in (pre, copy_):
        policy.zero_grad()
        out = []
        for batch in method.micro_batches(dataset, [4, 1, 5]):  # a step's rows, in shuffled order
            loss, metrics = method.loss(policy, batch, normaliser=3.0)
            loss.backward()
            out.append((float(loss), {k: float(v) for k, v in metrics.items()}))  # read, as the loop reads them
        results.append((out, trained_grads(policy)))
    (pre_out, pre_grads), (copy_out, copy_grads) = results
    for (a, ma), (b, mb) in zip(pre_out, copy_out, strict=True):
        assert a == pytest.approx(b, rel=1e-5) and ma == pytest.approx(mb, rel=1e-5, abs=1e-6)
    assert pre_out[0][1]["kl"] > 0  # the policy is not its reference: the baseline is in play
    for name, grad in pre_grads.items():
        torch.testing.assert_close(grad, copy_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_precomputed_reference_has_a_table_of_the_held_out_rows_too(base):
    """Validation batches index their own table: the held-out loss equals a frozen copy's with the same pairs, also
    where the held-out set has more rows than the training set."""
    import contextlib

    from finetune.evaluate import validation_metrics

    policy, reference, _ = base
    train, held_out = fixed_pair_rows(3), fixed_pair_rows(7).shuffle(seed=1).flatten_indices()
    pre = kto_created(reference, train, micro=2, validation=held_out)
    copy_ = KTO(KTOMethod(name="kto", beta=BETA), 0, 2, 64, FrozenCopy(copy.deepcopy(reference)), fixed_pairs=True)
    got, expected = (validation_metrics(policy, m, held_out, "cpu", contextlib.nullcontext) for m in (pre, copy_))
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6) and got["eval_kl"] >= 0


@pytest.mark.slow
def test_kto_widens_the_held_out_reward_margin_of_an_sft_model(tmp_path, sft_model):
    from tests.helpers import metric_rows, train_here

    train = write_jsonl(unpaired_records(480, seed=3), tmp_path / "feedback.jsonl")
    held_out = write_jsonl(unpaired_records(50, seed=4), tmp_path / "held-out.jsonl")
    job = tmp_path / "kto.yaml"
    job.write_text(f"""
model: {{name: {sft_model}}}
data: {{datasets: [{{path: {train}, format: unpaired}}], seq_len: 48, cache_dir: {tmp_path / "cache"},
        validation: {{path: {held_out}, format: unpaired}}}}
method: {{name: kto, beta: 0.5}}
adapter: {{type: lora, r: 16, alpha: 32, dropout: 0.0}}
train: {{global_batch_size: 32, micro_batch_size: 16, max_steps: 15, lr: 1.0e-3, warmup_steps: 3}}
output: {{dir: {tmp_path / "run"}, log_steps: 1, save_steps: 0}}
""")
    train_here(job)  # in this process (a new one spends seconds importing)
    rows = metric_rows(tmp_path / "run")
    final = [row for row in rows if "eval_loss" in row][-1]
    # at the start the policy is the reference: every implicit reward is 0, the margin 0 and the loss 0.5 per row;
    # measured after 15 steps: margin 0.20, loss 0.476
    assert final["eval_rewards/margin"] > 0.1 and final["eval_loss"] < 0.49, json.dumps(final)
    trained = [row for row in rows if "rewards/margin" in row]
    assert {"kl", "rewards/chosen", "rewards/rejected", "logps/chosen"} <= trained[-1].keys()
