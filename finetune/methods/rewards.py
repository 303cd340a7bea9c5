"""GRPO reward functions: built-ins, user functions, and the weighted sum with clear errors.

A reward function is called once per rollout as
    fn(completions, prompts=..., **columns, **args) -> list of numbers, one per completion
where `completions` are the generated texts, `prompts` the prompt conversations (one per completion),
`columns` every extra column of the prompt_only dataset (each a list aligned with `completions`), and
`args` the function's `args` from the YAML. A trained reward model (`model:` instead of `function:`) is called the
same way: finetune/methods/reward_model.py. Built-ins:
  exact_match(column, extract=None)   1.0 when the answer equals the row's `column` (both stripped; with
                                      `extract`, a regex applied to both: its first group, or the match)
  regex(pattern)                      1.0 when `pattern` is found in the completion
  length_penalty(limit)               0 up to `limit` characters, then −(length − limit) / limit
"""

from __future__ import annotations

import math
import re

from finetune.errors import FtError


def _extract(text: str, pattern: str | None) -> str | None:
    if pattern is None:
        return text.strip()
    m = re.search(pattern, text)
    if m is None:
        return None
    return (m.group(1) if m.groups() else m.group(0)).strip()


def exact_match(completions, column: str = "answer", extract: str | None = None, **columns):
    if column not in columns:
        raise KeyError(
            f"the dataset has no column {column!r} (it has: "
            f"{', '.join(sorted(k for k in columns if k != 'prompts')) or 'none'})"
        )
    out = []
    for text, reference in zip(completions, columns[column]):
        got, want = _extract(text, extract), _extract(str(reference), extract)
        out.append(1.0 if got is not None and got == want else 0.0)
    return out


def regex(completions, pattern: str, **_):
    compiled = re.compile(pattern, re.MULTILINE)
    return [1.0 if compiled.search(text) else 0.0 for text in completions]


def length_penalty(completions, limit: int = 200, **_):
    return [0.0 if len(t) <= limit else -(len(t) - limit) / limit for t in completions]


BUILT_IN = {"exact_match": exact_match, "regex": regex, "length_penalty": length_penalty}


class Reward:
    """One configured reward: its function (as written, and loaded), weight and YAML args, and its name: the
    function's own name (`digits_right` for `rewards/arithmetic.py:digits_right`), which its metric is logged under
    (`rewards/digits_right`)."""

    def __init__(self, spec, index: int, name: str | None = None):
        from finetune.userfn import load_function

        self.key = f"method.rewards[{index}].function"
        self.function = spec.function
        self.name = name or function_name(spec.function)
        self.fn = BUILT_IN.get(spec.function) or load_function(spec.function, self.key)
        self.weight, self.args = spec.weight, dict(spec.args)

    def __call__(
        self, completions: list[str], prompts: list, columns: dict[str, list], origins: list[str]
    ) -> list[float]:
        try:
            values = self.fn(completions, prompts=prompts, **columns, **self.args)
        except Exception as e:
            raise FtError(
                f"{self.key}: reward {self.function!r} raised {type(e).__name__}: {e} — on a rollout of "
                f"{len(completions)} completions "
                f"whose first prompt is {origins[0]}; first completion: {completions[0][:80]!r}"
            ) from None
        return self._checked(values, completions, origins)

    def _checked(self, values, completions, origins) -> list[float]:
        if not hasattr(values, "__len__") or isinstance(values, (str, bytes, dict)):
            raise FtError(
                f"{self.key}: reward {self.function!r} returned {type(values).__name__}; it must return a list of "
                f"numbers, one per completion ({len(completions)})"
            )
        values = list(values)
        if len(values) != len(completions):
            raise FtError(
                f"{self.key}: reward {self.function!r} returned {len(values)} values for {len(completions)} "
                "completions; return one number per completion, in order"
            )
        out = []
        for i, v in enumerate(values):
            try:
                f = float(v)
            except (TypeError, ValueError):
                f = math.nan
            if math.isnan(f) or math.isinf(f):
                raise FtError(
                    f"{self.key}: reward {self.function!r} gave {v!r} for completion {i} (prompt {origins[i]}, "
                    f"completion {completions[i][:80]!r}); every reward must be a finite number"
                )
            out.append(f)
        return out


def function_name(function: str) -> str:
    """The name of the function a reward spec names: `exact_match`, or the part after the colon."""
    return function.rpartition(":")[2].strip() or function


def unique_names(names: list[str]) -> list[str]:
    """The names, each kept where it is unique and suffixed where several share it: [f, f, g] -> [f_1, f_2, g]."""
    out, seen = [], {}
    for name in names:
        if names.count(name) == 1:
            out.append(name)
            continue
        seen[name] = seen.get(name, 0) + 1
        candidate = f"{name}_{seen[name]}"
        while candidate in names:  # never collide with a function that is itself called `f_1`
            seen[name] += 1
            candidate = f"{name}_{seen[name]}"
        out.append(candidate)
    return out


def load_rewards(specs, device="cpu", precision: str = "fp32", max_tokens: int = 2048) -> list:
    """Every configured reward, loaded now so that a bad name stops the job before any GPU time is spent; each named
    after its function (or its reward model's folder: finetune/methods/reward_model.py), suffixed where two rewards of
    the job share a name. Reward models are loaded on `device` in `precision` and score at most `max_tokens` tokens of
    each completion with its prompt."""
    from finetune.methods.reward_model import ModelReward, model_name

    names = unique_names([function_name(s.function) if s.model is None else model_name(s.model) for s in specs])
    return [
        Reward(s, i, name) if s.model is None else ModelReward(s, i, name, device, precision, max_tokens)
        for i, (s, name) in enumerate(zip(specs, names))
    ]
