"""DPO and GRPO losses against trl (the oracle) on the same batch, and GRPO's rewards and their errors."""

from __future__ import annotations

import textwrap

import datasets
import pytest
import torch

from finetune.config.methods import DPOMethod, GRPOMethod, RewardSpec
from finetune.data.collate import collate
from finetune.errors import FtError
from finetune.methods.dpo import DPO, FrozenCopy
from finetune.methods.grpo import GRPO, group_advantages
from finetune.methods.rewards import Reward, load_rewards
from tests.helpers import policy_and_reference

trl = pytest.importorskip("trl")


@pytest.fixture(scope="module")
def models():
    """A perturbed policy and the unperturbed reference, both the tiny model, and its tokenizer."""
    return policy_and_reference()


@pytest.mark.parametrize("kind", ["sigmoid", "hinge", "ipo"])
def test_dpo_loss_equals_trl_on_the_same_batch(models, kind, tmp_path):
    from trl import DPOConfig, DPOTrainer

    from finetune.tiny import preference_records

    policy, reference, tok = models
    args = DPOConfig(
        output_dir=str(tmp_path),
        report_to=[],
        loss_type=[kind],
        beta=0.2,
        per_device_train_batch_size=4,
        max_length=64,
        use_cpu=True,
        bf16=False,
    )
    trainer = DPOTrainer(
        model=policy,
        ref_model=reference,
        args=args,
        train_dataset=datasets.Dataset.from_list(preference_records(8, seed=1)),
        processing_class=tok,
    )
    # trl's tokenization: [chosen; rejected]
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    policy.train()
    with torch.no_grad():
        theirs = trainer._compute_loss(trainer.model, batch, return_outputs=False)
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    ours_batch = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "labels": labels,
        "rows": torch.arange(4),
    }
    method = DPO(DPOMethod(name="dpo", beta=0.2, loss=kind), tok.pad_token_id, 4, FrozenCopy(reference))
    with torch.no_grad():
        ours, metrics = method.loss(policy, ours_batch, normaliser=4.0)  # 4 pairs: the mean over pairs
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5)
    assert 0.0 <= metrics["rewards/accuracy"] <= 1.0


@pytest.mark.parametrize("ours_kind, trl_kind", [("sequence", "grpo"), ("token", "dapo"), ("dr_grpo", "dr_grpo")])
@pytest.mark.parametrize("kl", [0.0, 0.05])
@pytest.mark.parametrize("off_policy", [False, True])
def test_grpo_loss_and_gradients_equal_trl_on_the_same_batch(models, ours_kind, trl_kind, kl, off_policy, tmp_path):
    """off_policy: a later step on the same rollout (num_iterations > 1: the ratio to the old policy is not 1 and
    clipping acts) from a separate rollout engine (a truncated importance weight per token)."""
    from trl import GRPOConfig, GRPOTrainer

    policy, reference, tok = models
    b, p, c = 4, 6, 5
    gen = torch.Generator().manual_seed(1)
    prompt_ids, completion_ids = (
        torch.randint(10, 300, (b, p), generator=gen),
        torch.randint(10, 300, (b, c), generator=gen),
    )
    lengths = torch.tensor([5, 3, 4, 1])
    completion_mask = (torch.arange(c)[None] < lengths[:, None]).long()
    advantages = torch.tensor([1.0, -0.5, 0.3, -0.8])
    args = GRPOConfig(
        output_dir=str(tmp_path),
        report_to=[],
        loss_type=trl_kind,
        beta=kl,
        max_completion_length=c,
        num_generations=4,
        per_device_train_batch_size=4,
        use_cpu=True,
        bf16=False,
    )
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
        args=args,
        train_dataset=datasets.Dataset.from_list([{"prompt": "Reverse 123"}] * 8),
        processing_class=tok,
    )
    trainer.current_gradient_accumulation_steps = 1  # set by the Trainer's loop, which does not run here
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum(),
    }
    if kl:
        with torch.no_grad():
            logits = reference(input_ids=torch.cat([prompt_ids, completion_ids], 1)).logits[:, p - 1 : -1].float()
            inputs["ref_per_token_logps"] = logits.log_softmax(-1).gather(-1, completion_ids[..., None])[..., 0]
    if off_policy:
        with torch.no_grad():
            logits = policy(input_ids=torch.cat([prompt_ids, completion_ids], 1)).logits[:, p - 1 : -1].float()
            now = logits.log_softmax(-1).gather(-1, completion_ids[..., None])[..., 0]
        # the old policy differs by up to ±0.4 nats a token: many ratios leave [0.8, 1.2] and are clipped
        old = (now + 0.4 * (2 * torch.rand(b, c, generator=gen) - 1)) * completion_mask
        weight = torch.exp(0.6 * torch.randn(b, c, generator=gen)).clamp(max=2.0)  # π_old/π_engine, truncated
        inputs.update(old_per_token_logps=old, importance_sampling_ratio=weight)
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    policy.train()
    theirs = trainer._compute_loss(trainer.model, inputs)
    theirs.backward()
    their_grads = [q.grad.clone() for q in policy.parameters()]
    policy.zero_grad()

    rows = [
        {
            "input_ids": prompt_ids[i].tolist() + completion_ids[i, :n].tolist(),
            "labels": [-100] * p + completion_ids[i, :n].tolist(),
        }
        for i, n in enumerate(lengths.tolist())
    ]
    batch = {**collate(rows, tok.pad_token_id, "sdpa"), "advantages": advantages}
    if off_policy:  # in ft's layout: position p - 1 + k predicts completion token k
        width = batch["input_ids"].shape[1] - 1
        batch["old_logps"], batch["is_weight"] = torch.zeros(b, width), torch.zeros(b, width)
        batch["old_logps"][:, p - 1 : p - 1 + c] = inputs["old_per_token_logps"][:, : width - p + 1]
        batch["is_weight"][:, p - 1 : p - 1 + c] = inputs["importance_sampling_ratio"][:, : width - p + 1]
    section = GRPOMethod(
        name="grpo",
        rewards=[RewardSpec(function="exact_match")],
        num_generations=4,
        max_new_tokens=c,
        kl_coef=kl,
        loss_normalization=ours_kind,
    )
    method = GRPO(section, tok, 4, None, FrozenCopy(reference) if kl else None, [])
    # one micro-batch is the whole step here
    ours, metrics = method.loss(policy, batch, normaliser=float(method.tokens(batch)))
    assert (metrics["clip_fraction"] > 0.1) == off_policy  # a ratio of 1 is never clipped
    ours.backward()
    our_grads = [q.grad.clone() for q in policy.parameters()]
    policy.zero_grad()
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5, abs=1e-7)
    scale = max(g.abs().max().item() for g in their_grads)
    assert scale > 0 and max((a - b).abs().max().item() for a, b in zip(our_grads, their_grads)) < 1e-5 * scale


def test_group_advantages_are_relative_to_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, 4, scale=True)
    assert adv[:4].sum().abs() < 1e-6 and adv[0] > 0 > adv[1]
    assert torch.all(adv[4:] == 0)  # a group whose completions all score the same teaches nothing
    assert torch.allclose(group_advantages(rewards, 4, scale=False)[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_rewards_receive_completions_and_columns_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recording.py").write_text(
        textwrap.dedent("""
        CALLS = []
        def reward(completions, prompts, answer, level, **kwargs):
            CALLS.append({"completions": list(completions), "prompts": prompts, "answer": list(answer),
              "level": list(level), "kwargs": kwargs})
            return [float(len(c)) for c in completions]
    """)
    )
    section = GRPOMethod(
        name="grpo", num_generations=2, rewards=[RewardSpec(function="recording.py:reward", args={"bonus": 1})]
    )
    method = GRPO(section, _Tok(), 4, None, None, load_rewards(section.rewards))
    rows = {
        "extra": ['{"answer": "12", "level": 1}', '{"answer": "7", "level": 2}'],
        "prompt": ['[{"role": "user", "content": "a"}]', '[{"role": "user", "content": "b"}]'],
    }
    total, metrics = method.score(["x", "yy", "zzz", "wwww"], rows, [10, 11])
    import sys

    call = next(m for n, m in sys.modules.items() if n.startswith("ft_user_recording")).CALLS[-1]
    assert call["completions"] == ["x", "yy", "zzz", "wwww"]
    # each completion with its prompt's row
    assert call["answer"] == ["12", "12", "7", "7"] and call["level"] == [
        1,
        1,
        2,
        2,
    ]
    assert [p[0]["content"] for p in call["prompts"]] == ["a", "a", "b", "b"]
    assert call["kwargs"] == {"bonus": 1}
    assert total.tolist() == [1.0, 2.0, 3.0, 4.0] and metrics["rewards/reward"] == 2.5


class _Tok:
    pad_token_id, eos_token_id = 0, 1


def test_a_reward_is_logged_under_its_function_name_suffixed_where_two_share_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "sevens.py").write_text(
        "def sevens(completions, **_):\n    return [float(c.count('7')) for c in completions]\n"
    )
    specs = [
        RewardSpec(function="rewards/sevens.py:sevens"),
        RewardSpec(function="exact_match", args={"column": "answer"}),
        RewardSpec(function="exact_match", args={"column": "answer", "extract": "(\\d)"}),
    ]
    rewards = load_rewards(specs)
    assert [r.name for r in rewards] == ["sevens", "exact_match_1", "exact_match_2"]
    method = GRPO(GRPOMethod(name="grpo", num_generations=2, rewards=specs), _Tok(), 4, None, None, rewards)
    rows = {"extra": ['{"answer": "7"}'], "prompt": ['[{"role": "user", "content": "a"}]']}
    _, metrics = method.score(["77", "a 7"], rows, [0])
    assert {k: v for k, v in metrics.items() if k.startswith("rewards/")} == {
        "rewards/sevens": 1.5,
        "rewards/exact_match_1": 0.0,
        "rewards/exact_match_2": 1.0,
    }


def test_unique_reward_names():
    from finetune.methods.rewards import unique_names

    assert unique_names(["f", "g"]) == ["f", "g"]
    assert unique_names(["f", "f", "g"]) == ["f_1", "f_2", "g"]
    names = unique_names(["f", "f", "f_1"])  # a function already called f_1 keeps its name
    assert names[2] == "f_1" and len(set(names)) == 3


def test_builtin_rewards():
    from finetune.methods.rewards import exact_match, length_penalty, regex

    assert exact_match(["42", " 41", "x #### 42"], column="answer", answer=["42", "42", "42"]) == [1.0, 0.0, 0.0]
    assert exact_match(
        ["so #### 42", "#### 4"], column="answer", extract=r"####\s*(\d+)", answer=["#### 42", "#### 42"]
    ) == [1.0, 0.0]
    assert regex(["a\n#### 3", "none"], pattern=r"^####\s*\d+$") == [1.0, 0.0]
    assert length_penalty(["abcd", "abcdefgh"], limit=4) == [0.0, -1.0]


@pytest.mark.parametrize(
    "body, message",
    [
        (
            "def reward(completions, **kw):\n    raise ValueError('boom')",
            r"method.rewards\[0\].function: reward 'bad.py:reward' raised ValueError: boom .* first prompt is "
            r"data.jsonl:3",
        ),
        ("def reward(completions, **kw):\n    return [1.0]", r"returned 1 values for 2 completions"),
        (
            "def reward(completions, **kw):\n    return 0.5",
            r"returned float; it must return a list of numbers, one per completion",
        ),
        (
            "def reward(completions, **kw):\n    return [1.0, 'high']",
            r"gave 'high' for completion 1 \(prompt data.jsonl:3",
        ),
    ],
)
def test_a_bad_reward_function_is_named_with_the_sample(tmp_path, monkeypatch, body, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.py").write_text(body + "\n")
    reward = Reward(RewardSpec(function="bad.py:reward"), 0)
    with pytest.raises(FtError, match=message):
        reward(["a", "b"], [[], []], {}, ["data.jsonl:3", "data.jsonl:3"])


def test_a_reward_that_cannot_be_imported_stops_before_training(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        FtError, match=r"method.rewards\[1\].function: 'missing.py:score': the file missing.py does not exist"
    ):
        load_rewards([RewardSpec(function="exact_match"), RewardSpec(function="missing.py:score")])


@pytest.mark.slow
def test_a_preference_row_without_rejected_is_named_by_file_and_line(tmp_path):
    import subprocess
    import sys

    from tests.helpers import REPO

    data = tmp_path / "pairs.jsonl"
    data.write_text(
        '{"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"}\n{"prompt": "What is 2 + 2?", "chosen": "4"}\n'
    )
    job = tmp_path / "dpo.yaml"
    job.write_text(
        f"model: {{name: ft-tiny}}\ndata: {{datasets: [{{path: {data}, format: preference}}], seq_len: 48, cache_dir: "
        f"{tmp_path / 'c'}}}\nmethod: {{name: dpo}}\nadapter: {{type: lora}}\noutput: {{dir: {tmp_path / 'run'}}}\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "finetune", "preprocess", str(job)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{data}:2: 'rejected'" in r.stderr


def test_dpo_precomputed_reference_scores_held_out_pairs_from_their_own_table(models):
    """Held-out batches index a table of the held-out rows (not the training rows' table): the validation metrics
    equal a frozen copy's, also where the held-out set has more rows than the training set."""
    import contextlib
    from types import SimpleNamespace

    from finetune.evaluate import validation_metrics
    from finetune.methods import Context

    policy, reference, _ = models

    def pairs(n: int, offset: int) -> datasets.Dataset:
        return datasets.Dataset.from_list(
            [
                {
                    "chosen_input_ids": [5, 6 + i, 30 + offset + i],
                    "chosen_labels": [-100, -100, 30 + offset + i],
                    "rejected_input_ids": [5, 6 + i, 40 + i, 41],
                    "rejected_labels": [-100, -100, 40 + i, 41],
                }
                for i in range(n)
            ]
        )

    train, held_out = pairs(2, 0), pairs(5, 7)
    plan = SimpleNamespace(
        micro_batch_size=2, reference="precomputed", loss_implementation="plain", loss_chunk_tokens=0
    )
    context = Context(
        plan=plan,
        tokenizer=None,
        pad_id=0,
        attn="sdpa",
        engine=SimpleNamespace(model=reference),
        device="cpu",
        runtime=SimpleNamespace(rank=0, world_size=1),
        autocast=contextlib.nullcontext,
        dataset=train,
        frozen_copy=None,
        validation=held_out,
    )
    section = DPOMethod(name="dpo", beta=0.2, reference="precomputed")
    pre = DPO.create(section, context)
    copy = DPO(section, 0, 2, FrozenCopy(reference))
    got, expected = (validation_metrics(policy, m, held_out, "cpu", contextlib.nullcontext) for m in (pre, copy))
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6) and got["eval_rewards/margin"] != 0
