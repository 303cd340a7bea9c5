"""A mixture-of-experts model's routers while it trains: the load-balancing loss and which experts tokens go to.

Forward hooks on the router modules (finetune/experts.py: the class the model declares for `router_logits`) record,
during a micro-batch's training forward pass only (`recording`, and only with gradients on: the reference
model's, a KL baseline's and the rollout's passes are not recorded, nor the recomputation of checkpointed layers
in the backward pass), each MoE layer's router logits and the experts it chose (its top-k indices, or the top-k of
its logits where it returns none: Llama 4).
- The load-balancing loss is transformers' own `load_balancing_loss_func` of the model's family (the function the
  model's forward calls with `output_router_logits`) over those logits, with the batch's non-padding tokens as its
  attention mask. ft does not ask the model for it: with a packed batch's 4-D mask the model's own computation
  fails (transformers 5.24 reshapes that mask as if it were 2-D). methods/loss.py `router_loss` weights it.
- Expert use: tokens per expert and layer over non-padding tokens, summed on the device across steps and read once
  per logged step (`utilisation`), summed over ranks.
The coefficient: train.router_aux_loss_coef, `auto` meaning the model's router_aux_loss_coef where its family
defines a load-balancing loss (as trl's trainers default to it), else 0. A dense model gets an inert Routing.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from finetune.errors import FtError
from finetune.methods.loss import router_loss
from finetune.models import causal_lm

KEY = "train.router_aux_loss_coef"


class Routing:
    """The routers of one training model, hooked; `coef` is 0 where no load-balancing loss is added."""

    def __init__(self, lm=None, coef: float = 0.0):
        from finetune.experts import expert_count, experts_per_token, router_spec, routers

        found = routers(lm) if lm is not None else []
        self.coef, self.layers = coef, len(found)
        self.aux_fn = _aux_function(lm) if coef else None
        self.index = router_spec(lm)[2] if found else 0
        config = lm.config.get_text_config() if found else None
        self.experts = expert_count(found[0][1], config) if found else 0
        self.top_k = experts_per_token(found[0][1], config) if found else 0
        self.mask, self.logits, self.counts, self.recording_now = None, [], None, False
        self.total = 0.0  # the step's load-balancing losses so far, weighted as router_loss weights them
        self.handles = [m.register_forward_hook(self._hook(i)) for i, (_, m) in enumerate(found)]

    @classmethod
    def attach(cls, model, setting) -> Routing:
        """The Routing of a (wrapped) training model with train.router_aux_loss_coef `setting`."""
        from finetune.experts import routers

        lm = causal_lm(model)
        if not routers(lm):
            if setting not in ("auto", 0):
                raise FtError(f"{KEY}: {type(lm).__name__} has no router to balance; remove {KEY}")
            return cls()
        return cls(lm, coefficient(lm, setting))

    @property
    def active(self) -> bool:
        return self.layers > 0

    def _hook(self, layer: int):
        def record(module, args, output):
            if not self.recording_now or not torch.is_grad_enabled():
                return
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            logits = outputs[self.index]
            self.experts = self.experts or logits.shape[-1]  # where nothing declares the count: the logits' width
            if self.coef:
                self.logits.append(logits)
            with torch.no_grad():
                chosen = next((o for o in outputs if torch.is_tensor(o) and not o.is_floating_point()), None)
                if chosen is None:
                    chosen = logits.topk(self.top_k, dim=-1).indices
                self._count(layer, chosen, logits.shape[0])

        return record

    def _count(self, layer: int, chosen: torch.Tensor, rows: int) -> None:
        if self.counts is None:
            self.counts = torch.zeros(self.layers, self.experts, dtype=torch.float32, device=chosen.device)
        mask = self.mask
        weight = (
            mask.reshape(-1).to(chosen.device, torch.float32)
            if mask is not None and mask.numel() == rows
            else torch.ones(rows, device=chosen.device)
        )
        k = chosen.shape[-1]
        self.counts[layer].scatter_add_(0, chosen.reshape(-1), weight.repeat_interleave(k))

    @contextlib.contextmanager
    def recording(self, batch: dict):
        """Record the routers during the forward passes of `batch` inside the block."""
        if not self.active:
            yield
            return
        self.mask, self.logits, self.recording_now = token_mask(batch), [], True
        try:
            yield
        finally:
            self.recording_now = False

    def aux(self) -> torch.Tensor | None:
        """The load-balancing loss of the recorded forward pass (with its graph), None where none is added."""
        if not self.coef or not self.logits:
            return None
        logits, self.logits = tuple(self.logits), []
        mask = self.mask if self.mask is not None and self.mask.numel() == logits[0].shape[0] else None
        return self.aux_fn(logits, self.experts, self.top_k, mask)

    def add_loss(self, loss: torch.Tensor, share: float) -> torch.Tensor:
        """`loss` plus the recorded forward pass's load-balancing loss, weighted by the micro-batch's `share` of the
        step's normaliser (methods/loss.py router_loss); its value is summed on the device for `step_total`."""
        aux = self.aux()
        if aux is None:
            return loss
        self.total = self.total + aux.detach().double() * share
        return loss + router_loss(aux, share, self.coef)

    def step_total(self):
        """The step's weighted sum of load-balancing losses (a device tensor, or 0.0): each rank's sum, as its
        loss's, adds up over ranks to world size × the step's aux_loss. Starts the next step at 0."""
        total, self.total = self.total, 0.0
        return total

    def utilisation(self, runtime) -> dict:
        """Expert use since the last call, summed over ranks (every rank calls it at the same steps): tokens per
        expert of each MoE layer, and the smallest and largest share of a layer's tokens that one expert took."""
        if not self.active:
            return {}
        counts = self.counts.cpu() if self.counts is not None else torch.zeros(self.layers, self.experts)
        self.counts = None
        if runtime.world_size > 1:  # a CPU tensor over the gloo side of ft's process group
            if runtime.rank % runtime.tensor_parallel:  # a tensor-parallel group's ranks saw the same tokens
                counts.zero_()
            torch.distributed.all_reduce(counts)
        shares = counts / counts.sum(-1, keepdim=True).clamp(min=1)
        return {
            "experts/min_share": float(shares.min()),
            "experts/max_share": float(shares.max()),
            "experts/tokens": [[int(n) for n in row] for row in counts.tolist()],
        }

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def coefficient(lm, setting) -> float:
    """train.router_aux_loss_coef for this model: `auto` is the model's router_aux_loss_coef where transformers
    defines a load-balancing loss for its family, else 0."""
    has_loss = _aux_function(lm) is not None
    if setting == "auto":
        return float(getattr(lm.config.get_text_config(), "router_aux_loss_coef", 0.0) or 0.0) if has_loss else 0.0
    if setting and not has_loss:
        raise FtError(
            f"{KEY}: transformers defines no load-balancing loss for {type(lm).__name__}; remove {KEY} (or set 0)"
        )
    return float(setting)


def _aux_function(lm):
    """transformers' load_balancing_loss_func of the model's family (its modeling module), or None. The family's class
    is the first transformers class in the model's MRO: FSDP2's `fully_shard` puts a class of torch's in front."""
    family = next((c for c in type(lm).__mro__ if c.__module__.startswith("transformers.models.")), type(lm))
    return getattr(sys.modules.get(family.__module__), "load_balancing_loss_func", None)


def token_mask(batch: dict) -> torch.Tensor | None:
    """(B, T) 1 on the batch's real tokens, 0 on padding; None where every position is a token (varlen rows).
    A packed batch's (B, 1, T, T) mask (data/collate.py) masks padding as a key and lets each padding position see
    only itself: a real token is one that another position sees, or that sees another (a sample of one token is
    counted as padding, the only case the mask cannot tell apart)."""
    mask = batch.get("attention_mask")
    if isinstance(mask, dict):  # one mask per layer type (data/collate.py layer_masks): each masks padding alike
        mask = next(iter(mask.values()))
    if mask is None or mask.dim() == 2:
        return mask
    allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
    others = allowed & ~torch.eye(allowed.shape[-1], dtype=torch.bool, device=allowed.device)
    return (others.any(-1) | others.any(-2)).long()
