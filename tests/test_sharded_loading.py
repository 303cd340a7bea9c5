"""The backend creates the model: FSDP2 builds it on the meta device, shards it, then fills each rank's shard from
safetensors. Checked against one process (weights, logits, first loss) and for the memory a rank peaks at.

The multi-process tests share one torchrun launch (tests/scripts/sharded_load_probe.py, 2 ranks, gloo): a LoRA job on
a tiny model (twice), the same LoRA job on a ~380M-parameter model, then a full fine-tuning DPO job on a tiny model.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from finetune.errors import FtError
from tests.helpers import REPO, random_llama, run_probe

PROBE = REPO / "tests" / "scripts" / "sharded_load_probe.py"
BIG = dict(hidden=1024, layers=24, intermediate=4096, heads=16)  # ~380M parameters: ~0.72 GiB in bf16


def llama(folder: Path, *, hidden: int, layers: int, intermediate: int, heads: int, tied: bool) -> int:
    return random_llama(folder, hidden=hidden, layers=layers, intermediate=intermediate, heads=heads, tied=tied)


def job(
    tmp: Path,
    name: str,
    model: Path,
    *,
    adapter: str,
    precision: str,
    method: str = "{name: sft}",
    data: str = "chat",
    sharded: bool = True,
) -> str:
    path = tmp / f"{name}.yaml"
    dist = "distributed: {backend: fsdp, sharding: full_shard}\n" if sharded else ""
    path.write_text(f"""
model: {{name: {model}}}
data: {{datasets: [{{path: {tmp / (data + ".jsonl")}, format: {data}}}], seq_len: 32,
  cache_dir: {tmp / "cache"}, add_special_tokens: ["<|added|>"]}}
method: {method}
adapter: {adapter}
train: {{global_batch_size: 4, micro_batch_size: 1, max_steps: 1, precision: {precision}}}
output: {{dir: {tmp / ("run-" + name)}}}
{dist}""")
    return str(path)


def torchrun(out: Path, configs: list[str], *flags: str) -> list[dict]:
    """The probe on 2 gloo ranks; its reports in (job, rank) order."""
    return run_probe(PROBE, out, configs, *flags, timeout=400)


def probe_module():
    spec = importlib.util.spec_from_file_location("sharded_load_probe", PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_jobs(tmp_path_factory):
    """One torchrun of 2 ranks under FSDP2 building, one after another: a LoRA job (bf16, tied embeddings) on a tiny
    model (its weights gathered), the same job again and then on a ~380M-parameter model (BIG) for their peak memory,
    then a full fine-tuning DPO job (fp32, untied) on a tiny model; each job adds a token. Each job's peak is measured
    from a reset mark (--fresh-peak), as first in a process; the first job pays what a process allocates once (the
    process group, lazy imports and initialisations), so the two measured ones compare alike. The tiny jobs also in
    one process."""
    from finetune.tiny import arithmetic_records, preference_records, write_jsonl

    tmp = tmp_path_factory.mktemp("sharded")
    write_jsonl(arithmetic_records(32, seed=1), tmp / "chat.jsonl")
    write_jsonl(preference_records(32, seed=1), tmp / "preference.jsonl")
    small = dict(hidden=64, layers=2, intermediate=160, heads=2)
    llama(tmp / "tied", tied=True, **small)
    llama(tmp / "untied", tied=False, **small)
    params = llama(tmp / "big", tied=False, **BIG)
    specs = {
        "lora": dict(model=tmp / "tied", adapter="{type: lora, r: 8, alpha: 16, dropout: 0.0}", precision="bf16"),
        "dpo": dict(
            model=tmp / "untied", adapter="{type: full}", precision="fp32", method="{name: dpo}", data="preference"
        ),
    }
    big = job(tmp, "big", tmp / "big", adapter="{type: lora, r: 8, alpha: 16, dropout: 0.0}", precision="bf16")
    lora = job(tmp, "lora", **specs["lora"])
    jobs = [
        lora + "@weights",
        job(tmp, "lora-again", **specs["lora"]),
        big,
        job(tmp, "dpo", **specs["dpo"]) + "@weights",
    ]
    ranks = torchrun(tmp / "two", jobs, "--fresh-peak")
    probe, one = probe_module(), tmp / "one"
    one.mkdir()
    single = [
        probe.run_job(job(tmp, f"{name}-1", sharded=False, **spec), "cpu", one, i, weights=True)
        for i, (name, spec) in enumerate(specs.items())
    ]
    return {"tmp": tmp, "ranks": ranks, "single": single, "two": tmp / "two", "one": one, "big_params": params}


def compare_weights(one: Path, two: Path) -> tuple[dict, dict]:
    a, b = torch.load(one, weights_only=True), torch.load(two, weights_only=True)
    assert (a["loading"], b["loading"]) == ("replica", "meta")
    assert a["weights"].keys() == b["weights"].keys()
    for name, w in a["weights"].items():
        # base, adapter, added rows: exactly
        assert w.dtype == b["weights"][name].dtype and torch.equal(w, b["weights"][name]), name
    return a, b


@pytest.mark.slow
def test_lora_shards_loaded_on_two_ranks_equal_one_process_and_give_its_first_step(tiny_jobs):
    a, b = compare_weights(tiny_jobs["one"] / "weights-0.pt", tiny_jobs["two"] / "weights-0.pt")
    # the adapter and the grown embeddings
    assert any("lora_A" in n for n in a["weights"]) and any("modules_to_save" in n for n in a["weights"])
    torch.testing.assert_close(b["logits"], a["logits"], atol=2e-2, rtol=2e-2)  # bf16: FSDP casts the adapter too
    losses = [r["loss"] for r in tiny_jobs["ranks"] if r["job"] == 0]
    assert losses == pytest.approx([tiny_jobs["single"][0]["loss"]] * 2, rel=1e-3)


@pytest.mark.slow
def test_full_fine_tuning_loads_equal_fp32_weights_and_a_sharded_reference_in_compute_precision(tiny_jobs):
    a, b = compare_weights(tiny_jobs["one"] / "weights-1.pt", tiny_jobs["two"] / "weights-3.pt")
    assert all(w.dtype == torch.float32 for w in b["weights"].values())  # fp32 master weights
    torch.testing.assert_close(b["logits"], a["logits"], atol=1e-5, rtol=1e-5)
    ranks = [r for r in tiny_jobs["ranks"] if r["job"] == 3]
    assert [r["reference"] for r in ranks] == ["DTensor float32"] * 2 and tiny_jobs["single"][1][
        "reference"
    ] == "Parameter float32"
    # the reference equals the policy at step 1
    assert [r["loss"] for r in ranks] == pytest.approx([math.log(2)] * 2, abs=1e-6)


@pytest.mark.slow
def test_a_rank_loading_a_380m_model_under_fsdp_holds_about_its_shard(tiny_jobs):
    params = tiny_jobs["big_params"]
    size = 2 * params  # bf16 bytes
    big = [r for r in tiny_jobs["ranks"] if r["job"] == 2]
    # the same job on a tiny model, in the same processes; each job's peak above what its rank held when it started
    base = {r["rank"]: r for r in tiny_jobs["ranks"] if r["job"] == 1}
    above = sorted(
        (r["loaded"] - r["before"] - (base[r["rank"]]["loaded"] - base[r["rank"]]["before"])) / size for r in big
    )
    stepped = sorted(
        (r["stepped"] - r["before"] - (base[r["rank"]]["stepped"] - base[r["rank"]]["before"])) / size for r in big
    )
    print(
        f"\nloading {params / 1e6:.0f}M parameters ({size / 2**20:.0f} MiB in bf16) on 2 ranks: peak RSS above the "
        f"tiny-model run, per rank {', '.join(f'{x:.3f}' for x in above)}x the bf16 size; together {sum(above):.3f}x; "
        f"after a training step {', '.join(f'{x:.3f}' for x in stepped)}x"
    )
    assert all(r["loading"] == "meta" for r in big)
    assert all(x < 0.6 for x in above[:-1]) and sum(above) < 1.6
    # a step all-gathers each layer (gloo: output, copy, the next layer prefetched); freed buffers go back (hostmem.py)
    assert all(x < 1.0 for x in stepped)  # measured: 0.66-0.67x (0.53-0.61x loaded); 2x while glibc kept them


# ---------------------------------------------------------------- the pieces, in one process
def test_checkpoint_reads_row_ranges_across_an_index_and_gives_added_rows_the_mean(tmp_path):
    from safetensors.torch import save_file

    from finetune.models import ROW_CHUNK, Checkpoint, fill_rows, row_mean

    emb, head = torch.randn(ROW_CHUNK + 10, 8).to(torch.bfloat16), torch.randn(5, 3)
    save_file({"emb": emb}, str(tmp_path / "a.safetensors"))
    save_file({"head": head}, str(tmp_path / "b.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"emb": "a.safetensors", "head": "b.safetensors"}})
    )
    ckpt = Checkpoint(tmp_path)
    assert torch.equal(ckpt.read("emb", 3, 9), emb[3:9]) and torch.equal(ckpt.read("head"), head)
    out = torch.empty(7, 8, dtype=torch.bfloat16)
    fill_rows(ckpt, "emb", ROW_CHUNK + 5, out)  # 5 rows from the file, 2 added rows
    assert torch.equal(out[:5], emb[ROW_CHUNK + 5 :])
    mean = row_mean(emb.split(ROW_CHUNK)).to(torch.bfloat16)
    assert torch.equal(out[5], mean) and torch.equal(out[6], mean)
    wide = torch.empty(2, 8, dtype=torch.float32)
    fill_rows(ckpt, "emb", 0, wide)  # converted to the shard's dtype
    assert torch.equal(wide, emb[:2].float())


def test_new_embedding_rows_are_the_same_in_the_whole_model_and_in_shards(tmp_path):
    from transformers import AutoModelForCausalLM

    from finetune.models import Checkpoint, fill_rows, resize_embeddings

    llama(tmp_path, hidden=64, layers=1, intermediate=128, heads=2, tied=False)
    net = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    rows = net.get_input_embeddings().weight.shape[0]
    resize_embeddings(net, rows + 3)
    ckpt = Checkpoint(tmp_path)
    for key, w in (
        ("model.embed_tokens.weight", net.get_input_embeddings().weight),
        ("lm_head.weight", net.get_output_embeddings().weight),
    ):
        shard = torch.empty(5, w.shape[1])
        # the last 2 old rows and the 3 new ones, as a rank holding them reads them
        fill_rows(ckpt, key, rows - 2, shard)
        assert torch.equal(shard, w[rows - 2 :].detach())


def test_a_checkpoint_without_safetensors_is_refused_with_how_to_convert(tmp_path):
    from finetune.config.schema import ModelSection
    from finetune.models import weights_folder

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FtError, match=r"has no \*\.safetensors \(it has pytorch_model\.bin\).*save_pretrained"):
        weights_folder(ModelSection(name=str(tmp_path)))


def test_adapter_starting_values_depend_only_on_seed_and_name():
    from finetune.adapters import initial_value

    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    a = initial_value(name, (8, 64), seed=3)
    assert torch.equal(a, initial_value(name, (8, 64), seed=3)) and not torch.equal(
        a, initial_value(name, (8, 64), seed=4)
    )
    assert 0 < a.abs().max() <= 1 / math.sqrt(64)  # kaiming-uniform with a=sqrt(5), as peft draws lora_A
    assert not torch.equal(a, initial_value(name.replace("layers.0", "layers.1"), (8, 64), seed=3))
    assert not initial_value(name.replace("lora_A", "lora_B"), (64, 8), seed=3).any()
    with pytest.raises(FtError, match="no starting value"):
        initial_value("base_model.model.lm_head.modules_to_save.default.weight", (4, 4), seed=3)


def test_memory_estimate_counts_loading_as_its_own_peak():
    from finetune.catalog import lookup
    from finetune.plan.memory import LOADING, Setup, estimate

    m = lookup("meta-llama/Llama-3.1-70B")
    qlora = dict(
        adapter="qlora",
        quantization="nf4",
        precision="bf16",
        optimizer="adamw_torch",
        micro_batch_size=1,
        seq_len=2048,
        gradient_checkpointing=True,
        sharding="full_shard",
        shard_size=8,
    )
    # bitsandbytes quantizes while loading: every rank loads all of it
    replica = estimate(m, Setup(**qlora, loading="replica"))
    training = sum(v for k, v in replica.device.items() if k != LOADING)
    assert replica.device[LOADING] > training and replica.device_bytes == replica.device[LOADING]
    lora = dict(qlora, adapter="lora", quantization="none")
    whole, meta = estimate(m, Setup(**lora, loading="replica")), estimate(m, Setup(**lora, loading="meta"))
    # shard + one tensor
    assert whole.device[LOADING] > 2 * m.num_params and meta.device[LOADING] < whole.device[LOADING] / 6
    assert meta.device_bytes == sum(v for k, v in meta.device.items() if k != LOADING)  # training is the peak
    accumulating = estimate(m, Setup(**lora, loading="meta", accumulation=4))
    assert accumulating.device["unsharded gradients (accumulation)"] == 4 * accumulating.trainable_params
    assert (
        "unsharded gradients (accumulation)"
        not in estimate(m, Setup(**dict(lora, adapter="full"), loading="meta", accumulation=4)).device
    )


def test_gradient_clipping_returns_the_norm_as_a_tensor_and_scales_to_the_limit():
    """The norm stays a 0-dim tensor on the gradients' device (the loop reads it with the loss, one host sync per
    step); gradients above the limit are scaled to it, those below are left exactly as they are."""
    from finetune.distributed.engine import clip_gradients
    from finetune.train import host_values

    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    params[0].grad, params[1].grad = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 4.0, 0.0, 0.0])
    norm = clip_gradients(params, 1.0)
    assert torch.is_tensor(norm) and norm.dim() == 0 and float(norm) == pytest.approx(5.0)
    assert math.sqrt(sum(float(p.grad.pow(2).sum()) for p in params)) == pytest.approx(1.0, rel=1e-5)
    assert float(clip_gradients(params, 0.0)) == pytest.approx(1.0, rel=1e-5)  # 0: measured, not clipped
    before = [p.grad.clone() for p in params]
    assert float(clip_gradients(params, 10.0)) == pytest.approx(1.0, rel=1e-5)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))  # under the limit: untouched
    assert host_values(torch.tensor(2.5), 3, torch.tensor([7.0]).sum()) == [2.5, 3.0, 7.0]


@pytest.mark.slow
def test_trim_gives_back_the_heap_a_backward_pass_freed():
    """Tensors under the mmap threshold come from the heap; freed between ones still alive, their pages stay in the
    process until hostmem.trim (run before each CPU all-gather) gives them back."""
    script = """
import torch
from finetune.distributed import hostmem


def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096


assert hostmem.return_freed_memory()
small = [torch.ones(16384) for _ in range(2048)]  # 64 KiB each, 128 MiB in all, from the heap
kept = small[::16]  # one in 16 still alive: the freed ones lie between them, below the heap's top
del small
freed = rss()
hostmem.trim()
print((freed - rss()) / 2**20)
"""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert float(r.stdout.split()[-1]) > 80  # MiB of the 120 freed
