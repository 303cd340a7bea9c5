"""ORPO and SimPO: losses and gradients against trl (the oracle) on the same batch, their keys, plans and data checks,
and (slow) that a short run from an SFT'd model raises held-out preference accuracy."""

from __future__ import annotations

import contextlib

import datasets
import pytest
import torch
import yaml

from finetune.config import load
from finetune.config.methods import ORPOMethod, SimPOMethod
from finetune.errors import FtError
from finetune.methods.orpo import ORPO
from finetune.methods.simpo import SimPO
from finetune.tiny import preference_records, write_jsonl
from tests.helpers import JobText, metric_rows, train_here

trl = pytest.importorskip("trl")

# equal-length chosen answers and no prompt tokens: there trl's NLL (a token mean over the chosen sequences of the
# batch, prompts included) is ORPO's (each chosen answer's mean NLL, averaged over pairs)
NO_PROMPT = [
    {"prompt": "", "chosen": f"The answer is {a}.", "rejected": f"It is {b} or so, I think."}
    for a, b in ((12, 13), (47, 74), (30, 3), (81, 18))
]


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoTokenizer

    from finetune.tiny import ensure_model

    path = str(ensure_model())
    return path, AutoTokenizer.from_pretrained(path)


def policy(path: str, kind: str):
    """The tiny model, perturbed (full), or with a LoRA adapter of random nonzero weights (lora)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    if kind == "lora":
        torch.manual_seed(0)
        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        model = get_peft_model(model, config)
    return model.train()


def trl_trainer(name: str, tiny, records, tmp_path, **options):
    path, tok = tiny
    if name == "orpo":
        from trl.experimental.orpo import ORPOConfig as Args
        from trl.experimental.orpo import ORPOTrainer as Trainer
    else:
        from trl.experimental.cpo import CPOConfig as Args
        from trl.experimental.cpo import CPOTrainer as Trainer
    common = dict(output_dir=str(tmp_path), report_to=[], max_length=64, use_cpu=True, bf16=False)
    args = Args(**common, per_device_train_batch_size=len(records), **options)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    return Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(records), processing_class=tok)


def same_batch(trainer, n: int, pad: int) -> tuple[dict, dict]:
    """trl's batch of n pairs, and ours with trl's tokenization (chosen stacked over rejected)."""
    theirs = trainer.data_collator([trainer.train_dataset[i] for i in range(n)])
    both = trainer.concatenated_inputs(theirs, padding_value=pad)
    ours = {
        "input_ids": both["concatenated_input_ids"],
        "attention_mask": both["concatenated_attention_mask"],
        "labels": both["concatenated_labels"],
        "rows": torch.arange(n),
    }
    return theirs, ours


def gradients(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    return grads


def assert_same_loss_and_gradients(model, method, trainer, theirs, ours, n: int):
    model.zero_grad()
    expected, _ = trainer.get_batch_loss_metrics(model, theirs)
    expected.backward()
    expected_grads = gradients(model)
    got, metrics = method.loss(model, ours, normaliser=float(n))  # the mean over the batch's pairs
    got.backward()
    got_grads = gradients(model)
    assert float(got) == pytest.approx(float(expected), rel=1e-5)
    assert expected_grads.keys() == got_grads.keys() and expected_grads
    for name, g in expected_grads.items():  # each parameter's gradient, relative to its norm (float32 sums)
        error = float(torch.linalg.vector_norm(got_grads[name] - g) / torch.linalg.vector_norm(g).clamp(min=1e-12))
        assert error < 1e-5, (name, error)
    return metrics


@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_orpo_loss_and_gradients_equal_trl_on_the_same_batch(tiny, adapter, tmp_path):
    path, tok = tiny
    trainer = trl_trainer("orpo", tiny, NO_PROMPT, tmp_path, beta=0.2)  # trl's beta is ORPO's lambda
    theirs, ours = same_batch(trainer, len(NO_PROMPT), tok.pad_token_id)
    assert theirs["prompt_input_ids"].shape[1] == 0 and len(set(theirs["chosen_attention_mask"].sum(1).tolist())) == 1
    model = policy(path, adapter)
    method = ORPO(ORPOMethod.model_validate({"name": "orpo", "lambda": 0.2}), tok.pad_token_id, 4)
    metrics = assert_same_loss_and_gradients(model, method, trainer, theirs, ours, len(NO_PROMPT))
    assert {"nll", "log_odds", "rewards/margin", "rewards/accuracy"} <= metrics.keys()


def test_orpo_odds_ratio_term_and_rewards_equal_trl_with_chat_prompts(tiny, tmp_path):
    """With prompts, trl's NLL also covers the prompt tokens; the odds-ratio term and the rewards still agree."""
    path, tok = tiny
    records = preference_records(6, seed=1)
    trainer = trl_trainer("orpo", tiny, records, tmp_path, beta=0.2)
    theirs, ours = same_batch(trainer, 6, tok.pad_token_id)
    model = policy(path, "full")
    method = ORPO(ORPOMethod.model_validate({"name": "orpo", "lambda": 0.2}), tok.pad_token_id, 6)
    with torch.no_grad():
        expected, trl_metrics = trainer.get_batch_loss_metrics(model, theirs)
        got, metrics = method.loss(model, ours, normaliser=6.0)
    odds_term = float(expected) - float(trl_metrics["nll_loss"])
    assert float(got) - metrics["nll"] == pytest.approx(odds_term, rel=1e-5)
    assert metrics["log_odds"] == pytest.approx(float(trl_metrics["log_odds_chosen"]), rel=1e-5, abs=1e-6)
    for ours_name, trl_name in (("rewards/margin", "rewards/margins"), ("rewards/accuracy", "rewards/accuracies")):
        assert metrics[ours_name] == pytest.approx(float(trl_metrics[trl_name]), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("adapter, smoothing", [("full", 0.0), ("lora", 0.1)])
def test_simpo_loss_and_gradients_equal_trl_cpo_with_the_simpo_loss(tiny, adapter, smoothing, tmp_path):
    path, tok = tiny
    records = preference_records(4, seed=2)
    options = dict(loss_type="simpo", cpo_alpha=0.0, beta=2.0, simpo_gamma=0.7, label_smoothing=smoothing)
    trainer = trl_trainer("simpo", tiny, records, tmp_path, **options)
    theirs, ours = same_batch(trainer, 4, tok.pad_token_id)
    model = policy(path, adapter)
    section = SimPOMethod(name="simpo", beta=2.0, gamma=0.7, label_smoothing=smoothing)
    metrics = assert_same_loss_and_gradients(model, SimPO(section, tok.pad_token_id, 4), trainer, theirs, ours, 4)
    assert 0.0 <= metrics["rewards/accuracy"] <= 1.0


def job_text(tmp_path, method: str, adapter="{type: lora, r: 16, alpha: 32, dropout: 0.0}", model="ft-tiny", data=True):
    """A preference job on arithmetic pairs (written unless `data` is False: the caller writes its own)."""
    train, held_out = tmp_path / "pairs.jsonl", tmp_path / "held-out.jsonl"
    if data:
        write_jsonl(preference_records(960, seed=3), train)
        write_jsonl(preference_records(100, seed=4), held_out)
    return JobText(f"""
model: {{name: {model}}}
data: {{datasets: [{{path: {train}, format: preference}}], seq_len: 48, cache_dir: {tmp_path / "cache"},
        validation: {{path: {held_out}, format: preference}}}}
method: {method}
adapter: {adapter}
train: {{global_batch_size: 32, micro_batch_size: 16, max_steps: 12, lr: 5.0e-4, warmup_steps: 2}}
output: {{dir: {tmp_path / "run"}, log_steps: 1, save_steps: 0}}
""")


def test_the_method_keys_load_from_yaml_and_round_trip(tmp_path):
    path = tmp_path / "orpo.yaml"
    path.write_text(job_text(tmp_path, "{name: orpo, lambda: 0.25}"))
    config = load(path)
    assert config.method.lambda_ == 0.25 and config.method.explicit("lambda_")
    dumped = config.method.model_dump(mode="json")
    assert dumped == {"name": "orpo", "lambda": 0.25}  # config.yaml in the run folder validates again as it is
    assert ORPOMethod.model_validate(yaml.safe_load(yaml.safe_dump(dumped))) == config.method
    path.write_text(job_text(tmp_path, "{name: simpo, beta: 2.5, gamma: 1.2}"))
    assert (load(path).method.beta, load(path).method.gamma) == (2.5, 1.2)
    path.write_text(job_text(tmp_path, "{name: orpo, lambda: -1}"))
    with pytest.raises(FtError, match="lambda"):
        load(path)


def test_orpo_and_simpo_plan_no_reference_model_where_dpo_plans_a_copy(tmp_path):
    from finetune.workflow import compile_plan

    def plan(method: str) -> dict:
        path = tmp_path / "job.yaml"
        path.write_text(job_text(tmp_path, method, adapter="{type: full}"))
        return compile_plan(path, hardware="cpu").to_json()

    def reference_memory(p: dict) -> float:
        memory = p["memory"]
        return memory["per_device_breakdown_gib"].get("reference model", 0) + memory["host_breakdown_gib"].get(
            "reference model", 0
        )

    dpo = plan("{name: dpo}")
    assert dpo["reference"] == "copy" and reference_memory(dpo) > 0
    for method in ("{name: orpo}", "{name: simpo}"):
        p = plan(method)
        assert p["reference"] == "none" and reference_memory(p) == 0, method


@pytest.mark.parametrize("method", ["orpo", "simpo"])
def test_a_preference_row_without_rejected_is_named_by_file_and_line(tmp_path, method):
    from finetune.data.preprocess import prepare

    data = tmp_path / "pairs.jsonl"
    data.write_text(
        '{"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"}\n{"prompt": "2 + 2?", "chosen": "4"}\n'
    )
    job = tmp_path / "job.yaml"
    job.write_text(
        f"model: {{name: ft-tiny}}\ndata: {{datasets: [{{path: {data}, format: preference}}], seq_len: 48, cache_dir: "
        f"{tmp_path / 'c'}}}\nmethod: {{name: {method}}}\nadapter: {{type: lora}}\noutput: {{dir: {tmp_path / 'r'}}}\n"
    )
    with pytest.raises(FtError, match=f"{data}:2: 'rejected'"):
        prepare(load(job))
    job.write_text(job.read_text().replace("format: preference", "format: chat"))
    with pytest.raises(FtError, match=f"{method} cannot train on chat data"):
        load(job)


def styled(records: list[dict]) -> list[dict]:
    """The right answer phrased as a sentence, preferred over the bare answer the SFT'd model was taught."""
    return [
        {
            **r,
            "chosen": [{"role": "assistant", "content": f"The answer is {r['chosen'][0]['content']}."}],
            "rejected": r["chosen"],
        }
        for r in records
    ]


def held_out_accuracy(job, model_path: str) -> float:
    """The held-out preference accuracy (mean log-probability of chosen above rejected) of the model at `model_path`."""
    from transformers import AutoModelForCausalLM

    from finetune.data.preprocess import prepare
    from finetune.evaluate import validation_metrics

    prepared = prepare(load(job))
    method = SimPO(SimPOMethod(name="simpo"), prepared.tokenizer.pad_token_id, 16)  # the accuracy ORPO logs too
    model = AutoModelForCausalLM.from_pretrained(model_path)
    metrics = validation_metrics(model, method, prepared.validation, torch.device("cpu"), contextlib.nullcontext)
    return metrics["eval_rewards/accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["{name: orpo, lambda: 1.0}", "{name: simpo, beta: 2.0, gamma: 1.0}"])
def test_a_short_run_raises_held_out_preference_accuracy_of_an_sft_model(tmp_path, sft_model, method):
    """On the arithmetic pairs (right answer over a wrong digit) the SFT'd model already ranks 83% of held-out pairs
    right, and what it gets wrong is arithmetic a short run cannot teach (measured: 100 steps took ORPO and SimPO from
    0.83 to 0.85-0.87). So the preference here is one the SFT'd model holds the other way round: the answer as a
    sentence over the bare answer it was taught; held-out prompts show the preference generalises."""
    write_jsonl(styled(preference_records(256, seed=3)), tmp_path / "pairs.jsonl")
    write_jsonl(styled(preference_records(64, seed=4)), tmp_path / "held-out.jsonl")
    job = tmp_path / "job.yaml"
    text = job_text(tmp_path, method, adapter="{type: full}", model=sft_model, data=False)
    job.write_text(text.replace("max_steps: 12, lr: 5.0e-4", "max_steps: 8, lr: 2.0e-3"))
    before = held_out_accuracy(job, str(sft_model))
    train_here(job)  # in this process (a new one spends seconds importing)
    rows = metric_rows(tmp_path / "run")
    final = [row for row in rows if "eval_loss" in row][-1]
    # measured: 0.0 before; 0.80 (ORPO) and 1.0 (SimPO) after 8 steps
    assert before < 0.1 and final["eval_rewards/accuracy"] > 0.6, (before, final)
    trained = [row for row in rows if "rewards/margin" in row]
    assert trained[-1]["rewards/margin"] > trained[0]["rewards/margin"]
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()
