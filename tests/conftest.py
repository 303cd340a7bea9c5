"""Shared test setup: never reach the hub; fixtures shared by several test files (builders are in tests/helpers.py)."""

from __future__ import annotations

import gc
import os
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from finetune.errors import GC_YOUNG_OBJECTS
from tests.helpers import LORA, built_across_sessions, built_once, make_examples, train_here, trained

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
gc.set_threshold(GC_YOUNG_OBJECTS, *gc.get_threshold()[1:])  # as in ft's processes: the tests train in-process too
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # pytest-xdist workers share the cores: threads that wait for a core
    # spin and burn it, so each worker (and what it starts) computes with its share of the cores
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))


@pytest.fixture(autouse=True)
def signal_dispositions():
    """What a test leaves of this process's signal handlers is put back: a rank that stops ignores further stop
    signals for its exit (lifecycle.ignore_stop_signals), and a test running that code in this process would otherwise
    pass SIG_IGN on to every process the later tests start (a Python child then never raises KeyboardInterrupt)."""
    import signal

    from finetune.distributed.lifecycle import STOP_SIGNALS

    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    yield
    for sig, handler in saved.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


@pytest.fixture
def write_yaml(tmp_path):
    """write_yaml(text) -> path of a job file holding the dedented text."""

    def write(text: str, name: str = "job.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write


@pytest.fixture(scope="session")
def one_process(tmp_path_factory):
    """The run multi-process tests compare with (tests/helpers.py `job`): full fine-tuning in one process, 6 steps,
    a checkpoint at step 3 (saving changes nothing in the trajectory)."""
    return built_once(tmp_path_factory, "one", lambda f: trained(f, "one", "--set", "output.save_steps=3")) / "one"


@pytest.fixture(scope="session")
def one_process_lora(tmp_path_factory):
    """The tiny job with a LoRA adapter (tests/helpers.py LORA) in one process: what FSDP2 and ZeRO-3 LoRA runs of the
    same job (with the same overrides) must equal."""
    return built_once(tmp_path_factory, "one-lora", lambda f: trained(f, "one", *LORA)) / "one"


@pytest.fixture(scope="session")
def sft_model(tmp_path_factory):
    """The tiny model after 250 SFT steps on arithmetic (about half the test questions right): what DPO and GRPO tests
    start from, so that DPO has preferences to sharpen and GRPO has some right answers to reinforce."""

    def build(tmp: Path) -> None:
        from finetune.tiny import arithmetic_records, write_jsonl

        data = write_jsonl(arithmetic_records(4000, seed=0), tmp / "train.jsonl")
        cfg = tmp / "sft.yaml"
        cfg.write_text(f"""
model: {{name: ft-tiny}}
data: {{datasets: [{{path: {data}, format: chat}}], seq_len: 64, cache_dir: {tmp / "cache"}}}
adapter: {{type: full}}
train: {{global_batch_size: 64, lr: 2.0e-3, max_steps: 250, warmup_steps: 25}}
output: {{dir: {tmp / "run"}, save_steps: 0, log_steps: 50}}
""")
        train_here(cfg)  # in this process: a new one would spend seconds importing

    return built_across_sessions("sft", build) / "run" / "final"  # the vLLM suite uses it too


@pytest.fixture(scope="module")
def packed_rows():
    """Five examples packed into two rows of 32 tokens (2-3 examples each): (examples, rows)."""
    import datasets

    from finetune.data.packing import pack

    examples = make_examples([12, 10, 9, 8, 7], seed=11)
    rows = list(pack(datasets.Dataset.from_list(examples), seq_len=32))
    assert [len(r["seq_lens"]) for r in rows] == [3, 2]  # two rows, 2-3 examples each
    return examples, rows


# The test files that take longest, longest first (seconds of a whole file on 3 workers sharing 2 cores, from a cold
# test cache, --junitxml: alignment 226 (of which the sft_model build 100), distributed 211, deepspeed 124,
# tensor_parallel 120, families 118, signals 98, slurm 87, gpu_first_contact 86, memory_measured 85, expert_parallel
# 79, generate_multinode 70, reward 62, sharded_loading 56, train 56). One-process runs that a test compares with train
# in the test's process (tests/helpers.py train_here): a new one imports for 10-15 s. scripts/test.sh runs whole files
# on 3 workers (--dist loadfile) in collection order: a long file that started last would run alone.
LONGEST_FIRST = (
    "test_alignment.py",
    "test_distributed.py",
    "test_deepspeed.py",
    "test_tensor_parallel.py",
    "test_families.py",
    "test_vision.py",
    "test_signals.py",
    "test_slurm.py",
    "test_gpu_first_contact.py",
    "test_memory_measured.py",
    "test_expert_parallel.py",
    "test_generate_multinode.py",
    "test_reward.py",
    "test_sharded_loading.py",
    "test_train.py",
    "test_preference_distributed.py",
)


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu are skipped where no CUDA GPU is present (CI, this project's CPU machines). Files are ordered
    LONGEST_FIRST, then those with more slow tests (the order is otherwise kept: pytest-xdist workers must collect the
    same order)."""
    import importlib.util

    slow = Counter(item.path for item in items if "slow" in item.keywords)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -slow[item.path]))

    has_gpu = False
    if importlib.util.find_spec("torch") is not None:
        import torch

        has_gpu = torch.cuda.is_available()
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


# ---------------------------------------------------------------- tests that run in a process of their own
OWN_PROCESS_ENV = "FT_TEST_OWN_PROCESS"


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test marked own_process runs again, alone, in a fresh interpreter (pytest on its node id, with a timeout):
    a process group it starts in-process (gloo's threads and store, DDP's reducer) then never shares a pytest worker
    with the tests that run after it. Its fixtures are also set up here, unused."""
    if pyfuncitem.get_closest_marker("own_process") is None or os.environ.get(OWN_PROCESS_ENV):
        return None
    import subprocess
    import sys
    import tempfile
    import xml.etree.ElementTree as ET

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, OWN_PROCESS_ENV: "1"}
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_CURRENT_TEST"):
        env.pop(name, None)
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
        cmd += [f"--junitxml={report}", pyfuncitem.nodeid]
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"in its own process:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
        cases = list(ET.parse(report).getroot().iter("testcase"))
    assert len(cases) == 1, f"in its own process, {len(cases)} tests ran:\n{done.stdout[-3000:]}"
    skipped = cases[0].find("skipped")  # the outcome there, when it was not a pass, is reported here
    if skipped is not None:
        reason = f"in its own process: {skipped.get('message', '')}"
        if skipped.get("type") == "pytest.xfail":
            pytest.xfail(reason)
        pytest.skip(reason)
    return True


# ---------------------------------------------------------------- how many tests -m left out (also under pytest-xdist)
DESELECTED = pytest.StashKey[int]()


def pytest_deselected(items):
    """Count what -m (or -k) left out; an xdist worker hands its count to the controller, which prints it."""
    if items:
        config = items[0].config
        config.stash[DESELECTED] = config.stash.get(DESELECTED, 0) + len(items)
        if hasattr(config, "workeroutput"):
            config.workeroutput["deselected"] = config.stash[DESELECTED]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist: a worker finished; every worker collected the same tests, so one count is the run's."""
    count = getattr(node, "workeroutput", {}).get("deselected", 0)
    node.config.stash[DESELECTED] = max(node.config.stash.get(DESELECTED, 0), count)


def pytest_terminal_summary(terminalreporter, config):
    count = config.stash.get(DESELECTED, 0)
    if count:
        expression = f" (-m {config.option.markexpr!r})" if config.option.markexpr else ""
        terminalreporter.write_line(f"{count} tests deselected{expression}")
