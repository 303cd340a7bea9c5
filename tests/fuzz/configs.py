"""Bad job files, generated deterministically from a few valid examples.

`generate(seed)` starts from example job files and applies mutations: wrong types, out-of-range and huge
numbers, booleans where numbers belong, unknown keys and values, missing keys, broken YAML, binary and
non-UTF-8 bytes, control characters, alias bombs, deep nesting, tags, very long strings, bad `--set`
arguments and `${VAR}` references that cannot be expanded. Every case is invalid: ft must exit with code
2 and a message matching each of the case's `expect` patterns ("{file}" stands for the job file's path).
"""

from __future__ import annotations

import copy
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.fuzz import raw

REPO = Path(__file__).resolve().parents[2]
SEEDS = ("quickstart", "llama3.1-8b-lora-24gb", "qwen2.5-7b-dpo", "tiny-grpo")
HARDWARE = ("cpu", "1xA10G-24GB", "8xH100-80GB", "2x8xA100-40GB")
RAW = "__FUZZ_RAW__"  # a placeholder value, replaced by raw YAML text after dumping


@dataclass(frozen=True)
class Case:
    """One bad job file and how ft is run on it."""

    name: str
    body: bytes
    expect: tuple[str, ...]  # regular expressions; "{file}" is replaced by the escaped path of the job file
    command: str = "validate"  # or "plan" (with --hardware)
    args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)


# key path -> (kind, extra): ints and floats list values out of range after the fix
INTS = {
    ("train", "max_steps"): [0, -1, 10**12, 10**30],
    ("train", "warmup_steps"): [-1, 10**12, 10**30],
    ("train", "global_batch_size"): [0, -32, 10**9, 2**40],
    ("adapter", "r"): [0, -1, 10**9],
    ("data", "seq_len"): [8, 0, 10**12],
    ("data", "num_proc"): [0, 10**9],
    ("output", "save_steps"): [-1, 10**15],
    ("output", "keep_checkpoints"): [0, 10**12],
    ("output", "log_steps"): [0, 10**13],
    ("output", "eval_steps"): [-5, 10**14],
    ("train", "seed"): [-1, 2**64],
    ("data", "datasets", 0, "samples"): [0, -3, 10**15],
}
FLOATS = {
    ("train", "lr"): [-1e-4, 0, 1e5, 1e30],
    ("train", "weight_decay"): [-0.1, 1e9],
    ("train", "max_grad_norm"): [-1.0, 1e30],
    ("train", "warmup_ratio"): [1.5, -0.1],
    ("adapter", "alpha"): [0, -1, 1e30],
    ("adapter", "dropout"): [1.0, -0.5],
    ("distributed", "timeout_minutes"): [0, -5, 1e30],
    ("data", "datasets", 0, "weight"): [0, -1, 1e30],
    ("train", "epochs"): [0, -1, 1e30],
    ("data", "validation"): [1.0, -0.1, 5],
}
ENUMS = {
    ("train", "scheduler"): "cosine",
    ("train", "optimizer"): "adamw_torch",
    ("train", "precision"): "bf16",
    ("adapter", "type"): "lora",
    ("data", "train_on"): "assistant",
    ("data", "overlong"): "truncate",
    ("distributed", "backend"): "fsdp",
    ("distributed", "sharding"): "zero3",
    ("distributed", "offload"): "optimizer",
    ("model", "dtype"): "bf16",
    ("model", "attn_implementation"): "sdpa",
    ("data", "template"): "chatml",
    ("quantization", "type"): "nf4",
    ("output", "resume"): "auto",
    ("data", "datasets", 0, "format"): "chat",
}
STRINGS = [("model", "name"), ("output", "dir"), ("data", "datasets", 0, "path"), ("model", "revision")]
BOOLS = [("data", "packing"), ("model", "trust_remote_code"), ("adapter", "dora")]
METHOD = {
    "dpo": {"beta": [0, -1, 1e30]},
    "grpo": {"num_generations": [1, 0, 10**9], "temperature": [0, 1e30], "top_p": [0, 1.5]},
}
WRONG = ["lots", [1, 2], {"a": 1}, "", None]


def dotted(path: tuple) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def key_re(path: tuple) -> str:
    """A pattern for the key as ft prints it."""
    return re.escape(dotted(path))


def put(data: dict, path: tuple, value) -> dict:
    """A copy of `data` with `value` at `path` (sections created as needed)."""
    data = copy.deepcopy(data)
    target = data
    for part in path[:-1]:
        if isinstance(target, dict) and not isinstance(target.get(part), (dict, list)):
            target[part] = {}
        target = target[part]
    target[path[-1]] = value
    return data


def drop(data: dict, path: tuple) -> dict:
    data = copy.deepcopy(data)
    target = data
    for part in path[:-1]:
        target = target[part]
    del target[path[-1]]
    return data


def dump(data: dict, raw_text: str | None = None) -> bytes:
    text = yaml.safe_dump(data, sort_keys=False, width=10**9, allow_unicode=True)
    if raw_text is not None:
        text = text.replace(RAW, raw_text, 1)
    return text.encode("utf-8")


class Builder:
    """Collects the cases of one seed file, choosing validate or plan at random for each."""

    def __init__(self, rng: random.Random, seed: str, text: str):
        self.rng, self.seed, self.text = rng, seed, text
        self.data = yaml.safe_load(text)
        self.cases: list[Case] = []

    def add(
        self,
        kind: str,
        body: bytes,
        *expect: str,
        args: tuple = (),
        env: dict | None = None,
        command: str | None = None,
    ) -> None:
        command = command or self.rng.choice(("validate", "plan"))
        if command == "plan":
            args = (*args, "--hardware", self.rng.choice(HARDWARE))
        self.cases.append(
            Case(f"{self.seed}/{kind}/{len(self.cases)}", body, tuple(expect), command, tuple(args), dict(env or {}))
        )

    def value(self, path: tuple, value, kind: str) -> None:
        self.add(kind, dump(put(self.data, path, value)), key_re(path))

    def raw_value(self, path: tuple, text: str, kind: str, *expect: str) -> None:
        self.add(kind, dump(put(self.data, path, RAW), text), *(expect or (key_re(path),)))


def numbers(b: Builder) -> None:
    """Booleans, wrong types and out-of-range values for every numeric key."""
    r = b.rng
    for path, bad in INTS.items():
        b.value(path, r.choice([True, False]), "bool-for-int")
        b.value(path, r.choice(WRONG[:3] + [1.5]), "wrong-type-int")
        b.value(path, r.choice(bad), "int-out-of-range")
    for path, bad in FLOATS.items():
        b.value(path, True, "bool-for-float")
        b.value(path, r.choice(WRONG[:3]), "wrong-type-float")
        b.raw_value(
            path, r.choice([".inf", ".nan", "-.inf"]) if r.random() < 0.3 else repr(r.choice(bad)), "float-out-of-range"
        )
    method = b.data.get("method", {}).get("name")
    for key, bad in METHOD.get(method, {}).items():
        b.value(("method", key), r.choice(bad), "method-out-of-range")
        b.value(("method", key), True, "method-bool")


def choices(b: Builder) -> None:
    """Unknown values for every choice, misspelled or made up; wrong types for strings and booleans."""
    r = b.rng
    for path, good in ENUMS.items():
        bad = r.choice([good + r.choice("xtz"), good[:-1], good.upper() + "!", "zzz-" + good, 42])
        b.value(path, bad, "unknown-value")
    b.value(("data", "template"), "chatt", "template-typo")
    for path in STRINGS:
        b.value(path, r.choice([123, [1, 2], {"a": "b"}, True]), "wrong-type-str")
    for path in r.sample(STRINGS, 2):
        b.value(path, "x" * r.choice([300, 5000, 100_000]), "long-string")
        b.value(path, "a\0b", "nul-in-string")
        b.value(path, "ok\x07\x1b[31m", "control-in-string")
    for path in BOOLS:
        b.value(path, r.choice(["maybe", 5, [True]]), "wrong-type-bool")


def keys(b: Builder) -> None:
    """Unknown keys (misspelled, in the wrong section, made up) and missing required keys."""
    r = b.rng
    section = r.choice([s for s in ("train", "data", "output") if isinstance(b.data.get(s), dict)])
    key = r.choice(list(b.data[section]))
    b.value((section, key + r.choice("sxq")), 1, "misspelled-key")
    b.value(("output", "seq_len"), 512, "wrong-section-key")
    junk = r.choice(["trainn", "x" * 2000, "__class__", "model\0"])
    b.add("unknown-section", dump(put(b.data, (junk,), {"a": 1})), re.escape(junk[:12]))
    for path in r.sample(
        [
            ("model", "name"),
            ("model",),
            ("data",),
            ("data", "datasets"),
            ("output",),
            ("output", "dir"),
            ("data", "datasets", 0, "format"),
            ("data", "datasets", 0, "path"),
            ("method", "name"),
        ],
        3,
    ):
        try:
            body = dump(drop(b.data, path))
        except (KeyError, IndexError, TypeError):
            continue
        b.add("missing-key", body, key_re(path[:-1] + ("name",)) if path == ("method", "name") else key_re(path))


def generate(seed: int = 0) -> list[Case]:
    """Every case, in a fixed order for a given seed."""
    rng = random.Random(seed)
    cases: list[Case] = []
    for name in SEEDS:
        text = (REPO / "examples" / "yaml" / f"{name}.yaml").read_text(encoding="utf-8")
        b = Builder(rng, name, text)
        for family in (
            numbers,
            choices,
            keys,
            raw.huge_numbers,
            raw.broken,
            raw.bytes_,
            raw.bombs,
            raw.tags,
            raw.env,
            raw.overrides,
        ):
            family(b)
        cases += b.cases
    return cases


if __name__ == "__main__":
    for case in generate():
        print(case.name, case.command, json.dumps(case.args)[:80], len(case.body), case.expect)
