"""`ft plan` as text: piped, nothing wraps and every figure says what it is; on a terminal, rich tables."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from finetune.report import print_plan
from finetune.workflow import compile_plan
from tests.helpers import REPO

EXAMPLES = REPO / "examples" / "yaml"
SEVENTY_B = (EXAMPLES / "llama3.3-70b-qlora-2gpu.yaml", "2xA6000-48GB")
FULL_8B = (EXAMPLES / "llama3.1-8b-full-8xh100.yaml", "8xH100-80GB")


@pytest.fixture(autouse=True)
def columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # what rich assumes for a pipe


def piped(path, hardware, candidates=True, overrides=()) -> tuple[object, list[str]]:
    """The plan and what `ft plan ... > file` writes (stdout is not a terminal here: pytest captures it)."""
    import sys

    plan = compile_plan(path, overrides, hardware)
    out = io.StringIO()
    stdout, sys.stdout = sys.stdout, out
    try:
        print_plan(plan, candidates=candidates)
    finally:
        sys.stdout = stdout
    return plan, out.getvalue().splitlines()


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_piped_plan_gives_each_decision_one_whole_line(path):
    hardware = re.search(r"^# ft plan \S+ --hardware (\S+)$", path.read_text(), re.M).group(1)
    plan, lines = piped(path, hardware)
    assert not any(set(line) & set("┃│┏━└─") for line in lines), "a rich table in piped output"
    for d in plan.decisions:  # the field, its value and the whole reason on one line: nothing wrapped
        assert any(line.split()[:1] == [d.field] and line.endswith(d.reason) for line in lines), d.field
    assert "all 1 ranks" not in "\n".join(lines)


def test_runners_up_are_distinct_ways_to_train():
    """The 70B QLoRA plan once listed each setup twice: once loaded through host RAM and once not, same figures."""
    plan, lines = piped(*SEVENTY_B)
    start = next(i for i, line in enumerate(lines) if line.startswith("Runners-up"))
    rows = [line.split("  ")[1] for line in lines[start + 2 : -1]]
    setups = [a["setup"].replace(", loaded through host RAM", "") for a in plan.alternatives]
    assert plan.alternatives and len(set(setups)) == len(setups)
    assert len(set(rows)) == len(rows) and "the chosen setup (above)" in rows[0]


def test_the_plan_has_one_step_time():
    """The step time, the scaling line and the runners-up's chosen row quote the same figure."""
    plan, lines = piped(*FULL_8B)
    text = "\n".join(lines)
    step = sum(plan.step_seconds.values())
    assert step == pytest.approx(plan.scaling["step_seconds"], abs=1e-4)
    assert f"Step time (est.): {step:.3g} s = " in text
    assert f": {step:.3g} s per step;" in text
    assert re.search(rf"the chosen setup \(above\)\s+\S+\s+{re.escape(f'{step:.3g}')} s$", text, re.M)
    assert plan.decision("tensor_parallel").reason.count(f"est. {step:.3g} s/step") == 1


def test_host_ram_counts_every_process_of_a_node():
    plan, lines = piped(*FULL_8B, candidates=False)
    host = next(line for line in lines if line.startswith("Host RAM per node"))
    assert host.startswith(f"Host RAM per node ({plan.processes_per_node} processes)")
    assert "process runtimes (2.5 GiB each) 20.0" in host and "runtime per process" not in host


def test_memory_says_what_usable_means_and_how_much_is_planned():
    plan, lines = piped(*FULL_8B, candidates=False)
    title = next(line for line in lines if line.startswith("Memory per GPU"))
    used = plan.estimate.device_bytes
    assert f"{used / plan.device_capacity_bytes:.0%} of the usable memory planned" in title
    assert f"{used / plan.device_memory_bytes:.0%} of the 79.1 GiB" in title
    assert any(line.split()[:1] == ["usable"] and "4% kept free" in line for line in lines)
    assert any("peak while loading, before training (not added)" in line for line in lines)


def test_a_run_that_would_take_years_says_so():
    """Qwen 7B QLoRA on CPU plans (it fits), at about 3e4 s a step: its 2,000 steps take years, and the plan says it."""
    plan, lines = piped(EXAMPLES / "qwen2.5-7b-qlora.yaml", "cpu", candidates=False)
    run = next(line for line in lines if line.startswith("Run: "))
    assert run.startswith("Run: 2,000 steps (train.max_steps) × ") and run.endswith((" days", " years"))
    assert any(line.startswith("Warning: ") and "no GPU" in line for line in lines)
    _, quick = piped(EXAMPLES / "quickstart.yaml", "cpu", candidates=False)
    assert any(line.startswith("Run: 1,200 steps") and line.endswith(" min") for line in quick)
    assert not any(line.startswith("Warning") for line in quick)


def test_a_run_set_by_epochs_gives_the_time_of_1000_steps():
    _, lines = piped(*FULL_8B, candidates=False)
    assert any(line.startswith("Run: train.epochs sets the number of steps") for line in lines)


def test_checkpointing_next_to_activation_offload_says_what_it_saves():
    """With activation offload on, checkpointing saves host RAM and PCIe traffic, not device memory: undone, the
    device needs less, and the reason says so instead of quoting a smaller figure without a word."""
    plan = compile_plan(EXAMPLES / "llama3.1-8b-lora-24gb.yaml", (), "1xA10G-24GB")
    assert plan.activation_offload and plan.checkpoint_layers
    why = plan.decision("gradient_checkpointing").reason
    assert "rather than device memory" in why
    assert re.search(r"fits, but the step is slower: est\. \S+ s against \S+ s", why)


def test_one_gpu_with_fsdp_offload_is_not_sharded_over_one_rank():
    plan = compile_plan(EXAMPLES / "llama3.1-8b-full-8xh100.yaml", (), "1xH100-80GB")
    assert (plan.backend, plan.sharding, plan.offload) == ("fsdp", "full_shard", "all")
    assert plan.decision("sharding").reason.startswith("one GPU: FSDP2 keeps parameters, gradients and optimizer")


def test_on_a_terminal_the_tables_fit_its_width():
    plan = compile_plan(SEVENTY_B[0], (), SEVENTY_B[1])
    out = io.StringIO()
    print_plan(plan, candidates=True, console=Console(file=out, width=100, force_terminal=True, color_system=None))
    lines = out.getvalue().splitlines()
    assert any("┃ choice" in line for line in lines) and max(len(line) for line in lines[:-1]) <= 100
