"""sdpa_varlen (finetune/attention.py): torch's varlen kernel on CUDA, per-sample SDPA elsewhere, same outputs.

This torch build's varlen kernel has no CPU implementation, so on CPU the kernel path is checked with a
stand-in (`emulated_kernel`: one masked SDPA over the row, same signature, no host reads); the real kernel
is checked by the gpu-marked tests.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from finetune import attention
from finetune.data.collate import collate
from finetune.data.packing import best_fit_decreasing
from tests.helpers import tiny_llama

LENGTHS = [1, 5, 1, 7, 3, 1]  # length-1 samples at the start, middle and end
SCALE = 0.3
BF16 = {"atol": 2e-2, "rtol": 2e-2}
SYNCS = ("tolist", "item", "cpu", "numpy", "__int__", "__index__", "__bool__", "__float__")


class Module(torch.nn.Module):  # stands in for the attention layer transformers passes as `module`
    pass


def rand_qkv(lengths, dtype=torch.float32, device="cpu", hq=4, hkv=2, d=16, seed=0):
    """query (1, hq, T, d), key and value (1, hkv, T, d), cu_seq_lens (int32)."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v = (torch.randn(1, h, t, d, generator=g).to(device=device, dtype=dtype) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu


def reference(q, k, v, lengths, scale):
    """Each sample on its own, in fp32, kv heads repeated by hand -> (1, T, Hq, D)."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    parts, start = [], 0
    for n in lengths:
        s = slice(start, start + n)
        parts.append(
            F.scaled_dot_product_attention(
                q[:, :, s].float(), k[:, :, s].float(), v[:, :, s].float(), is_causal=True, scale=scale
            )
        )
        start += n
    return torch.cat(parts, dim=2).transpose(1, 2).to(q.dtype)


class EmulatedKernel:
    """CPU stand-in for torch.nn.attention.varlen.varlen_attn: checks how it is called, counts calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        self.calls += 1
        assert q.dim() == 3 and isinstance(max_q, int) and isinstance(max_k, int)
        assert window_size == (-1, 0) and cu_q.dtype == torch.int32 and cu_q is cu_k
        assert enable_gqa == (q.shape[1] != k.shape[1])
        pos = torch.arange(q.shape[0])
        seg = torch.searchsorted(cu_q[1:].long(), pos, right=True)
        allowed = (seg[:, None] == seg[None, :]) & (pos[:, None] >= pos[None, :])
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=allowed,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return out.transpose(0, 1)


@pytest.fixture
def kernel_path(monkeypatch):
    """Route sdpa_varlen through the kernel path on CPU, with the emulated kernel."""
    fake = EmulatedKernel()
    monkeypatch.setattr(attention, "_KERNEL", fake)
    monkeypatch.setattr(attention, "uses_kernel", lambda query, dropout_p: True)
    return fake


def forbid_host_reads(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("host sync on the kernel path")

    for name in SYNCS:
        monkeypatch.setattr(torch.Tensor, name, boom)


# ------------------------------------------------------------------ CPU
@pytest.mark.skipif(attention._KERNEL is None, reason="this torch has no torch.nn.attention.varlen")
def test_torch_varlen_kernel_does_not_run_on_cpu():
    # measured with torch 2.13: aten::_flash_attention_forward has no CPU kernel. If a later torch adds one,
    # this fails: then let uses_kernel take CPU tensors too.
    q, k, v, cu = rand_qkv(LENGTHS, torch.bfloat16)
    q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))
    with pytest.raises(NotImplementedError):
        attention._KERNEL(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), window_size=(-1, 0), enable_gqa=True)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, {"atol": 1e-5, "rtol": 1e-5}), (torch.bfloat16, BF16)])
def test_cpu_takes_per_sample_fallback_and_matches_reference(monkeypatch, dtype, tol):
    fake = EmulatedKernel()
    monkeypatch.setattr(attention, "_KERNEL", fake)  # even with a kernel present, CPU tensors do not use it
    q, k, v, cu = rand_qkv(LENGTHS, dtype)
    assert not attention.uses_kernel(q, 0.0)
    out, weights = attention.sdpa_varlen_attention(
        Module().eval(), q, k, v, None, scaling=SCALE, cu_seq_lens_q=cu, max_length_q=max(LENGTHS)
    )
    assert fake.calls == 0 and weights is None
    torch.testing.assert_close(out, reference(q, k, v, LENGTHS, SCALE), **tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, {"atol": 1e-5, "rtol": 1e-5}), (torch.bfloat16, BF16)])
def test_kernel_path_is_one_call_without_host_sync_and_matches_fallback(monkeypatch, kernel_path, dtype, tol):
    q, k, v, cu = rand_qkv(LENGTHS, dtype)
    fallback = attention._per_sample(q, k, v, cu, 0.0, SCALE)
    forbid_host_reads(monkeypatch)
    out, _ = attention.sdpa_varlen_attention(
        Module().eval(), q, k, v, None, scaling=SCALE, cu_seq_lens_q=cu, max_length_q=max(LENGTHS)
    )
    monkeypatch.undo()
    assert kernel_path.calls == 1 and out.shape == (1, sum(LENGTHS), 4, 16)
    torch.testing.assert_close(out, fallback, **tol)
    torch.testing.assert_close(out, reference(q, k, v, LENGTHS, SCALE), **tol)


@pytest.mark.skipif(attention._KERNEL is None, reason="this torch has no torch.nn.attention.varlen")
def test_real_kernel_wrapper_takes_our_call_on_meta_tensors(monkeypatch):
    # meta tensors run torch's varlen_attn Python wrapper and its registered fake (shapes only), forward
    # and backward: our arguments fit its signature and nothing on the way reads tensors on the host
    monkeypatch.setattr(attention, "uses_kernel", lambda query, dropout_p: True)
    q, k, v, cu = (t.to("meta") for t in rand_qkv(LENGTHS, torch.bfloat16, d=64))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    forbid_host_reads(monkeypatch)
    out, _ = attention.sdpa_varlen_attention(
        Module().eval(), q, k, v, None, scaling=SCALE, cu_seq_lens_q=cu, max_length_q=max(LENGTHS)
    )
    out.sum().backward()
    assert out.shape == (1, sum(LENGTHS), 4, 64) and k.grad.shape == k.shape


def test_max_length_given_as_tensor_is_read_once_per_batch(monkeypatch, kernel_path):
    reads = []
    to_int = torch.Tensor.__int__
    monkeypatch.setattr(torch.Tensor, "__int__", lambda t: reads.append(1) or to_int(t))
    q, k, v, cu = rand_qkv(LENGTHS)
    for _ in range(3):  # three layers, one batch
        attention.sdpa_varlen_attention(Module().eval(), q, k, v, None, cu_seq_lens_q=cu, max_length_q=torch.tensor(7))
    assert len(reads) == 1 and attention._last_cu[1] == max(LENGTHS)
    attention.sdpa_varlen_attention(Module().eval(), q, k, v, None, cu_seq_lens_q=cu.clone())  # next batch
    assert len(reads) == 2 and kernel_path.calls == 4


def test_tiny_llama_on_kernel_path_packed_equals_separate_runs(kernel_path, packed_rows):
    examples, rows = packed_rows
    attention.register()
    model = tiny_llama("sdpa_varlen")
    batch = collate(rows, pad_id=0, attn_implementation="sdpa_varlen")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    bins = best_fit_decreasing([len(e["input_ids"]) for e in examples], 32)
    with torch.no_grad():
        packed = model(**inputs).logits[0]
        assert kernel_path.calls == model.config.num_hidden_layers  # one kernel call per layer
        start = 0
        for row, members in zip(rows, bins):
            for i, n in zip(members, row["seq_lens"]):
                alone = model(input_ids=torch.tensor([examples[i]["input_ids"]])).logits[0]
                torch.testing.assert_close(packed[start : start + n], alone, atol=1e-5, rtol=1e-5)
                start += n
    assert kernel_path.calls == model.config.num_hidden_layers  # unpacked rows have no boundaries: plain SDPA


def test_autocast_casts_q_k_v_to_its_dtype_before_choosing_the_path(monkeypatch):
    """Full fine-tuning under autocast (fp32 weights): RoPE leaves q and k in fp32 while v is bf16. sdpa_varlen casts
    the three to the autocast dtype first (as transformers' flash integration does), so the kernel choice sees bf16;
    outside autocast fp32 stays fp32 (the per-sample fallback)."""
    seen = []
    monkeypatch.setattr(attention, "uses_kernel", lambda query, dropout_p: seen.append(query.dtype) or False)
    q, k, v, cu = rand_qkv(LENGTHS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention.sdpa_varlen_attention(
            Module().eval(), q, k, v.bfloat16(), None, scaling=SCALE, cu_seq_lens_q=cu, max_length_q=max(LENGTHS)
        )
    attention.sdpa_varlen_attention(Module().eval(), q, k, v, None, scaling=SCALE, cu_seq_lens_q=cu)
    assert seen == [torch.bfloat16, torch.float32] and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference(q, k, v, LENGTHS, SCALE).bfloat16(), **BF16)


def test_tiny_llama_in_fp32_under_autocast_takes_the_kernel_path_without_host_reads(monkeypatch, packed_rows):
    """The packed forward of an fp32 model under bf16 autocast: every layer's attention is one kernel call with bf16
    q, k and v, and no layer reads the sample boundaries on the host (the fallback's `cu.tolist()`)."""
    _, rows = packed_rows
    attention.register()
    model = tiny_llama("sdpa_varlen")
    batch = collate(rows, pad_id=0, attn_implementation="sdpa_varlen")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    fake, dtypes = EmulatedKernel(), []
    monkeypatch.setattr(
        attention,
        "_KERNEL",
        lambda q, k, v, *a, **kw: dtypes.append({q.dtype, k.dtype, v.dtype}) or fake(q, k, v, *a, **kw),
    )
    # what uses_kernel answers for CUDA tensors on an sm80+ GPU (the device checks cannot pass on CPU)
    monkeypatch.setattr(
        attention, "uses_kernel", lambda query, dropout_p: query.dtype in (torch.float16, torch.bfloat16)
    )
    reads = []
    to_list = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or to_list(t))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(**inputs)
    monkeypatch.undo()
    layers = model.config.num_hidden_layers
    assert fake.calls == layers and dtypes == [{torch.bfloat16}] * layers and reads == []


# ------------------------------------------------------------------ CUDA (skipped without a GPU)
def needs_flash():
    if not attention._flash_device(torch.cuda.current_device()) or attention._KERNEL is None:
        pytest.skip("torch's varlen kernel needs flash attention on an sm80+ GPU")


@pytest.mark.gpu
def test_cuda_bf16_kernel_matches_per_sample_sdpa_forward_and_backward(monkeypatch):
    needs_flash()
    q, k, v, cu = rand_qkv(LENGTHS, torch.bfloat16, "cuda", hq=8, hkv=2, d=64)
    assert attention.uses_kernel(q, 0.0)
    calls = []
    real = attention._KERNEL
    monkeypatch.setattr(attention, "_KERNEL", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    forbid_host_reads(monkeypatch)
    out, _ = attention.sdpa_varlen_attention(
        Module().eval(), *leaves, None, scaling=SCALE, cu_seq_lens_q=cu, max_length_q=max(LENGTHS)
    )
    monkeypatch.undo()
    assert len(calls) == 1
    torch.testing.assert_close(out, reference(q, k, v, LENGTHS, SCALE), **BF16)
    slow = [t.clone().requires_grad_() for t in (q, k, v)]
    grad = torch.randn_like(out)
    out.backward(grad)
    attention._per_sample(*slow, cu, 0.0, SCALE).backward(grad)
    for fast, ref in zip(leaves, slow):
        torch.testing.assert_close(fast.grad, ref.grad, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
def test_cuda_falls_back_for_fp32_dropout_and_old_torch(monkeypatch):
    needs_flash()
    q, *_ = rand_qkv(LENGTHS, torch.bfloat16, "cuda")
    assert attention.uses_kernel(q, 0.0)
    assert not attention.uses_kernel(q.float(), 0.0)
    assert not attention.uses_kernel(q, 0.1)  # the kernel has no dropout
    monkeypatch.setattr(attention, "_KERNEL", None)
    assert not attention.uses_kernel(q, 0.0)


@pytest.mark.gpu
def test_cuda_bf16_tiny_llama_packed_equals_separate_runs(packed_rows):
    needs_flash()
    examples, rows = packed_rows
    attention.register()
    model = tiny_llama("sdpa_varlen").to("cuda", torch.bfloat16)
    batch = collate(rows, pad_id=0, attn_implementation="sdpa_varlen")
    inputs = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in batch.items() if k != "labels"}
    bins = best_fit_decreasing([len(e["input_ids"]) for e in examples], 32)
    with torch.no_grad():
        packed = model(**inputs).logits[0].float()
        start = 0
        for row, members in zip(rows, bins):
            for i, n in zip(members, row["seq_lens"]):
                alone = model(input_ids=torch.tensor([examples[i]["input_ids"]], device="cuda")).logits[0].float()
                torch.testing.assert_close(packed[start : start + n], alone, **BF16)
                start += n


@pytest.mark.gpu
def test_cuda_fp32_tiny_llama_under_bf16_autocast_takes_the_kernel_path_in_every_layer(monkeypatch, packed_rows):
    """Full fine-tuning on a GPU: fp32 weights under bf16 autocast (RoPE leaves q and k in fp32). Every layer's
    attention is one varlen kernel call in bf16, none reads the sample boundaries on the host (the fallback's
    cu.tolist()), and the logits are the per-sample fallback's."""
    needs_flash()
    _, rows = packed_rows
    attention.register()
    model = tiny_llama("sdpa_varlen").to("cuda")  # fp32 weights
    batch = collate(rows, pad_id=0, attn_implementation="sdpa_varlen")
    inputs = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in batch.items() if k != "labels"}
    calls, real, reads, to_list = [], attention._KERNEL, [], torch.Tensor.tolist
    monkeypatch.setattr(
        attention, "_KERNEL", lambda q, *a, **kw: calls.append({q.dtype, a[0].dtype}) or real(q, *a, **kw)
    )
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or to_list(t))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        fast = model(**inputs).logits.float()
    monkeypatch.undo()
    layers = model.config.num_hidden_layers
    print(f"varlen kernel calls: {len(calls)} for {layers} layers, q/k dtypes {calls}; host reads: {len(reads)}")
    assert calls == [{torch.bfloat16}] * layers and reads == []
    monkeypatch.setattr(attention, "uses_kernel", lambda query, dropout_p: False)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        torch.testing.assert_close(fast, model(**inputs).logits.float(), **BF16)


def test_unpacked_calls_are_plain_sdpa_with_padding_masks():
    """A model trained with sdpa_varlen generates with a KV cache and left padding (evaluation, GRPO rollouts):
    there it must do exactly what sdpa does, padding mask included."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.attention import register

    register()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    outs = {}
    for impl in ("sdpa", "sdpa_varlen"):
        model.config._attn_implementation = impl
        outs[impl] = model.generate(
            input_ids=ids,
            attention_mask=(ids != 0).long(),
            max_new_tokens=6,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert torch.equal(outs["sdpa"].sequences, outs["sdpa_varlen"].sequences)
    for a, b in zip(outs["sdpa"].logits, outs["sdpa_varlen"].logits):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_packed_rows_give_the_attention_their_sample_boundaries_from_the_host():
    """The per-sample path reads no tensor for its boundaries: the collator attaches them to cu_seq_lens and to_device
    keeps them (a read per layer would wait for a GPU); a cu without them is read once, not once per layer."""
    from torch.overrides import TorchFunctionMode

    from finetune.attention import _per_sample
    from finetune.data.collate import collate, to_device

    class Reads(TorchFunctionMode):
        count = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Reads.count += getattr(func, "__name__", "") == "tolist"
            return func(*args, **(kwargs or {}))

    batch = to_device(
        collate([{"input_ids": list(range(10)), "labels": list(range(10)), "seq_lens": [4, 6]}], 0, "sdpa_varlen"),
        "cpu",
    )
    cu = batch["cu_seq_lens_q"]
    assert cu.host_bounds == [0, 4, 10] == cu.tolist()
    q = torch.randn(1, 2, 10, 8)
    with Reads():
        for _ in range(3):  # three layers
            with_host = _per_sample(q, q, q, cu, 0.0, None)
    assert Reads.count == 0
    bare = cu.clone()
    with Reads():
        for _ in range(3):
            without = _per_sample(q, q, q, bare, 0.0, None)
    assert Reads.count == 1 and torch.equal(with_host, without)


def test_a_bidirectional_module_or_another_sequence_attends_as_sdpa_does_beside_a_packed_row():
    """A vision-language model passes the packed row's keyword arguments on to its vision tower: an attention module
    that is not causal, over its image's patches (another length than the row), attends over all of them as sdpa
    would, never causally sample by sample along the row's boundaries."""
    q, k, v, cu = rand_qkv(LENGTHS, hq=2)  # as many key heads as query heads: transformers' sdpa repeats none here
    tower = Module().eval()
    tower.is_causal = False
    out, _ = attention.sdpa_varlen_attention(tower, q, k, v, None, scaling=SCALE, cu_seq_lens_q=cu)
    whole = F.scaled_dot_product_attention(q, k, v, scale=SCALE).transpose(1, 2)
    torch.testing.assert_close(out, whole)
    patches = rand_qkv([5], hq=2, seed=1)[:3]  # 5 positions beside a row of sum(LENGTHS)
    out, _ = attention.sdpa_varlen_attention(Module().eval(), *patches, None, scaling=SCALE, cu_seq_lens_q=cu)
    causal = F.scaled_dot_product_attention(*patches, scale=SCALE, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, causal)  # the module's own causal attention over its 5 positions, not row samples
    packed, _ = attention.sdpa_varlen_attention(Module().eval(), q, k, v, None, scaling=SCALE, cu_seq_lens_q=cu)
    torch.testing.assert_close(packed, reference(q, k, v, LENGTHS, SCALE))  # the row itself: sample by sample
