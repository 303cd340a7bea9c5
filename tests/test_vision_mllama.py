"""Llama 3.2 Vision (mllama, issue 33): one <|image|> token per image in the text, the image tiles read through
cross-attention layers. A batch ft builds from prepared rows carries what transformers' own MllamaProcessor makes for
the same conversations (pixels grouped per sequence, aspect ratios, the cross_attention_mask), the tiny model learns
a task only its images answer, generation with images gives transformers' answers, and packing is refused."""

from __future__ import annotations

import json

import pytest
import torch

from finetune.tiny import image_records, write_jsonl
from tests.helpers import REPO
from tests.vlm_builders import build_mllama_vlm

COLOURS = REPO / "examples" / "data" / "colours"


@pytest.fixture(scope="module")
def mllama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mllama")
    build_mllama_vlm(folder / "model")
    return folder


def job(tmp, model, data, extra="", adapter="full", steps=60) -> str:
    path = tmp / "job.yaml"
    path.write_text(f"""
model: {{name: {model}}}
data: {{datasets: [{{path: {data}, format: chat}}], seq_len: 64, packing: false, cache_dir: {tmp / "cache"}}}
adapter: {{type: {adapter}}}
train: {{global_batch_size: 16, lr: 2.0e-3, max_steps: {steps}, warmup_steps: 5}}
output: {{dir: {tmp / "run"}, log_steps: 10, save_steps: 0}}
{extra}""")
    return str(path)


def test_a_batch_carries_what_the_processor_makes_for_the_same_conversations(tmp_path, mllama):
    """Rows with one image, two images in one turn (the second seen from its own token on) and an image after some
    text: ft's collated batch has the processor's token ids, pixels, aspect ratios and cross_attention_mask, and the
    model's logits on it are the processor's batch's; without the mask's tiles the logits change."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from finetune.config import load
    from finetune.data.collate import collate
    from finetune.data.preprocess import prepare
    from finetune.methods.sft import SFT
    from finetune.vision import Pixels

    data = tmp_path / "data"
    records = image_records(3, data, seed=3)
    first, second = records[0]["messages"][0]["content"][0], records[1]["messages"][0]["content"][0]
    records[1]["messages"][0]["content"] = [
        first,
        {"type": "text", "text": "and"},
        second,
        {"type": "text", "text": "?"},
    ]
    records[2]["messages"][0]["content"] = records[2]["messages"][0]["content"][::-1]  # the question, then the image
    write_jsonl(records, data / "train.jsonl")
    config = load(job(tmp_path, mllama / "model", data / "train.jsonl"))
    prepared = prepare(config)
    rows = [prepared.train[i] for i in range(3)]

    processor = AutoProcessor.from_pretrained(str(mllama / "model"))
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image|>")
    texts, images = [], []
    for r in records:  # the processor's own rendering of each conversation, with its images
        parts = [
            {
                "role": m["role"],
                "content": [{"type": p["type"], **({"text": p["text"]} if "text" in p else {})} for p in m["content"]]
                if isinstance(m["content"], list)
                else m["content"],
            }
            for m in r["messages"]
        ]
        texts.append(processor.apply_chat_template(parts, tokenize=False))
        images.append(
            [Image.open(data / p["image"]).convert("RGB") for p in r["messages"][0]["content"] if p["type"] == "image"]
        )
    alone = [processor(text=[s], images=[i], add_special_tokens=False)["input_ids"][0] for s, i in zip(texts, images)]
    order = [next(k for k, ids in enumerate(alone) if list(ids) == r["input_ids"]) for r in rows]  # rows are shuffled
    assert sorted(order) == [0, 1, 2]
    texts, images = [texts[k] for k in order], [images[k] for k in order]
    theirs = processor(text=texts, images=images, padding=True, return_tensors="pt", add_special_tokens=False)
    for r, want in zip(rows, theirs["input_ids"]):
        n = len(r["input_ids"])
        assert r["input_ids"] == want[:n].tolist() and r["input_ids"].count(image_id) == len(r["images"])
        assert all(label == -100 for token, label in zip(r["input_ids"], r["labels"]) if token == image_id)

    ours = Pixels(processor).add(collate(rows, processor.tokenizer.pad_token_id, "sdpa"), [r["images"] for r in rows])
    assert ours["input_ids"].shape == theirs["input_ids"].shape
    for key in ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask"):
        torch.testing.assert_close(ours[key], theirs[key], msg=key)
    two = next(i for i, r in enumerate(rows) if len(r["images"]) == 2)
    at = [i for i, t in enumerate(rows[two]["input_ids"]) if t == image_id]
    mask = ours["cross_attention_mask"][two]
    assert mask[: at[0]].sum() == 0 and mask[at[0] : at[1], 0].any() and not mask[at[0] : at[1], 1].any()
    assert mask[at[1] :, 1].any() and not mask[at[1] :, 0].any()  # each image from its own token on

    model = AutoModelForImageTextToText.from_pretrained(str(mllama / "model")).eval()
    inputs = ("input_ids", "attention_mask", "pixel_values", "aspect_ratio_ids", "aspect_ratio_mask")
    with torch.no_grad():
        got = model(**{k: ours[k] for k in (*inputs, "cross_attention_mask")}).logits
        want = model(**{k: theirs[k] for k in (*inputs, "cross_attention_mask")}).logits
        blind = model(
            **{k: ours[k] for k in inputs}, cross_attention_mask=torch.zeros_like(ours["cross_attention_mask"])
        )
    keep = ours["attention_mask"].bool()
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)
    # the training loss (SFT's, as the loop computes it from the batch) is the model's own loss with the mask
    method = SFT(processor.tokenizer.pad_token_id, "sdpa", 3)
    with torch.no_grad():
        loss, _ = method.loss(model, ours, normaliser=float(method.tokens(ours)))
        theirs_loss = model(**{k: ours[k] for k in (*inputs, "cross_attention_mask")}, labels=ours["labels"]).loss
        unmasked = model(**{k: ours[k] for k in inputs}, labels=ours["labels"]).loss
    assert float(loss) == pytest.approx(float(theirs_loss), rel=1e-5)
    assert abs(float(unmasked) - float(theirs_loss)) > 1e-4  # without the mask every token would see every tile
    assert (blind.logits[keep] - got[keep]).abs().max() > 1e-3  # the tiles reach the language model through the mask


@pytest.mark.slow
def test_llama_vision_learns_what_only_the_images_answer_and_generates_transformers_answers(tmp_path, mllama):
    """Full fine-tuning (the projector trains with the language model, the tower stays) takes held-out exact match
    on the colour pictures from chance to >= 90% in 60 CPU steps; ft generate answers the held-out prompts with images
    as transformers' generate does on the saved model and its processor."""
    from PIL import Image
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from finetune.artifacts import resolve
    from finetune.infer.engines import Sampling
    from finetune.infer.generate import generate
    from finetune.infer.job import GenerateJob
    from finetune.infer.prompts import PromptSpec
    from tests.helpers import train_here

    test = COLOURS / "test.jsonl"
    extra = f"evaluation: {{path: {test}, metric: exact_match, max_new_tokens: 4}}"
    train_here(job(tmp_path, mllama / "model", COLOURS / "train.jsonl", extra))
    run = tmp_path / "run"
    result = json.loads((run / "result.json").read_text())
    plan = json.loads((run / "plan.json").read_text())
    assert plan["vision"] and plan["train_vision"] == "projector" and plan["image_tokens"] == 1
    assert result["task_before"] <= 0.5 and result["task_after"] >= 0.9, result
    before, after = (
        load_file(str(mllama / "model" / "model.safetensors")),
        load_file(str(run / "final" / "model.safetensors")),
    )
    tower = [k for k in before if k.startswith("vision_model.")]
    projector = [k for k in before if "multi_modal_projector" in k]
    cross = [k for k in before if ".layers.1.cross_attn." in k and k.endswith("_proj.weight")]
    assert tower and all(torch.equal(before[k], after[k]) for k in tower)
    assert all(not torch.equal(before[k], after[k]) for k in projector + cross)

    out = tmp_path / "answers.jsonl"
    spec = GenerateJob(resolve(str(run)), PromptSpec(str(test), samples=8), str(out), Sampling(max_new_tokens=4))
    generate(spec, processes=1, progress=False)
    ours = [json.loads(line)["completion"] for line in out.read_text().splitlines()]

    processor = AutoProcessor.from_pretrained(str(run / "final"))
    model = AutoModelForImageTextToText.from_pretrained(str(run / "final")).eval()
    stop = processor.tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])  # the template's end of turn
    theirs = []
    for r in [json.loads(line) for line in test.read_text().splitlines()[:8]]:
        image, question = r["messages"][0]["content"]
        text = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, question]}], add_generation_prompt=True, tokenize=False
        )
        inputs = processor(
            text=[text],
            images=[[Image.open(test.parent / image["image"]).convert("RGB")]],
            return_tensors="pt",
            add_special_tokens=False,
        )
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=4, do_sample=False, eos_token_id=stop)
        theirs.append(processor.tokenizer.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
    assert ours == theirs and sum(a.strip() in ("red", "green", "blue", "yellow") for a in ours) >= 7


def test_the_plan_counts_tiles_and_refuses_packing(tmp_path, mllama):
    """The plan: one image token per image in data.seq_len, the tower over every tile's padded positions (2 tiles of
    4x4 patches and a class position, padded to 24), the cross-attention layers' keys and values of them among the
    vision activations; packing refused, naming the key and the fix."""
    from finetune.config import load
    from finetune.errors import FtError
    from finetune.workflow import compile_plan

    path = job(tmp_path, mllama / "model", COLOURS / "train.jsonl", adapter="lora")
    plan = compile_plan(path, hardware="cpu")
    assert (plan.image_tokens, plan.image_patches) == (1, 48)
    assert plan.train_vision == "none"
    frozen = plan.estimate.device["vision activations"]
    trained = compile_plan(path, ["model.train_vision=all"], hardware="cpu").estimate.device["vision activations"]
    assert 0 < frozen < trained
    text = (tmp_path / "job.yaml").read_text().replace("packing: false", "packing: true")
    (tmp_path / "job.yaml").write_text(text)
    with pytest.raises(FtError, match=r"data\.packing[\s\S]*mllama[\s\S]*packing: false"):
        compile_plan(str(tmp_path / "job.yaml"), hardware="cpu")
    assert load(path)  # the job without packing is valid


def test_dpo_pairs_carry_each_prompts_tiles_on_both_sides(tmp_path, mllama):
    """A DPO micro-batch of image pairs stacks chosen rows then rejected rows: each pair's pixels, aspect ratios and
    cross_attention_mask are the same on both sides (the rows share their prompt), and the first step's loss is ln 2
    (the adapter starts as the reference)."""
    from finetune.config import load
    from finetune.config.methods import DPOMethod
    from finetune.data.preprocess import prepare
    from finetune.methods.dpo import DPO
    from finetune.vision import Pixels
    from tests.helpers import losses, train_here

    colours = ("red", "green", "blue", "yellow")
    records = image_records(8, tmp_path / "data", seed=4)
    pairs = [
        {
            "prompt": [r["messages"][0]],
            "chosen": r["messages"][1]["content"],
            "rejected": colours[(colours.index(r["messages"][1]["content"]) + 1) % 4],
        }
        for r in records
    ]
    data = write_jsonl(pairs, tmp_path / "data" / "pairs.jsonl")
    path = tmp_path / "dpo.yaml"
    path.write_text(f"""
model: {{name: {mllama / "model"}}}
data: {{datasets: [{{path: {data}, format: preference}}], seq_len: 64, cache_dir: {tmp_path / "cache"}}}
method: {{name: dpo, beta: 0.5}}
adapter: {{type: lora, r: 8}}
train: {{global_batch_size: 4, lr: 1.0e-3, max_steps: 2, warmup_steps: 0}}
output: {{dir: {tmp_path / "run"}, log_steps: 1, save_steps: 0}}
""")
    prepared = prepare(load(path))
    method = DPO(DPOMethod(name="dpo"), prepared.tokenizer.pad_token_id, 4, None, pixels=Pixels(prepared.processor))
    (batch,) = method.micro_batches(prepared.train, [0, 1, 2, 3])
    assert batch["pixel_values"].shape[:2] == (8, 1) and batch["cross_attention_mask"].shape[0] == 8
    for key in ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask"):
        assert torch.equal(batch[key][:4], batch[key][4:]), key
    image_id = prepared.tokenizer.convert_tokens_to_ids("<|image|>")
    for row, mask in zip(batch["input_ids"], batch["cross_attention_mask"]):
        at = row.tolist().index(image_id)
        assert mask[:at].sum() == 0 and mask[at:, 0].any()  # each side sees its pair's image from its token on
    train_here(path)
    assert losses(tmp_path / "run")[0] == pytest.approx(0.6931, abs=1e-3)


@pytest.mark.slow
def test_two_processes_train_as_one_with_rows_without_images(tmp_path, mllama):
    """DDP on 2 ranks with LoRA on the language model: a micro-batch of text-only rows skips the cross-attention
    layer (its LoRA weights take no part), which the plan knows from the prepared rows (image_free_rows: DDP searches
    for unused parameters), and the losses are one process's. Where every row has an image the plan says no search."""
    from tests.helpers import launch_here, losses, train_here

    records = image_records(16, tmp_path / "data", seed=5)
    for r in records[4:]:  # most rows text only: micro-batches without an image on either rank
        r["messages"][0]["content"] = "What colour is the square?"
    write_jsonl(records, tmp_path / "data" / "mixed.jsonl")
    write_jsonl(records[:4], tmp_path / "data" / "imaged.jsonl")
    runs = {}
    for name, data, hardware in (("one", "mixed", "cpu"), ("two", "mixed", "cpu:2"), ("imaged", "imaged", "cpu")):
        path = tmp_path / f"{name}.yaml"
        job(tmp_path, mllama / "model", tmp_path / "data" / f"{data}.jsonl", adapter="lora", steps=3)
        text = (tmp_path / "job.yaml").read_text().replace(str(tmp_path / "run"), str(tmp_path / name))
        path.write_text(text.replace("global_batch_size: 16", "global_batch_size: 8, micro_batch_size: 2"))
        (train_here if hardware == "cpu" else launch_here)(path, hardware=hardware)
        runs[name] = json.loads((tmp_path / name / "plan.json").read_text())
    assert runs["two"]["backend"] == "ddp" and runs["two"]["image_free_rows"] is True
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-4, abs=1e-5)
    assert runs["imaged"]["image_free_rows"] is False
