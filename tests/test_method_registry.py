"""Methods register themselves: a method ft does not ship (a section and a class defined here, no file of ft edited)
is found by `build`, and the checks, the planner and the memory estimate take what they need from its section."""

from __future__ import annotations

import ast
import subprocess
import sys
from types import SimpleNamespace
from typing import ClassVar, Literal, get_args

import pytest

from finetune import methods
from finetune.catalog import lookup
from finetune.config import loads
from finetune.config.checks import check
from finetune.config.methods import Method, MethodSection
from finetune.errors import FtError
from finetune.hardware import parse
from finetune.plan import plan
from tests.helpers import MINIMAL, REPO

MODEL = "meta-llama/Llama-3.1-8B"


class ToySection(MethodSection):
    """A method that trains on chat data, three sequences per row, against a frozen copy of the model."""

    formats: ClassVar[frozenset[str]] = frozenset({"chat"})
    sequences_per_row: ClassVar[int] = 3
    learning_rates: ClassVar[tuple[float, float]] = (3e-6, 3e-5)

    name: Literal["toy"]
    """Method name."""

    def reference_kind(self, adapter: str) -> str:
        return "copy"


@methods.register("toy")
class Toy:
    """The trainer's side of the toy method: it only records what it was built from."""

    def __init__(self, section, context):
        self.section, self.context, self.validates = section, context, section.validates

    @classmethod
    def create(cls, section, context):
        return cls(section, context)

    def micro_batches(self, dataset, rows):
        return [{"rows": rows}]

    def tokens(self, batch):
        return len(batch["rows"])

    def loss(self, model, batch, normaliser):
        raise AssertionError("the registry tests build the toy method; none of them trains it")


def config(overrides=(), method=True):
    text = MINIMAL.replace("  lr: 2.0e-4\n", "").replace("  packing: true\n", "")
    c = loads(text, overrides=list(overrides), environ={})
    return c.model_copy(update={"method": ToySection(name="toy")}) if method else c


def test_build_finds_a_method_registered_outside_ft():
    job = config()
    job_plan = plan(job, parse("1xH100-80GB"), lookup(MODEL))
    tokenizer = SimpleNamespace(pad_token_id=None, eos_token_id=7)
    prepared = SimpleNamespace(tokenizer=tokenizer, train=["row"] * 4)
    built = methods.build(job, job_plan, prepared, "sdpa", "engine", "cpu", "runtime", lambda: None)
    assert isinstance(built, Toy) and built.name == "toy" and built.validates
    assert built.section is job.method
    ctx = built.context
    assert ctx.plan is job_plan and ctx.pad_id == 7 and ctx.engine == "engine" and ctx.dataset == prepared.train
    assert methods.method_class("toy") is Toy


def test_the_planner_takes_its_needs_from_the_section():
    job, sft = config(), config(method=False)
    fixed = ["train.micro_batch_size=1", "train.gradient_checkpointing=true"]
    toy_plan = plan(config(fixed), parse("1xH100-80GB"), lookup(MODEL))
    sft_plan = plan(config(fixed, method=False), parse("1xH100-80GB"), lookup(MODEL))
    assert toy_plan.method == "toy" and toy_plan.reference == "copy" and sft_plan.reference == "none"
    assert "reference model" in toy_plan.estimate.device and "reference model" not in sft_plan.estimate.device
    assert toy_plan.estimate.device["activations"] == pytest.approx(3 * sft_plan.estimate.device["activations"])
    assert toy_plan.lr == 3e-5 and "common starting point for toy with an adapter" in toy_plan.decision("lr").reason
    assert job.method.rows_per_step(32) == 32 and sft.method.rows_per_step(32) == 32


def test_the_checks_take_formats_and_packing_from_the_section():
    job = config()
    assert check(job) == []
    preference = job.data.datasets[0].model_copy(update={"format": "preference"})
    data = job.data.model_copy(update={"datasets": [preference], "packing": True})
    problems = {p.message for p in check(job.model_copy(update={"data": data}))}
    assert "toy cannot train on preference data" in problems
    assert "toy trains on one sample per sequence: it does not pack samples" in problems


def test_an_unknown_method_name_lists_the_registered_ones():
    with pytest.raises(FtError, match=r"method.name: no method 'ppo' is registered \(known: .*dpo, grpo, .*sft.*\)"):
        methods.method_class("ppo")


@pytest.mark.slow
def test_the_shipped_methods_are_found_by_discovery_alone():
    """In a fresh process nothing has imported the method modules: the lookup finds them by itself."""
    code = (
        "import sys; from finetune.methods import method_class; assert 'finetune.methods.grpo' not in sys.modules; "
        "print(*(method_class(n).__name__ for n in ('sft', 'dpo', 'grpo')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["SFT", "DPO", "GRPO"]


SHIPPED = {get_args(c.model_fields["name"].annotation)[0] for c in get_args(get_args(Method)[0])}
EQUALITY = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)


def name_comparisons(source: str) -> list[str]:
    """`x.method.name == "sft"`, `method != "grpo"`, `plan.method in ("dpo", ...)`: each comparison of a method's name
    with a shipped method's, as "line: code"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare) or not all(isinstance(op, EQUALITY) for op in node.ops):
            continue
        sides = [node.left, *node.comparators]
        named = [s for s in sides if any(isinstance(c, ast.Constant) and c.value in SHIPPED for c in ast.walk(s))]
        if named and any("method" in ast.unparse(s) for s in sides if s not in named):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_a_method_names_itself():
    """Outside the method modules and their sections, what differs between methods is a capability the section
    declares (docs/architecture.md: neither the planner nor the checks name a method)."""
    own = REPO / "finetune" / "config" / "methods.py"
    paths = [p for p in sorted((REPO / "finetune").rglob("*.py")) if p.parent.name != "methods" and p != own]
    hits = [f"{p.relative_to(REPO)}:{hit}" for p in paths for hit in name_comparisons(p.read_text())]
    assert {"sft", "grpo"} <= SHIPPED and len(paths) > 100 and hits == []


def test_the_name_scan_sees_each_form():
    code = 'a = config.method.name != "sft"\nb = plan.method in ("dpo", "kto")\nc = name == "reward"\nd = method == x\n'
    assert name_comparisons(code) == ["1: config.method.name != 'sft'", "2: plan.method in ('dpo', 'kto')"]
