"""Vision-language SFT (issue 33, first part): chat records with images (content parts and the LLaVA layout), the bad
image files named by file:line, the model's processor expanding each image into tokens that are never trained, the
vision side frozen or trained as planned, and a tiny LLaVA that learns a task only its images answer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from finetune.config import load
from finetune.data.masking import IGNORE
from finetune.tiny import build_vlm, image_records, write_jsonl
from tests.helpers import REPO


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vlm")
    build_vlm(folder / "model")
    write_jsonl(image_records(240, folder / "data", seed=1), folder / "data" / "train.jsonl")
    write_jsonl(image_records(40, folder / "data", seed=2), folder / "data" / "test.jsonl")
    return folder


def job(tmp, model, data, adapter="full", steps=60, extra="") -> str:
    path = tmp / f"job-{adapter}.yaml"
    path.write_text(f"""
model: {{name: {model}{extra}}}
data: {{datasets: [{{path: {data}, format: chat}}], seq_len: 64, packing: false, cache_dir: {tmp / "cache"}}}
method: {{name: sft}}
adapter: {{type: {adapter}}}
train: {{global_batch_size: 16, lr: 2.0e-3, max_steps: {steps}, warmup_steps: 5}}
output: {{dir: {tmp / ("run-" + adapter)}, log_steps: 10}}
""")
    return str(path)


def preprocess(path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "finetune", "preprocess", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )


def answers(folder, data) -> list[str]:
    """Greedy answers of the model in `folder` (transformers + its saved processor) to the image questions in data:
    the oracle ft's generation is checked against."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(str(folder))
    model = AutoModelForImageTextToText.from_pretrained(str(folder)).eval()
    out = []
    for r in [json.loads(line) for line in data.read_text().splitlines()]:
        image, question = r["messages"][0]["content"]
        parts = [{"role": "user", "content": [{"type": "image"}, question]}]
        text = processor.apply_chat_template(parts, add_generation_prompt=True, tokenize=False)
        inputs = processor(text=[text], images=[Image.open(data.parent / image["image"]).convert("RGB")])
        inputs = {k: torch.as_tensor(v) for k, v in inputs.items()}
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        out.append(processor.tokenizer.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
    return out


def accuracy(folder, data) -> float:
    truth = [json.loads(line)["messages"][1]["content"] for line in data.read_text().splitlines()]
    return sum(a.strip() == t for a, t in zip(answers(folder, data), truth)) / len(truth)


def generated(path) -> list[str]:
    return [json.loads(line)["completion"] for line in path.read_text().splitlines()]


# ---------------------------------------------------------------- records
def test_parts_and_the_llava_layout_read_into_the_same_record(tmp_path, vlm):
    from finetune.config.schema import DatasetSpec
    from finetune.data.formats import normalize
    from finetune.vision import PLACEHOLDER

    spec = DatasetSpec(path=str(vlm / "data" / "train.jsonl"), format="chat")
    origin = f"{vlm / 'data' / 'train.jsonl'}:3"
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": "images/1-0.png"}, {"type": "text", "text": "Q?"}]},
            {"role": "assistant", "content": "red"},
        ],
        "_origin": origin,
    }
    llava = {
        "messages": [{"role": "user", "content": f"{PLACEHOLDER}Q?"}, {"role": "assistant", "content": "red"}],
        "images": ["images/1-0.png"],
        "_origin": origin,
    }
    a, b = normalize(parts, spec), normalize(llava, spec)
    assert a["messages"] == b["messages"] and a["images"] == b["images"] == [str(vlm / "data" / "images" / "1-0.png")]
    text = {"messages": [{"role": "user", "content": f"say {PLACEHOLDER}"}, {"role": "assistant", "content": "ok"}]}
    assert normalize(text, spec)["images"] == []  # no images column: the marker is text


def test_bad_images_are_named_with_file_and_line(tmp_path, vlm):
    from PIL import Image

    (tmp_path / "ok.png").write_bytes(b"")
    Image.new("RGB", (8, 8), "red").save(tmp_path / "ok.png")
    Image.new("RGB", (64, 64), "red").save(tmp_path / "whole.png")
    (tmp_path / "cut.png").write_bytes((tmp_path / "whole.png").read_bytes()[:60])
    (tmp_path / "text.png").write_text("not an image at all")
    Image.new("1", (10000, 9000)).save(tmp_path / "bomb.png")  # 90M pixels, a few kilobytes
    user = {"role": "user", "content": "<image>Q?"}
    cases = {
        "missing.png": "does not exist",
        "text.png": "not an image",
        "cut.png": "cannot be decoded",
        "bomb.png": "decompression bomb",
    }
    model = vlm / "model"

    def refusal(data) -> str:  # what ft preprocess says, in this process (one case below runs the command itself)
        from finetune.data.preprocess import prepare
        from finetune.errors import DataError

        with pytest.raises(DataError) as e:
            prepare(load(job(tmp_path, model, data)))
        return str(e.value)

    for name, why in cases.items():
        rows = [{"messages": [user, {"role": "assistant", "content": "red"}], "images": ["ok.png"]}] * 2
        rows.append({"messages": [user, {"role": "assistant", "content": "red"}], "images": [name]})
        data = write_jsonl(rows, tmp_path / f"{name}.jsonl")
        if name == "bomb.png":
            r = preprocess(job(tmp_path, model, data))
            assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
            message = r.stderr
        else:
            message = refusal(data)
        assert f"{data}:3" in message and name in message and why in message, message[-2000:]
    two = {"role": "user", "content": "<image><image>Q?"}
    for record, why in (
        ({"messages": [two, {"role": "assistant", "content": "red"}], "images": ["ok.png"]}, "2 <image> markers"),
        ({"messages": [user, {"role": "assistant", "content": "red"}], "images": ["ok.png"] * 2}, "2 images"),
        ({"messages": [user, {"role": "assistant", "content": "<image>"}], "images": ["ok.png"] * 2}, "no text"),
    ):
        data = write_jsonl([record], tmp_path / "count.jsonl")
        message = refusal(data)
        assert f"{data}:1" in message and why in message, message[-2000:]


def test_image_tokens_and_the_template_are_never_trained(vlm):
    from finetune.data.preprocess import prepare

    config = load(job(vlm, vlm / "model", vlm / "data" / "train.jsonl"))
    prepared = prepare(config)
    image_id = prepared.tokenizer.convert_tokens_to_ids("<image>")
    row = prepared.train[0]
    ids, labels = row["input_ids"], row["labels"]
    assert ids.count(image_id) == 16 and len(row["images"]) == 1  # (32 / 8)² patches, the CLS feature dropped
    assert all(label == IGNORE for token, label in zip(ids, labels) if token == image_id)
    trained = prepared.tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE])
    assert trained.replace("<|im_end|>", "").strip() in ("red", "green", "blue", "yellow")


def test_changed_image_content_prepares_the_data_again(tmp_path, vlm):

    from PIL import Image

    from finetune.data.preprocess import prepare

    data = tmp_path / "data"
    shutil.copytree(vlm / "data" / "images", data / "images")
    rows = [json.loads(line) for line in (vlm / "data" / "train.jsonl").read_text().splitlines()[:8]]
    write_jsonl(rows, data / "train.jsonl")
    config = load(job(tmp_path, vlm / "model", data / "train.jsonl"))
    assert prepare(config).built and not prepare(config).built
    Image.new("RGB", (32, 32), "white").save(data / rows[0]["messages"][0]["content"][0]["image"])
    assert prepare(config).built


def test_a_text_model_refuses_image_records_and_plans_refuse_packing_where_positions_are_3d(tmp_path, vlm):
    from finetune.config import loads
    from finetune.errors import ConfigError
    from finetune.hardware import parse
    from finetune.plan import plan
    from finetune.workflow import model_facts

    def packed(model):
        return loads(
            f"model: {{name: {model}}}\ndata: {{datasets: [{{path: {vlm / 'data' / 'train.jsonl'}, "
            "format: chat}], seq_len: 64, packing: true}\nmethod: {name: sft}\noutput: {dir: run}\n",
            environ={},
        )

    assert plan(packed(vlm / "model"), parse("cpu"), model_facts(packed(vlm / "model").model)).vision  # LLaVA packs
    qwen = tmp_path / "qwen2-vl"
    tiny_qwen2_vl().save_pretrained(qwen)
    (qwen / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "Qwen2VLImageProcessor"}))
    with pytest.raises(ConfigError, match=r"(?s)data\.packing.*qwen2_vl: its image tokens take 3-D positions"):
        plan(packed(qwen), parse("cpu"), model_facts(packed(qwen).model))
    text = loads(
        "model: {name: ft-tiny, train_vision: all}\ndata: {datasets: [{path: x.jsonl, format: chat}]}\n"
        "output: {dir: run}\n",
        environ={},
    )
    with pytest.raises(ConfigError, match=r"model\.train_vision.*no vision tower"):
        plan(text, parse("cpu"), model_facts(text.model))
    write_jsonl(image_records(4, tmp_path), tmp_path / "images.jsonl")
    from finetune.errors import FtError
    from finetune.workflow import run_preprocess

    with pytest.raises(FtError) as e:  # what ft preprocess runs, in this process
        run_preprocess(job(tmp_path, "ft-tiny", tmp_path / "images.jsonl"))
    assert f"{tmp_path / 'images.jsonl'}:1" in str(e.value) and "vision-language model" in str(e.value)


def test_a_4bit_base_leaves_every_vision_module_unquantized():
    """The skip patterns as transformers matches them (should_convert_module): tower and projector linears at any
    depth stay as they are, the language model's are quantized."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    from finetune.vision import unquantized_patterns

    kept = unquantized_patterns()
    for name in (
        "model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj",
        "model.multi_modal_projector.linear_1",
        "model.visual.blocks.3.attn.qkv",
        "model.visual.merger.mlp.0",
    ):
        assert not should_convert_module(name, kept), name
    for name in ("model.language_model.layers.0.self_attn.q_proj", "model.language_model.layers.1.mlp.down_proj"):
        assert should_convert_module(name, kept), name


def test_data_image_sizes_images_by_the_processors_own_rules_and_names_what_it_does_not_take(tmp_path, vlm):
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from finetune.config.schema import ImageSection
    from finetune.data.preprocess import prepare
    from finetune.errors import FtError
    from finetune.vision import sized

    qwen, picture = Qwen2VLImageProcessorPil(), [Image.new("RGB", (1000, 1000))]

    def grid(processor):
        return processor(images=picture, return_tensors="pt")["image_grid_thw"].tolist()

    assert grid(qwen) == [[1, 70, 70]]  # 980 x 980 pixels in 14-pixel patches
    assert grid(sized(qwen, ImageSection(max_pixels=200 * 200))) == [[1, 14, 14]]
    assert grid(sized(qwen, ImageSection(min_pixels=1200 * 1200, max_pixels=2000 * 2000))) == [[1, 86, 86]]
    path = job(tmp_path, vlm / "model", vlm / "data" / "train.jsonl")
    with pytest.raises(FtError, match=r"data\.image\.max_pixels: CLIPImageProcessorPil does not take 'max_pixels'"):
        prepare(load(path, overrides=["data.image.max_pixels=40000"]))
    with pytest.raises(FtError, match=r"(?s)data\.image\.processor\.max_patches: .*fix: use one of .*image_mean"):
        prepare(load(path, overrides=["data.image.processor={max_patches: 4}"]))
    plain, shifted = (
        prepare(load(path)),
        prepare(load(path, overrides=["data.image.processor={image_mean: [0, 0, 0]}"])),
    )
    assert shifted.path != plain.path  # the processor's settings are part of the data's fingerprint
    assert list(shifted.processor.image_processor.image_mean) == [0, 0, 0]


@pytest.mark.slow
def test_packed_samples_with_images_give_the_logits_each_gives_alone(tmp_path, vlm):
    """LLaVA (1-D positions) packs: each packed row lists its samples' images in order, and each sample's logits in the
    packed row (positions restarting, attention kept inside the sample) are the ones it gives alone."""
    from transformers import AutoModelForImageTextToText

    from finetune.attention import register
    from finetune.data.collate import collate
    from finetune.data.preprocess import prepare
    from finetune.methods.loss import MODEL_INPUTS
    from finetune.vision import Pixels

    rows = [json.loads(line) for line in (vlm / "data" / "train.jsonl").read_text().splitlines()[:9]]
    rows.insert(
        4, {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "red"}]}
    )
    data = write_jsonl(rows, vlm / "data" / "packable.jsonl")
    path = job(tmp_path, vlm / "model", data)
    plain = prepare(load(path, overrides=["data.seq_len=96"]))
    packed = prepare(load(path, overrides=["data.seq_len=96", "data.packing=true"]))
    alone = {(tuple(r["input_ids"]), tuple(r["images"])): r for r in plain.train}
    model = AutoModelForImageTextToText.from_pretrained(str(vlm / "model")).eval()
    # ft's padding-free attention over the packed row (one row, sample boundaries): the vision tower, to which LLaVA
    # passes the row's keyword arguments, still attends over all of an image's patches
    varlen = AutoModelForImageTextToText.from_pretrained(str(vlm / "model"), attn_implementation=register()).eval()
    pixels, pad = Pixels(packed.processor), packed.tokenizer.pad_token_id
    image_id = packed.tokenizer.convert_tokens_to_ids("<image>")

    def logits(row, is_packed, kernel="sdpa"):
        batch = pixels.add(collate([row], pad, kernel), [list(row["images"])], packed=is_packed)
        with torch.no_grad():
            net = varlen if kernel == "sdpa_varlen" else model
            return net(**{k: batch[k] for k in MODEL_INPUTS if k in batch}).logits[0]

    checked = 0
    for row in packed.train:
        if len(row["seq_lens"]) < 2:
            continue
        together, start, used = logits(row, True), 0, 0
        flat = logits(row, True, "sdpa_varlen")
        for n in row["seq_lens"]:
            ids = tuple(row["input_ids"][start : start + n])
            images = tuple(row["images"][used : used + ids.count(image_id) // 16])  # 16 tokens per image
            sample = alone[(ids, images)]
            expected = logits(sample, False)
            torch.testing.assert_close(together[start : start + n], expected, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(flat[start : start + n], expected, atol=1e-5, rtol=1e-5)
            start, used, checked = start + n, used + len(images), checked + 1
        assert used == len(row["images"])
    assert checked >= 4
    from tests.helpers import losses, train_here

    train_here(path, "--set", "data.seq_len=96", "--set", "data.packing=true", "--set", "output.log_steps=1")
    seen = losses(tmp_path / "run-full")
    assert len(seen) == 60 and sum(seen[-5:]) / 5 < seen[0] / 2  # packed image rows train


# ---------------------------------------------------------------- prompts
def test_prompts_with_images_are_read_expanded_and_refused_where_they_cannot_run(tmp_path, vlm):
    from finetune.artifacts import resolve
    from finetune.errors import DataError, FtError
    from finetune.infer.prompts import PromptSpec, encode, load_processor, read_prompts, template_for

    shutil.copytree(vlm / "data" / "images", tmp_path / "images")
    name = "images/1-0.png"
    rows = [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": name}, {"type": "text", "text": "Q?"}]}]},
        {"prompt": "<image>\nQ?", "images": [name], "answer": "red"},
        {"question": "no picture here"},
    ]
    write_jsonl(rows[:1], tmp_path / "prompts.jsonl")
    write_jsonl([{"prompt": r.get("prompt", r.get("question")), **r} for r in rows[1:]], tmp_path / "llava.jsonl")
    prompts = [*read_prompts(PromptSpec(str(tmp_path / "prompts.jsonl"))).prompts]
    prompts += read_prompts(PromptSpec(str(tmp_path / "llava.jsonl"))).prompts
    want = (str((tmp_path / name).resolve()),)
    assert prompts[0].images == want and prompts[1].images == want and prompts[2].images == ()
    assert prompts[1].reference == "red" and prompts[1].fields["images"] == [name]  # the output row keeps the record
    source = resolve(str(vlm / "model"))
    processor = load_processor(source, prompts)
    jinja = template_for(processor.tokenizer, "tokenizer")
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    ids = [encode(p, processor.tokenizer, jinja, processor) for p in prompts]
    assert ids[0].count(image_id) == 16 and ids[1].count(image_id) == 16 and image_id not in ids[2]
    with pytest.raises(DataError, match="prompts.jsonl:1: .*chat template"):
        encode(prompts[0], processor.tokenizer, None, processor)
    with pytest.raises(FtError, match="prompts.jsonl:1: the prompt has images, but .* no image processor"):
        load_processor(resolve("ft-tiny"), prompts)
    assert load_processor(resolve("ft-tiny"), prompts[2:]) is None  # text prompts need none
    write_jsonl([{"prompt": "Q?"}, {"prompt": "<image> Q?", "images": ["images/gone.png"]}], tmp_path / "bad.jsonl")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: image .*gone\.png.* does not exist"):
        read_prompts(PromptSpec(str(tmp_path / "bad.jsonl")))


# ---------------------------------------------------------------- training
@pytest.mark.slow
def test_full_fine_tuning_learns_what_only_the_images_answer(tmp_path, vlm, capsys):
    """From 0 (the random model) to >= 90% held-out accuracy in 60 steps on CPU; the tower stays as it was, the
    projector (model.train_vision auto: projector under full fine-tuning) and the language model change; final/
    loads with AutoModelForImageTextToText + AutoProcessor."""
    from safetensors.torch import load_file

    from finetune.infer.commands import EvalOptions, GenerateOptions, run_eval, run_generate
    from tests.helpers import train_here

    test = vlm / "data" / "test.jsonl"
    assert accuracy(vlm / "model", test) < 0.5
    train_here(job(tmp_path, vlm / "model", vlm / "data" / "train.jsonl"))
    plan = json.loads((tmp_path / "run-full" / "plan.json").read_text())
    assert plan["vision"] and plan["train_vision"] == "projector"
    final = tmp_path / "run-full" / "final"
    oracle = answers(final, test)
    truth = [json.loads(line)["messages"][1]["content"] for line in test.read_text().splitlines()]
    assert sum(a.strip() == t for a, t in zip(oracle, truth)) / len(truth) >= 0.9
    # ft eval and ft generate (their commands, in this process) read the images of the prompts and give the model's
    # own answers, in input order
    capsys.readouterr()
    options = dict(max_new_tokens=8, as_json=True, batch_size=7, metrics=["exact_match"], quiet=True)
    run_eval(EvalOptions(str(tmp_path / "run-full"), data=str(test), **options))
    trained = json.loads(capsys.readouterr().out)["metrics"]
    assert trained["exact_match"] >= 0.9
    # the answers' loss with their images (--metric loss), in this process: far below the untrained model's
    from finetune.artifacts import resolve
    from finetune.infer.evaluation import EvalJob, evaluate
    from finetune.infer.prompts import PromptSpec

    def loss(source):
        return evaluate(EvalJob(resolve(str(source)), PromptSpec(str(test)), loss=True), progress=False).metrics["loss"]

    assert loss(tmp_path / "run-full") < loss(vlm / "model") / 3
    run_generate(GenerateOptions(str(tmp_path / "run-full"), str(test), tmp_path / "out.jsonl", max_new_tokens=8))
    assert [a.strip() for a in generated(tmp_path / "out.jsonl")] == [a.strip() for a in oracle]
    before, after = load_file(str(vlm / "model" / "model.safetensors")), load_file(str(final / "model.safetensors"))
    tower = [k for k in before if "vision_tower" in k]
    projector = [k for k in before if "multi_modal_projector" in k]
    assert tower and all(torch.equal(before[k], after[k]) for k in tower)
    assert any(not torch.equal(before[k], after[k]) for k in projector)


@pytest.mark.slow
def test_lora_adapts_the_language_model_only(tmp_path, vlm):
    from safetensors.torch import load_file

    from finetune.infer.commands import GenerateOptions, run_generate
    from finetune.merge import merge_lora
    from tests.helpers import train_here

    train_here(job(tmp_path, vlm / "model", vlm / "data" / "train.jsonl", adapter="lora", steps=4))
    names = list(load_file(str(tmp_path / "run-lora" / "final" / "adapter_model.safetensors")))
    assert names and all("language_model" in n for n in names)
    assert (tmp_path / "run-lora" / "final" / "processor_config.json").is_file()
    # merge-lora: the merged folder loads with AutoModelForImageTextToText + AutoProcessor and gives base+adapter's
    # logits on a prompt with an image; generating from the run (adapter merged in memory) and from it agree
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from finetune.vision import load_images

    merged = tmp_path / "merged"
    merge_lora(tmp_path / "run-lora", merged)  # ft merge-lora, in this process
    processor = AutoProcessor.from_pretrained(str(merged))
    record = json.loads((vlm / "data" / "test.jsonl").read_text().splitlines()[0])
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    image = load_images([str(vlm / "data" / record["messages"][0]["content"][0]["image"])])
    inputs = {k: torch.as_tensor(v) for k, v in processor(text=[text], images=image, return_tensors="pt").items()}
    base = AutoModelForImageTextToText.from_pretrained(str(vlm / "model")).eval()
    with torch.no_grad():
        before = base(**inputs).logits
        want = PeftModel.from_pretrained(base, str(tmp_path / "run-lora" / "final")).eval()(**inputs).logits
        got = AutoModelForImageTextToText.from_pretrained(str(merged)).eval()(**inputs).logits
    assert (want - before).abs().max() > 1e-3  # the adapter changed the answer's logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    test = vlm / "data" / "test.jsonl"
    for source, out in ((tmp_path / "run-lora", "run.jsonl"), (merged, "merged.jsonl")):
        run_generate(GenerateOptions(str(source), str(test), tmp_path / out, max_new_tokens=4))
    assert generated(tmp_path / "run.jsonl") == generated(tmp_path / "merged.jsonl")


@pytest.mark.slow
def test_two_processes_train_as_one_and_a_stopped_run_resumes_to_the_same_weights(tmp_path, vlm, monkeypatch):
    """DDP over 2 ranks (the projector trained, the tower frozen) gives the one-process losses and weights, with
    text-only records mixed in (a micro-batch of one without an image leaves the projector without a gradient), and a
    run stopped at step 3 and resumed ends where the uninterrupted one does. FSDP2 makes the tower's blocks units and
    gives the same losses."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from finetune.distributed.fsdp import decoder_layers
    from finetune.errors import Stopped
    from tests.helpers import launch_here, losses, step_hook, train_here

    names = {type(m).__name__ for m in decoder_layers(AutoModelForImageTextToText.from_pretrained(vlm / "model"))}
    assert {"CLIPEncoderLayer", "LlamaDecoderLayer"} <= names
    rows = [json.loads(line) for line in (vlm / "data" / "train.jsonl").read_text().splitlines()[:24]]
    rows += [
        {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": c}]}
        for c in ("red", "green", "blue", "yellow") * 2
    ]
    data = write_jsonl(rows, vlm / "data" / "mixed.jsonl")
    config = job(tmp_path, vlm / "model", data, steps=6)
    sets = ["--set", "train.global_batch_size=8", "--set", "train.micro_batch_size=1", "--set", "output.save_steps=3"]
    sets += ["--set", "output.log_steps=1"]
    train_here(config, *sets, "--set", f"output.dir={tmp_path / 'one'}")
    two = [*sets, "--set", f"output.dir={tmp_path / 'two'}"]  # ft train --hardware cpu:2, this process the launcher
    with monkeypatch.context() as hooked:  # the hook (FT_STEP_HOOK, which the ranks inherit) stopping after step 3
        for name, value in step_hook(tmp_path, stop_at=3).items():
            hooked.setenv(name, value)
        with pytest.raises(Stopped) as stopped:
            launch_here(config, *two)
    assert stopped.value.exit_code == 143, str(stopped.value)
    launch_here(config, *two, resume=True)
    plan = json.loads((tmp_path / "two" / "plan.json").read_text())
    assert (plan["backend"], plan["world_size"], plan["train_vision"]) == ("ddp", 2, "projector")
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(a) == 6 and a[-1] < a[0]
    assert b == pytest.approx(a, rel=1e-4, abs=1e-5)
    one = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    other = load_file(str(tmp_path / "two" / "final" / "model.safetensors"))
    assert one.keys() == other.keys()
    assert max((one[k] - other[k]).abs().max().item() for k in one) < 1e-4
    start = load_file(str(vlm / "model" / "model.safetensors"))
    projector = [k for k in one if "multi_modal_projector" in k]
    assert projector and any(not torch.equal(start[k], other[k]) for k in projector)
    # FSDP2 refuses rows with and rows without images (a micro-batch without one skips the sharded tower: the ranks'
    # collectives would differ), before any rank starts; on rows that all have images (each rank builds on the meta
    # device and reads its shards of the checkpoint's renamed LLaVA tensors, the tower's position ids recomputed by
    # CLIP's own initialiser) it gives the one-process losses
    from finetune.errors import FtError

    fsdp = [*sets, "--set", "distributed.backend=fsdp"]
    with pytest.raises(FtError, match="(?s)8 of the 32 prepared rows have no image.*fix: set distributed.backend: ddp"):
        launch_here(config, *fsdp, "--set", f"output.dir={tmp_path / 'refused'}")
    only = ["--set", f"data.datasets=[{{path: {vlm / 'data' / 'train.jsonl'}, format: chat}}]"]
    train_here(config, *sets, *only, "--set", f"output.dir={tmp_path / 'one-images'}")
    launch_here(config, *fsdp, *only, "--set", f"output.dir={tmp_path / 'fsdp'}")
    assert json.loads((tmp_path / "fsdp" / "plan.json").read_text())["loading"] == "meta"
    assert losses(tmp_path / "fsdp") == pytest.approx(losses(tmp_path / "one-images"), rel=1e-4, abs=1e-5)


# ---------------------------------------------------------------- preferences
@pytest.mark.parametrize("kind", ["sigmoid", "ipo"])
def test_dpo_loss_on_image_pairs_equals_trl_on_the_same_batch(vlm, kind, tmp_path):
    """trl's DPOTrainer (the oracle) tokenizes image preference pairs with the processor and scores them with pixels;
    ft's DPO loss on the same batch (pixels included) is trl's."""
    import datasets
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    trl = pytest.importorskip("trl")
    from finetune.config.methods import DPOMethod
    from finetune.methods.dpo import DPO, FrozenCopy

    processor = AutoProcessor.from_pretrained(str(vlm / "model"))
    policy = AutoModelForImageTextToText.from_pretrained(str(vlm / "model"))
    reference = AutoModelForImageTextToText.from_pretrained(str(vlm / "model")).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    records = [json.loads(line) for line in (vlm / "data" / "test.jsonl").read_text().splitlines()[:4]]
    pairs = []
    for r in records:
        image, question = r["messages"][0]["content"]
        right = r["messages"][1]["content"]
        pairs.append(
            {
                "prompt": [{"role": "user", "content": [{"type": "image"}, question]}],
                "chosen": [{"role": "assistant", "content": [{"type": "text", "text": right}]}],
                "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "purple"}]}],
                "images": [Image.open(vlm / "data" / image["image"]).convert("RGB")],
            }
        )
    args = trl.DPOConfig(
        output_dir=str(tmp_path),
        report_to=[],
        loss_type=[kind],
        beta=0.2,
        per_device_train_batch_size=4,
        max_length=None,
        use_cpu=True,
        bf16=False,
    )
    trainer = trl.DPOTrainer(
        model=policy,
        ref_model=reference,
        args=args,
        train_dataset=datasets.Dataset.from_list(pairs),
        processing_class=processor,
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert batch["pixel_values"].shape[0] == 8  # each pair's image, for chosen and for rejected
    policy.train()
    with torch.no_grad():
        theirs = trainer._compute_loss(trainer.model, batch, return_outputs=False)
    ours_batch = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "labels": batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100),
        "pixel_values": batch["pixel_values"],
        "rows": torch.arange(4),
    }
    method = DPO(DPOMethod(name="dpo", beta=0.2, loss=kind), processor.tokenizer.pad_token_id, 4, FrozenCopy(reference))
    with torch.no_grad():
        ours, _ = method.loss(policy, ours_batch, normaliser=4.0)
        without_images, _ = method.loss(policy, {k: v for k, v in ours_batch.items() if k != "pixel_values"}, 4.0)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5)
    assert abs(float(without_images) - float(ours)) > 1e-4  # the pixels reach the forward


@pytest.mark.slow
@pytest.mark.parametrize("method", ["{name: dpo, beta: 0.5}", "{name: simpo, beta: 2.0, gamma: 0.5}"])
def test_preference_pairs_whose_prompts_hold_images_train_only_the_answers(tmp_path, vlm, method):
    from finetune.data.preprocess import prepare
    from tests.helpers import losses, metric_rows, train_here

    records = [json.loads(line) for line in (vlm / "data" / "train.jsonl").read_text().splitlines()[:64]]
    colours = ("red", "green", "blue", "yellow")
    pairs = [
        {
            "prompt": [r["messages"][0]],
            "chosen": r["messages"][1]["content"],
            "rejected": colours[(colours.index(r["messages"][1]["content"]) + 1) % 4],
        }
        for r in records
    ]
    data = write_jsonl(pairs, vlm / "data" / "pairs.jsonl")
    path = tmp_path / "dpo.yaml"
    path.write_text(f"""
model: {{name: {vlm / "model"}}}
data: {{datasets: [{{path: {data}, format: preference}}], seq_len: 64, cache_dir: {tmp_path / "cache"}}}
method: {method}
adapter: {{type: lora, r: 8}}
train: {{global_batch_size: 8, lr: 5.0e-3, max_steps: 8, warmup_steps: 0}}
output: {{dir: {tmp_path / "run"}, log_steps: 1}}
""")
    prepared = prepare(load(path))
    tokenizer = prepared.tokenizer
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    row = prepared.train[0]
    for side in ("chosen", "rejected"):
        ids, labels = row[f"{side}_input_ids"], row[f"{side}_labels"]
        assert ids.count(image_id) == 16 and all(b == IGNORE for a, b in zip(ids, labels) if a == image_id)
        trained = tokenizer.decode([a for a, b in zip(ids, labels) if b != IGNORE]).replace("<|im_end|>", "").strip()
        assert trained in colours
    assert row["chosen_input_ids"] != row["rejected_input_ids"] and len(row["images"]) == 1
    train_here(path)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    seen = losses(tmp_path / "run")
    assert plan["vision"] and len(seen) == 8
    if "dpo" in method:
        assert plan["reference"] == "adapter" and seen[0] == pytest.approx(0.6931, abs=1e-3)  # log 2: policy = ref
    assert sum(seen[-3:]) / 3 < seen[0] - 0.05, seen
    accuracy = [r["rewards/accuracy"] for r in metric_rows(tmp_path / "run") if "rewards/accuracy" in r]
    assert sum(accuracy[-3:]) / 3 >= 0.75  # the chosen answer, which only the image tells, is preferred


# ---------------------------------------------------------------- families whose processor cannot be built here
class QwenStyleProcessor:
    """The parts of Qwen2-VL's processor ft's batches use (transformers' Qwen2VLProcessor also needs torchvision for
    its video side, which this environment lacks): its own image processor, its model inputs (mm_token_type_ids, read
    by the model's 3-D RoPE) and the processor's own create_mm_token_type_ids."""

    model_input_names = ["input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids"]
    image_token_id = 60

    def __init__(self):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56)

    @property
    def image_token_ids(self):
        return [self.image_token_id]

    video_token_ids, audio_token_ids = [63], []

    def create_mm_token_type_ids(self, input_ids):
        from transformers.processing_utils import ProcessorMixin

        return ProcessorMixin.create_mm_token_type_ids(self, input_ids)


def tiny_qwen2_vl():
    """A randomly initialised one-layer Qwen2-VL (3-D RoPE over image tokens), seed 0."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config={
            "vocab_size": 64,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "bos_token_id": None,
            "eos_token_id": 1,
        },
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "patch_size": 14},
        image_token_id=60,
        vision_start_token_id=61,
        vision_end_token_id=62,
        video_token_id=63,
    )
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(config)


def test_a_qwen2_vl_batch_places_image_tokens_with_the_models_own_3d_positions(tmp_path):
    """Each row of ft's padded batch (collate + Pixels.add) gives the logits the model gives that sample alone with
    the inputs its processor makes; with the collated 1-D position ids instead (what a text batch carries), the image
    tokens would get text positions and the logits would differ."""
    from PIL import Image

    from finetune.data.collate import collate
    from finetune.methods.loss import MODEL_INPUTS
    from finetune.vision import Pixels

    model = tiny_qwen2_vl().eval()
    paths = []
    for k, colour in enumerate(("red", "blue")):
        Image.new("RGB", (56, 56), colour).save(tmp_path / f"{k}.png")
        paths.append(str(tmp_path / f"{k}.png"))
    # a 56x56 image: 4x4 patches of 14 pixels, merged 2x2 into 4 tokens between vision_start and vision_end
    rows = [
        {"input_ids": [5, 6, 61, *[60] * 4, 62, 7, 8, 9], "labels": [-100] * 8 + [8, 9, 1], "images": paths[:1]},
        {"input_ids": [5, 61, *[60] * 4, 62, 7], "labels": [-100] * 7 + [7], "images": paths[1:]},
    ]
    rows[0]["labels"] = rows[0]["labels"][: len(rows[0]["input_ids"])]
    pixels = Pixels(QwenStyleProcessor())
    batch = pixels.add(collate(rows, 0, "sdpa"), [r["images"] for r in rows])
    assert "position_ids" not in batch and batch["mm_token_type_ids"].sum() == 8
    with torch.no_grad():
        together = model(**{k: batch[k] for k in MODEL_INPUTS if k in batch}).logits
        for i, row in enumerate(rows):
            alone = pixels.add(collate([row], 0, "sdpa"), [row["images"]])
            want = model(**{k: alone[k] for k in MODEL_INPUTS if k in alone}).logits[0]
            torch.testing.assert_close(together[i, : len(row["input_ids"])], want, atol=1e-5, rtol=1e-5)
        flat = collate(rows, 0, "sdpa")  # 1-D positions: the model would skip its 3-D placement of the images
        wrong = model(**{k: v for k, v in {**batch, "position_ids": flat["position_ids"]}.items() if k in MODEL_INPUTS})
    assert (wrong.logits[0, :11] - together[0, :11]).abs().max() > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family, adapter", [("gemma3", "lora"), ("idefics3", "full")])
def test_other_families_train_on_images_and_answer_image_prompts(tmp_path, family, adapter):
    """Gemma 3 (image tokens attended bidirectionally through token_type_ids, sliding-window layers) and Idefics3
    (SmolVLM's architecture: pixel shuffle, its own image markers) train through their processors and answer prompts
    with images; LoRA leaves their vision side alone."""
    from safetensors.torch import load_file

    from finetune.artifacts import resolve
    from finetune.infer.engines import Sampling
    from finetune.infer.generate import generate
    from finetune.infer.job import GenerateJob
    from finetune.infer.prompts import PromptSpec
    from tests.helpers import losses, train_here
    from tests.vlm_builders import VLM_FAMILIES

    VLM_FAMILIES[family](tmp_path / "model")
    write_jsonl(image_records(24, tmp_path / "data", seed=1), tmp_path / "data" / "train.jsonl")
    write_jsonl(image_records(5, tmp_path / "data", seed=2), tmp_path / "data" / "test.jsonl")
    path = job(tmp_path, tmp_path / "model", tmp_path / "data" / "train.jsonl", adapter=adapter, steps=4)
    train_here(path, "--set", "data.seq_len=128", "--set", "train.global_batch_size=8", "--set", "output.log_steps=1")
    run = tmp_path / f"run-{adapter}"
    plan = json.loads((run / "plan.json").read_text())
    assert plan["vision"] and plan["train_vision"] == ("none" if adapter == "lora" else "projector")
    seen = losses(run)
    assert len(seen) == 4 and seen[-1] < seen[0]
    if adapter == "lora":
        names = list(load_file(str(run / "final" / "adapter_model.safetensors")))
        assert names and all("language_model" in n for n in names)
    out = tmp_path / "answers.jsonl"
    job_ = GenerateJob(
        resolve(str(run)), PromptSpec(str(tmp_path / "data" / "test.jsonl")), str(out), Sampling(max_new_tokens=4)
    )
    result = generate(job_, processes=1, progress=False)
    assert result.rows == 5 and len(out.read_text().splitlines()) == 5


def test_the_planner_counts_only_the_vision_parameters_that_train():
    """Full fine-tuning leaves the tower frozen (no gradients or optimizer state for it) unless train_vision is all;
    an adapter adds the projector or the tower where they train in full."""
    from finetune.config import loads
    from finetune.hardware import parse
    from finetune.plan import plan
    from finetune.workflow import model_facts

    def trained(adapter, train_vision):
        config = loads(
            f"model: {{name: ft-tiny-vision, train_vision: {train_vision}}}\ndata: {{datasets: [{{path: "
            f"{REPO / 'examples/data/colours/train.jsonl'}, format: chat}}], seq_len: 64}}\n"
            f"adapter: {{type: {adapter}}}\noutput: {{dir: run}}\n",
            environ={},
        )
        facts = model_facts(config.model)
        return plan(config, parse("cpu"), facts).estimate.trainable_params, facts

    full, facts = trained("full", "auto")
    tower, projector = facts.vision_params - facts.projector_params, facts.projector_params
    assert tower > 0 and projector > 0
    assert full == facts.num_params - tower
    assert trained("full", "all")[0] == facts.num_params
    assert trained("full", "none")[0] == facts.num_params - tower - projector
    lora = trained("lora", "auto")[0]
    assert trained("lora", "projector")[0] == lora + projector
    assert trained("lora", "all")[0] == lora + tower + projector


def test_images_given_by_url_or_data_uri_are_fetched_once_and_bad_ones_named(tmp_path, monkeypatch):
    """http(s) URLs and data: URIs are fetched into ft's image cache once (a second read does not ask the server);
    a 404 or a non-image names the record's file:line and the URL without its query (it may hold a token)."""
    import base64
    import functools
    import http.server
    import threading

    from PIL import Image

    from finetune.config.schema import DatasetSpec
    from finetune.data.formats import RecordError, normalize

    served = tmp_path / "served"
    served.mkdir()
    Image.new("RGB", (16, 16), "red").save(served / "red.png")
    (served / "note.png").write_text("not an image")
    asked = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            asked.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(served)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("FT_IMAGE_CACHE", str(tmp_path / "cache"))
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        spec = DatasetSpec(path=str(tmp_path / "data.jsonl"), format="chat")
        inline = "data:image/png;base64," + base64.b64encode((served / "red.png").read_bytes()).decode()

        def record(ref, line=1):
            part = {"type": "image", "image": ref}
            user = {"role": "user", "content": [part, {"type": "text", "text": "Q?"}]}
            return {"messages": [user, {"role": "assistant", "content": "red"}], "_origin": f"{spec.path}:{line}"}

        first = normalize(record(f"{base}/red.png?token=secret"), spec)["images"][0]
        again = normalize(record(f"{base}/red.png?token=secret"), spec)["images"][0]
        assert first == again and first.startswith(str(tmp_path / "cache")) and len(asked) == 1
        assert Image.open(first).size == (16, 16)
        assert Image.open(normalize(record(inline), spec)["images"][0]).getpixel((0, 0)) == (255, 0, 0)
        for ref, why in ((f"{base}/gone.png?token=secret", "HTTP 404"), (f"{base}/note.png", "not an image")):
            with pytest.raises(RecordError, match=why) as e:
                normalize(record(ref), spec)
            assert "secret" not in str(e.value) and ref.split("?")[0].rsplit("/", 1)[1] in str(e.value)
    finally:
        server.shutdown()


@pytest.mark.slow
def test_kto_on_judged_rows_whose_prompts_hold_images(tmp_path, vlm):
    """KTO's rows and its mismatched pairs (a row's prompt with another row's completion, for the KL baseline) each
    carry their prompt's images; a short LoRA run widens the margin between desirable and undesirable answers."""
    from finetune.config.methods import KTOMethod
    from finetune.data.preprocess import prepare
    from finetune.methods.kto import KTO, STEP_KL
    from finetune.vision import Pixels
    from tests.helpers import metric_rows, train_here

    records = [json.loads(line) for line in (vlm / "data" / "train.jsonl").read_text().splitlines()[:64]]
    colours = ("red", "green", "blue", "yellow")
    rows = []
    for i, r in enumerate(records):
        right = r["messages"][1]["content"]
        answer = right if i % 2 else colours[(colours.index(right) + 1) % 4]
        rows.append({"prompt": [r["messages"][0]], "completion": answer, "label": bool(i % 2)})
    data = write_jsonl(rows, vlm / "data" / "judged.jsonl")
    path = tmp_path / "kto.yaml"
    path.write_text(f"""
model: {{name: {vlm / "model"}}}
data: {{datasets: [{{path: {data}, format: unpaired}}], seq_len: 64, cache_dir: {tmp_path / "cache"}}}
method: {{name: kto, beta: 0.5}}
adapter: {{type: lora, r: 8}}
train: {{global_batch_size: 8, micro_batch_size: 4, lr: 5.0e-3, max_steps: 10, warmup_steps: 0}}
output: {{dir: {tmp_path / "run"}, log_steps: 1}}
""")
    prepared = prepare(load(path))
    method = KTO(KTOMethod(name="kto"), prepared.tokenizer.pad_token_id, 4, 64, None, pixels=Pixels(prepared.processor))
    batch = method.micro_batches(prepared.train, list(range(4)))[0]
    assert batch["pixel_values"].shape[0] == 4 and batch[STEP_KL].batches[0]["pixel_values"].shape[0] == 4
    train_here(path)
    margins = [r["rewards/margin"] for r in metric_rows(tmp_path / "run") if "rewards/margin" in r]
    assert len(margins) == 10 and sum(margins[-3:]) / 3 > 0.3, margins


def test_a_built_in_template_renders_image_records_with_the_processors_image_marker(tmp_path, vlm):
    """data.template chatml (a template of strings, not content parts): each image becomes the text the processor's own
    template writes for it, which the processor expands; the loss stays on the answer."""
    from finetune.data.preprocess import prepare
    from finetune.vision import image_marker
    from tests.vlm_builders import build_gemma3_vlm

    path = job(tmp_path, vlm / "model", vlm / "data" / "train.jsonl")
    prepared = prepare(load(path, overrides=["data.template=chatml"]))
    tokenizer, row = prepared.tokenizer, prepared.train[0]
    assert row["input_ids"].count(tokenizer.convert_tokens_to_ids("<image>")) == 16
    trained = tokenizer.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != IGNORE])
    assert trained.replace("<|im_end|>", "") in ("red", "green", "blue", "yellow")
    _, gemma = build_gemma3_vlm(tmp_path / "gemma3")
    assert image_marker(gemma).strip() == "<start_of_image>" and image_marker(prepared.processor) == "<image>"
