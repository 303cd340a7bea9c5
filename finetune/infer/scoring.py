"""Task metrics on generated answers, one score per sample; a metric's value is their mean.

    exact_match  1 when the completion equals the reference (both trimmed)
    contains     1 when the completion contains the reference (trimmed)
    regex        the answer is extracted from the completion by a pattern (its first group when it has
                 groups, else the whole match; the first match counts); 1 when it equals the reference,
                 itself passed through the pattern when the pattern matches it (so `#### 42` style
                 references work). No match in the completion scores 0.
    function     a user function `module:function` or `file.py:function` called as
                 fn(completions, **columns) -> one number per completion, where columns holds each input
                 field as a list, and `reference` when the samples have one (as GRPO reward functions are)

The same metrics serve `ft eval` and the evaluation during training (the `evaluation:` section).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from finetune.errors import DataError, FtError

BUILT_IN = ("exact_match", "contains", "regex")


@dataclass(frozen=True)
class Metric:
    """A metric and where it was asked for (`key`: a config key or a CLI option, for messages)."""

    kind: str  # exact_match | contains | regex | function
    key: str
    pattern: str | None = None
    function: str | None = None

    @property
    def name(self) -> str:
        return self.function if self.kind == "function" else self.kind

    @property
    def needs_reference(self) -> bool:
        return self.kind in BUILT_IN


def from_section(section) -> Metric:
    """The metric of an `evaluation:` section."""
    return Metric(section.metric, "evaluation.metric", section.pattern, section.function)


def parse(text: str, pattern: str | None, key: str = "--metric") -> Metric:
    """A metric written on the command line: a built-in name, or a function spec (it has a colon)."""
    if ":" in text:
        return Metric("function", key, function=text)
    if text not in BUILT_IN:
        raise FtError(
            f"{key} {text!r}: not a metric.\n    fix: use {', '.join(BUILT_IN)}, loss, or a function as "
            "module:function or file.py:function"
        )
    if text == "regex" and not pattern:
        raise FtError(f"{key} regex needs --pattern, e.g. --pattern '####\\s*(-?\\d+)'")
    return Metric(text, key, pattern=pattern if text == "regex" else None)


def score_text(metric: str, value: float, digits: int = 2) -> str:
    """A metric's value for people: a built-in metric's (the share of samples that match, 0..1) as a percentage, any
    other (a user function's mean score, which may be any number; a loss) as the plain number."""
    return f"{100 * value:.{digits}f}%" if metric in BUILT_IN else f"{value:.4f}"


class Scorer:
    """Scores completions with one metric; built once (the function is imported, the pattern compiled)."""

    def __init__(self, metric: Metric):
        self.metric = metric
        self._regex = (
            _compile(metric.pattern, "evaluation.pattern" if metric.key.startswith("evaluation") else "--pattern")
            if metric.kind == "regex"
            else None
        )
        self._fn: Callable | None = None
        if metric.kind == "function":
            from finetune.userfn import load_function

            key = "evaluation.function" if metric.key.startswith("evaluation") else metric.key
            self._fn = load_function(metric.function, key)

    def __call__(
        self, completions: list[str], references: list[str | None], columns: dict[str, list], origins: list[str]
    ) -> list[float]:
        """One score per completion. `origins` ("file:line") name samples in error messages."""
        if self.metric.needs_reference:
            missing = next((i for i, r in enumerate(references) if r is None), None)
            if missing is not None:
                raise DataError(
                    f"{origins[missing]}: no reference answer for {self.metric.name}: the conversation does not end "
                    "with an assistant message, and the record has no answer column.\n    fix: add the answer (a "
                    "final assistant message, or an `answer` column), or name its column with --reference-field"
                )
            return [float(self._match(c, r)) for c, r in zip(completions, references)]
        if any(r is not None for r in references) and "reference" not in columns:
            columns = {**columns, "reference": list(references)}
        return call_metric(self._fn, self.metric.function, completions, columns, origins)

    def _match(self, completion: str, reference: str) -> bool:
        answer, expected = completion.strip(), reference.strip()
        if self.metric.kind == "exact_match":
            return answer == expected
        if self.metric.kind == "contains":
            return expected in answer
        found = _extract(self._regex, completion)
        return found is not None and found == (_extract(self._regex, reference) or expected)


def _compile(pattern: str | None, key: str) -> re.Pattern:
    try:
        return re.compile(pattern or "")
    except re.error as e:
        raise FtError(
            f"{key} {pattern!r}: not a regular expression ({e}).\n    fix: correct the pattern (Python re syntax)"
        ) from None


def _extract(regex: re.Pattern, text: str) -> str | None:
    m = regex.search(text)
    if m is None:
        return None
    return (m.group(1) if regex.groups else m.group(0)).strip()


def call_metric(
    fn: Callable, name: str, completions: list[str], columns: dict[str, list], origins: list[str]
) -> list[float]:
    """fn(completions, **columns) checked: one finite number per completion; failures name the sample."""
    columns = {k: v for k, v in columns.items() if k != "completions"}
    try:
        scores = fn(list(completions), **columns)
    except Exception as e:
        raise _failure(fn, name, completions, columns, origins, e) from None
    if hasattr(scores, "tolist"):
        scores = scores.tolist()
    if not isinstance(scores, (list, tuple)):
        raise FtError(
            f"metric function {name} returned {type(scores).__name__}; it must return a list with one number per "
            f"completion ({len(completions)})"
        )
    if len(scores) != len(completions):
        raise FtError(
            f"metric function {name} returned {len(scores)} scores for {len(completions)} completions; it must "
            "return one per completion"
        )
    out = []
    for i, value in enumerate(scores):
        if isinstance(value, bool) or (isinstance(value, (int, float)) and math.isfinite(value)):
            out.append(float(value))
        else:
            raise FtError(
                f"metric function {name} gave {value!r} for sample {i} ({origins[i]}); each score must be a "
                "finite number"
            )
    return out


def _failure(fn, name, completions, columns, origins, error: Exception) -> FtError:
    """The error of a failing call, with the first sample that fails on its own when one does."""
    for i in range(len(completions)):
        try:
            fn([completions[i]], **{k: [v[i]] for k, v in columns.items()})
        except Exception as e:
            return FtError(
                f"metric function {name} failed on sample {i} ({origins[i]}): {type(e).__name__}: {e}\n"
                f"    completion: {completions[i][:200]!r}\n    fix: correct the function or the data"
            )
    return FtError(
        f"metric function {name} failed on the batch of {len(completions)} samples (each alone works): "
        f"{type(error).__name__}: {error}"
    )
