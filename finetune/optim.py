"""Optimizer and learning-rate schedule for the trainable parameters.

`CompensatedAdamW` is AdamW for bf16 weights (plan.pure_bf16): the update is computed in fp32 and written back with
stochastic rounding or a Kahan compensation buffer, so that updates below half a bf16 ulp are not lost.
`OptimizerInBackward` steps each parameter as soon as its gradient is complete (plan.optimizer_in_backward).
"""

from __future__ import annotations

import hashlib
import math
from functools import partial

import torch
from torch.optim.adamw import adamw  # torch's functional AdamW: CompensatedAdamW runs its math

from finetune.config.schema import TrainSection
from finetune.errors import FtError

NO_DECAY = ("bias", "norm", "ln_", "layernorm")
COMPENSATIONS = ("none", "stochastic_rounding", "kahan")
BETAS, EPS = (0.9, 0.999), 1e-8
# elements of a parameter updated at a time: CompensatedAdamW's fp32 temporaries (weight, gradient, two moments and the
# rounding noise) never exceed 5 x 4 bytes x CHUNK = 320 MiB, however large the parameter (an embedding)
CHUNK = 1 << 24
# stochastic rounding draws its noise in blocks of a parameter's elements, each from a generator of its own: the same
# noise for an element however the parameter is sharded or cut into chunks (CHUNK is a multiple of it)
NOISE_BLOCK = 1 << 20


def param_groups(model, weight_decay: float) -> list[dict]:
    """Trainable parameters, with no weight decay on biases and norms."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or any(k in name.lower() for k in NO_DECAY) else decay).append(p)
    return [
        g
        for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ]


def build_optimizer(model, train: TrainSection, lr: float, pure_bf16: bool = False, compensation: str = "none"):
    """The optimizer over the model's trainable parameters (after sharding: FSDP2 parameters are DTensors)."""
    return optimizer_factory(train, lr, pure_bf16, compensation)(param_groups(model, train.weight_decay), 0)


def optimizer_factory(train: TrainSection, lr: float, pure_bf16: bool, compensation: str):
    """A function (groups, first_index) -> the optimizer train.optimizer names over those parameter groups; with
    `pure_bf16` a CompensatedAdamW. `first_index`: the position of the groups' first parameter among all the trained
    ones (a per-parameter optimizer draws the rounding noise the whole-model one would)."""
    kind = train.optimizer
    if pure_bf16 and kind in ("adamw_torch", "adamw_torch_fused"):
        return lambda groups, first_index: CompensatedAdamW(
            groups, lr=lr, compensation=compensation, seed=train.seed, first_index=first_index
        )
    if pure_bf16 and compensation != "none":
        raise FtError(
            f"train.compensation: {compensation} needs train.optimizer adamw_torch or adamw_torch_fused ({kind} "
            "rounds the bf16 weights itself); set train.optimizer: adamw_torch, or train.compensation: none"
        )
    if kind in ("adamw_torch", "adamw_torch_fused"):
        fused = kind.endswith("fused") or None
        return lambda groups, first_index: torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=EPS, fused=fused)
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise FtError(f"train.optimizer: {kind} needs bitsandbytes ({e}); install it or use adamw_torch") from None
    cls = {
        "adamw_8bit": bnb.optim.AdamW8bit,
        "paged_adamw_8bit": bnb.optim.PagedAdamW8bit,
        "paged_adamw_32bit": bnb.optim.PagedAdamW32bit,
    }[kind]
    return lambda groups, first_index: cls(groups, lr=lr, betas=BETAS, eps=EPS)


def build_scheduler(optimizer, train: TrainSection, total_steps: int):
    """Linear warmup, then cosine / linear decay to zero, or constant: torch's LambdaLR over `lr_multiplier` (the
    multipliers of transformers' get_scheduler for cosine, linear and constant_with_warmup, formula for formula, as
    torchtune and torchtitan keep their own). transformers.get_scheduler itself is not called: importing
    transformers.optimization imports its Trainer utilities, which import peft and bitsandbytes (~1.8 s of CPU in every
    process, where a full fine-tuning rank needs neither). The lambda is a functools.partial, as get_scheduler's is, so
    scheduler.pt has the same contents and a checkpoint written by either resumes under the other."""
    warmup = min(train.warmup_steps or int(round(train.warmup_ratio * total_steps)), total_steps)
    multiplier = partial(lr_multiplier, kind=train.scheduler, warmup=warmup, total=total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


def lr_multiplier(step: int, *, kind: str, warmup: int, total: int) -> float:
    """The learning rate of `step` as a fraction of the configured one: 0 -> 1 linearly over `warmup` steps, then 1
    (`constant`), or down to 0 at `total` along a straight line (`linear`) or half a cosine (`cosine`)."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if kind == "constant":
        return 1.0
    if kind == "linear":
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


# ---------------------------------------------------------------- AdamW for bf16 weights
class CompensatedAdamW(torch.optim.Optimizer):
    """AdamW whose math runs in fp32 whatever the parameters' dtype, through torch's own functional AdamW
    (torch.optim.adamw.adamw, single-tensor path) on fp32 temporaries made a chunk at a time: the bf16 weight, its
    gradient and its bf16 moments are upcast, updated, then written back. The moments are rounded to nearest; the
    weight as `compensation` says:

    - `none`: rounded to nearest (updates below half a bf16 ulp are lost, as with torch's AdamW on bf16 weights);
    - `stochastic_rounding`: rounded up or down at random in proportion to the distance (uniform random bits added
      below the bf16 mantissa of the fp32 value, then truncated), so the expected weight is the exact one. The bits
      of each block of NOISE_BLOCK elements come from a generator seeded by (seed, step, parameter index, block):
      a resumed run draws what an uninterrupted one would, replicas (DDP) round alike, shards (FSDP2) as the whole
      tensor would, and nothing random needs saving;
    - `kahan`: the rounding error is kept in a bf16 buffer in the optimizer state (`compensation`) and added back
      before the next update, so the weight carried is bf16 weight + buffer.

    fp32 parameters are updated in place (the same math and result as torch.optim.AdamW). Works on DTensor parameters
    (FSDP2) by updating each rank's local shard; every state tensor has its parameter's shape and placement, so
    torch.distributed.checkpoint saves and reshards it like torch's AdamW's.
    torchao's bf16 AdamW with stochastic rounding is not used: it is private (torchao.optim._AdamW) and compiles each
    step with torch.compile (slow on CPU, a long first step everywhere)."""

    def __init__(
        self,
        params,
        lr: float,
        betas=BETAS,
        eps: float = EPS,
        weight_decay: float = 0.0,
        *,
        compensation: str = "none",
        seed: int = 0,
        first_index: int = 0,
    ):
        if compensation not in COMPENSATIONS:
            raise ValueError(f"compensation must be one of {COMPENSATIONS}, not {compensation!r}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.compensation, self.seed, self.first_index = compensation, seed, first_index
        self._generators: dict[torch.device, torch.Generator] = {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = self.first_index
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group, index)
                index += 1
        return loss

    def _state(self, p) -> dict:
        state = self.state[p]
        if not state:
            if p.dtype not in (torch.float32, torch.bfloat16):
                raise FtError(f"CompensatedAdamW updates fp32 or bf16 parameters, not {p.dtype}")
            state["step"] = torch.tensor(0.0)  # on the CPU, as torch's AdamW keeps it (neither capturable nor fused)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if self.compensation == "kahan" and p.dtype != torch.float32:
                state["compensation"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _update(self, p, group: dict, index: int) -> None:
        state = self._state(p)
        names = ("exp_avg", "exp_avg_sq", "compensation")
        tensors = [local(p), local(p.grad), *(local(state[k]) for k in names if k in state)]
        noise = None
        if self.compensation == "stochastic_rounding" and p.dtype == torch.bfloat16:
            noise = RoundingNoise(
                (self.seed, int(state["step"]), index), p.numel(), element_offset(p), self._generators
            )
        for start, pieces in chunks(tensors):
            self._update_piece(
                *pieces, step=state["step"].clone(), group=group, noise=noise.at(start) if noise else None
            )
        state["step"] += 1

    def _update_piece(self, w, g, m, v, c=None, *, step, group: dict, noise=None) -> None:
        """One piece of a parameter: fp32 temporaries (none for an fp32 parameter: updated in place), torch's AdamW
        step on them, then the write-back. `step` is a copy of the step count (AdamW increments it)."""
        w32, m32, v32 = w.float(), m.float(), v.float()
        if c is not None:
            w32 = w32.add_(c)  # the weight carried: bf16 weight + the error its last rounding left
        beta1, beta2 = group["betas"]
        adamw(
            [w32],
            [g.float()],
            [m32],
            [v32],
            [],
            [step],
            foreach=False,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
        for low, high in ((m, m32), (v, v32)):
            if high is not low:
                low.copy_(high)
        if w32 is w:
            return
        if noise is not None:
            w.copy_(stochastic_round(w32, noise(w32.numel(), w32.device).view(w32.shape)))
        else:
            rounded = w32.to(w.dtype)
            if c is not None:
                c.copy_(w32.sub_(rounded))  # what rounding lost, added back next step
            w.copy_(rounded)


class RoundingNoise:
    """The stochastic-rounding noise of one parameter at one step: 16 random bits per element of the whole tensor,
    drawn in blocks of NOISE_BLOCK elements from a generator seeded by (key, block start). `at(start)` gives a function
    (n, device) -> the noise of this rank's elements start .. start + n (rank-local positions)."""

    def __init__(self, key: tuple, numel: int, offset: int, generators: dict):
        self.key, self.numel, self.offset, self.generators = key, numel, offset, generators

    def at(self, start: int):
        return lambda n, device: self.draw(self.offset + start, n, device)

    def draw(self, first: int, n: int, device: torch.device) -> torch.Tensor:
        pieces = []
        for block in range(first // NOISE_BLOCK * NOISE_BLOCK, first + n, NOISE_BLOCK):
            # always the whole block: a generator's first k draws need not be a prefix of a longer draw (CUDA)
            size = min(NOISE_BLOCK, self.numel - block)
            bits = torch.randint(
                0, 1 << 16, (size,), dtype=torch.int32, device=device, generator=self.seeded(block, device)
            )
            pieces.append(bits[max(first - block, 0) : first + n - block])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def seeded(self, block: int, device: torch.device) -> torch.Generator:
        gen = self.generators.get(device)
        if gen is None:
            gen = self.generators[device] = torch.Generator(device=device)
        digest = hashlib.blake2b(repr((*self.key, block)).encode(), digest_size=8).digest()
        return gen.manual_seed(int.from_bytes(digest, "little") >> 1)


def stochastic_round(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """fp32 `x` (modified: a temporary) rounded to bf16 up or down in magnitude at random, with the probability of
    rounding up equal to the distance from the value below in ulps: `noise` (uniform in [0, 2^16), int32) added to the
    bits bf16 drops (the low half of the fp32 word; the carry rounds up), which are then cleared: the conversion is
    exact."""
    bits = x.view(torch.int32)
    return bits.add_(noise).bitwise_and_(-(1 << 16)).view(torch.float32).to(torch.bfloat16)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (its own storage: writes land in it), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def element_offset(p) -> int:
    """Where this rank's part of parameter `p` starts in the whole tensor, in elements (FSDP2 shards dim 0)."""
    if p.ndim == 0 or not hasattr(p, "to_local"):
        return 0
    from finetune.distributed.fsdp import local_rows

    return local_rows(p)[1] * (p.numel() // p.shape[0])


def chunks(tensors: list[torch.Tensor]):
    """(start, pieces): the tensors cut into matching flat pieces of at most CHUNK elements (whole, when one of them
    is not contiguous)."""
    n = tensors[0].numel()
    if n <= CHUNK or not all(t.is_contiguous() for t in tensors):
        yield 0, tensors
        return
    flat = [t.view(-1) for t in tensors]
    for start in range(0, n, CHUNK):
        yield start, [t[start : start + CHUNK] for t in flat]


# ---------------------------------------------------------------- the optimizer step inside the backward pass
class OptimizerInBackward(torch.optim.Optimizer):
    """One optimizer per trained parameter, each stepped by a hook as soon as its parameter's gradient is complete
    (Tensor.register_post_accumulate_grad_hook), which then frees that gradient: the whole model's gradients never
    exist at once (torch's pattern, tutorial "How to save memory by fusing the optimizer step into the backward
    pass"). For one process, no accumulation and no clipping (clipping needs every gradient first).

    This object holds the parameter groups the LR schedule drives; each per-parameter optimizer takes its group's lr
    when it steps, so the update of step k uses the lr of step k, as a normal step would. `step()` does nothing (the
    updates happened in backward); `grad_norm()` is the L2 norm of the step's gradients, summed as the hooks see them.
    A checkpoint holds the per-parameter optimizers' states (engine.TorchEngine.save)."""

    def __init__(self, model, groups: list[dict], make, lr: float):
        super().__init__(groups, {"lr": lr})
        names = {p: n for n, p in model.named_parameters()}
        self.optimizers, self._owner = {}, {}
        self._square_sum = None
        index = 0
        for number, group in enumerate(self.param_groups):
            for p in group["params"]:
                self.optimizers[names[p]] = make([{**group, "params": [p]}], index)
                # the group by its number: load_state_dict replaces the group dicts
                self._owner[p] = (self.optimizers[names[p]], number)
                p.register_post_accumulate_grad_hook(self._step_parameter)
                index += 1

    @torch.no_grad()
    def _step_parameter(self, p) -> None:
        optimizer, group = self._owner[p]
        square = p.grad.detach().float().square().sum()
        self._square_sum = square if self._square_sum is None else self._square_sum + square
        optimizer.param_groups[0]["lr"] = self.param_groups[group]["lr"]
        optimizer.step()
        p.grad = None

    def step(self, closure=None):
        """Nothing left to do: every parameter was updated in the backward pass."""
        return closure() if closure is not None else None

    def grad_norm(self) -> float:
        """The L2 norm of the gradients applied since the last call (0.0 when there were none)."""
        total, self._square_sum = self._square_sum, None
        return 0.0 if total is None else float(total.sqrt())
