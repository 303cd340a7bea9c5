"""Builders shared by the tests (job files, hook files, ...). Test files import these from here, never from each other;
fixtures live in tests/conftest.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class JobText(str):
    """A job file's text whose `replace` fails when the text to replace is not there: an edit that silently did
    nothing would leave a test checking the unedited job (for edits overrides cannot make: a misspelt key, a bad
    YAML token, a line removed)."""

    def replace(self, old, new, count=-1):
        if old not in self:
            raise AssertionError(f"the job text holds no {old!r} to replace:\n{self}")
        return JobText(str.replace(self, old, new, count))


MINIMAL = JobText("""\
model: {name: meta-llama/Llama-3.1-8B}
data:
  datasets: [{path: data/train.jsonl, format: chat}]
  seq_len: 2048
  packing: true
method: {name: sft}
adapter: {type: lora, r: 16, alpha: 32, target_modules: all-linear}
quantization: {type: auto}
train:
  global_batch_size: 32
  micro_batch_size: auto
  gradient_checkpointing: auto
  optimizer: adamw_torch
  precision: auto
  lr: 2.0e-4
  max_steps: 1000
distributed: {backend: auto, sharding: auto, offload: auto}
output: {dir: runs/llama8b-lora}
""")


# ---------------------------------------------------------------- ft train in a process of its own, and what it wrote
def job(tmp_path, name: str, steps: int = 6) -> str:
    """The tiny job most multi-process tests run: full fine-tuning of ft-tiny on 128 arithmetic rows, 8 rows a step
    (4 per micro-batch), a loss logged every step, no checkpoints; its run folder is tmp_path/name."""
    from finetune.tiny import arithmetic_records, write_jsonl

    data = write_jsonl(arithmetic_records(128, seed=7), tmp_path / "d.jsonl")
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""
model: {{name: ft-tiny}}
data: {{datasets: [{{path: {data}, format: chat}}], seq_len: 48, cache_dir: {tmp_path / "cache"}}}
adapter: {{type: full}}
train: {{global_batch_size: 8, micro_batch_size: 4, max_steps: {steps}, lr: 3.0e-3, warmup_steps: 1}}
output: {{dir: {tmp_path / name}, log_steps: 1, save_steps: 0}}
""")
    return str(path)


LORA = ["--set", "adapter={type: lora, r: 8, alpha: 16, dropout: 0.0}", "--set", "train.lr=0.02"]  # `job` with LoRA


def ft_train(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    """`ft train ARGS` in a new process (one thread per process: the ranks share the machine's cores)."""
    return subprocess.run(
        [sys.executable, "-m", "finetune", "train", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        timeout=timeout,
    )


def ft_here(capfd, *args: str, env=None, cwd=None, timeout: float = 300) -> tuple[int, str, str]:
    """`ft ARGS` as `ft_train` runs it (the CLI's entry, finetune.cli.main: its messages and exit code; one thread per
    rank, `env` added, in the folder `cwd`), with this process as ft's process: no new interpreter imports torch for
    the launcher (seconds a run). Its exit code, stdout and stderr (the ranks' too). After `timeout` s the processes it
    started are killed (as ft_train's timeout ends its process) and the test fails."""
    import signal
    import threading

    from finetune.cli import main
    from finetune.errors import set_run_dir
    from finetune.launch.stopping import children

    expired = []

    def kill_what_it_started():
        expired.append(True)
        for pid in children(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    capfd.readouterr()  # what came before is not this command's
    saved, here = dict(os.environ), os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    os.environ.update({"OMP_NUM_THREADS": "1", **(env or {})})
    timer = threading.Timer(timeout, kill_what_it_started)
    timer.daemon = True
    timer.start()
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        timer.cancel()
        os.chdir(here)
        os.environ.clear()
        os.environ.update(saved)  # and the variables the CLI set for its process (no bars) are gone again
        set_run_dir(None)  # the run's folder no longer receives this process's error logs
    out, err = capfd.readouterr()
    assert not expired, f"ft {' '.join(args)} ran longer than {timeout} s:\n{err[-3000:]}"
    return code, out, err


def train_here(config, *args: str, hardware: str = "cpu", resume: bool = False) -> dict:
    """`ft train CONFIG --hardware cpu [--set K=V ...] [--resume]` in this process with one thread, as `ft_train`'s
    process: for one-process runs whose results (not the CLI's output) a test checks, without a new interpreter's
    imports (seconds a run). Returns run_train's result; an error raises."""
    import torch

    from finetune.errors import set_run_dir
    from finetune.workflow import run_train

    if len(args) % 2 or any(flag != "--set" for flag in args[::2]):
        raise ValueError(f"train_here takes only --set KEY=VALUE pairs, not {args}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_train(str(config), list(args[1::2]), hardware, resume=resume)
    finally:
        torch.set_num_threads(threads)
        set_run_dir(None)  # the run's folder no longer receives this process's error logs


def launch_here(config, *args: str, hardware: str = "cpu:2", resume: bool = False) -> dict:
    """`ft train CONFIG --hardware cpu:2 [--set K=V ...] [--resume]` with this process as ft train's launcher: it plans,
    prepares the data, writes the run folder and starts torchrun and the ranks (one thread each, as `ft_train`'s),
    without a new interpreter importing for the launcher (seconds a run). For multi-process runs whose results (not
    the CLI's output or exit code) a test checks. Returns run_train's result; an error raises."""
    from finetune.errors import set_run_dir
    from finetune.workflow import run_train

    if len(args) % 2 or any(flag != "--set" for flag in args[::2]):
        raise ValueError(f"launch_here takes only --set KEY=VALUE pairs, not {args}")
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # what ft_train gives its process: the ranks inherit it
    try:
        return run_train(str(config), list(args[1::2]), hardware, resume=resume)
    finally:
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = threads
        set_run_dir(None)  # the run's folder no longer receives this process's error logs


def metric_rows(run_dir) -> list[dict]:
    """Every row of a run folder's metrics.jsonl."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def losses(run_dir) -> list[float]:
    """The training losses a run folder logged, step by step."""
    return [r["loss"] for r in metric_rows(run_dir) if "loss" in r]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- runs that several test files compare with
def built_once(tmp_path_factory, name: str, build) -> Path:
    """A folder that `build(folder)` fills once per test session, even when pytest-xdist runs several workers: the
    first worker that needs it builds it (under a lock, in the session's common temporary folder), the others wait and
    use it. For what several test files compare with; tests must not change what is in it."""
    import shutil

    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the workers' basetemps share a parent
    folder, done = root / f"built-{name}", root / f"built-{name}.done"
    with FileLock(str(root / f"built-{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed attempt left
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


def built_across_sessions(name: str, build) -> Path:
    """Like `built_once`, but kept between test sessions while ft's code is unchanged (a digest of finetune/ and
    tests/conftest.py names the folder): the main suite and the vLLM suite (a second environment, run beside it)
    share what takes long to build. FT_TEST_CACHE moves the cache (default ~/.cache/ft/test-builds)."""
    import hashlib
    import shutil

    from filelock import FileLock

    digest = hashlib.sha256()
    for source in sorted((REPO / "finetune").rglob("*.py")) + [REPO / "tests" / "conftest.py"]:
        digest.update(source.read_bytes())
    root = Path(os.environ.get("FT_TEST_CACHE", "~/.cache/ft/test-builds")).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    folder = root / f"{name}-{digest.hexdigest()[:16]}"
    done = folder.with_name(folder.name + ".done")
    with FileLock(str(folder) + ".lock"):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed attempt left
            folder.mkdir()
            build(folder)
            done.touch()
        for old in root.glob(f"{name}-*"):  # builds of other code versions (ft's own test cache)
            if old.is_dir() and old != folder:
                shutil.rmtree(old, ignore_errors=True)
                old.with_name(old.name + ".done").unlink(missing_ok=True)
                old.with_name(old.name + ".lock").unlink(missing_ok=True)
    return folder


def varied_tiny_model(folder: Path) -> Path:
    """The tiny model with larger random weights than its initialisation (std 0.1), saved to `folder`: its greedy
    completions differ from prompt to prompt (the freshly initialised model answers every prompt alike)."""
    import torch

    from finetune.tiny import build_model

    model, _ = build_model(folder)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.1, generator=gen)
    model.save_pretrained(str(folder))
    return folder


def trained(folder: Path, name: str, *args: str) -> Path:
    """ft train of the tiny job (tests/helpers.py `job`) named `name` in `folder`, in one process (this one); its run
    folder."""
    train_here(job(folder, name), *args)
    return folder / name


# ---------------------------------------------------------------- one-process jobs built in the test's own process
def job_text(tmp_path, adapter="full", steps=12, batch=8, micro="auto", extra="", data=None, out="run", lr=None) -> str:
    """A tiny one-process job (ft-tiny on 256 arithmetic rows unless `data` is given) with the given adapter:
    full, lora, qlora or int8; its run folder is tmp_path/out."""
    from finetune.tiny import arithmetic_records, write_jsonl

    data = data or write_jsonl(arithmetic_records(256, seed=5), tmp_path / "arith.jsonl")
    adapter_yaml = {
        "full": "{type: full}",
        "lora": "{type: lora, r: 8, alpha: 16, dropout: 0.0}",
        "qlora": "{type: qlora, r: 8, alpha: 16, dropout: 0.0}",
        "int8": "{type: lora, r: 8, alpha: 16, dropout: 0.0}\nquantization: {type: int8}",
    }[adapter]
    return JobText(f"""
model: {{name: ft-tiny}}
data:
  datasets: [{{path: {data}, format: chat}}]
  seq_len: 48
  cache_dir: {tmp_path / "cache"}
adapter: {adapter_yaml}
train: {{global_batch_size: {batch}, micro_batch_size: {micro}, max_steps: {steps},
  lr: {lr or (3.0e-3 if adapter == "full" else 2.0e-2)}, warmup_steps: 2}}
output: {{dir: {tmp_path / out}, log_steps: 1, save_steps: 0}}
{extra}""")


def write_job(tmp_path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def setup_job(tmp_path, text: str):
    """(config, plan, prepared data, Job) built the way `ft train` builds them (for tests that look inside the
    model)."""
    from finetune.config import load
    from finetune.data.preprocess import prepare
    from finetune.hardware import parse
    from finetune.plan import plan
    from finetune.train import setup
    from finetune.workflow import model_facts

    config = load(write_job(tmp_path, text))
    p = plan(config, parse("cpu"), model_facts(config.model))
    prepared = prepare(config)
    return config, p, prepared, setup(config, p, prepared)


# ---------------------------------------------------------------- models and probes
def run_probe(script: Path, out: Path, configs: list[str], *flags: str, timeout: int = 600) -> list[dict]:
    """A probe script (tests/scripts/*_probe.py) on 2 gloo ranks over the given job files; its JSON reports,
    one per job and rank, in (job, rank) order."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(script),
        "cpu:2",
        str(out),
        *configs,
        *flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads(p.read_text()) for p in sorted(out.glob("probe-*-rank*.json"))]


def in_a_one_rank_group(body, init_method: str | None = None):
    """body() inside a gloo process group of one rank in this process (tests marked own_process), returning what it
    returns, with the group torn down so that gloo's threads cannot hang it. An allreduce that DDP starts in backward
    holds a Python object (the context torch's autograd keeps in the thread's state), so the gloo thread that drops
    the last reference to it needs the GIL. The group's destructor joins those threads while holding the GIL (it runs
    when the last Python reference goes: DDP's reducer, destroy_process_group). A thread that had not yet freed its
    last work when that began waits for the GIL forever (a full run hung here: the reducer freed after
    destroy_process_group, on a loaded machine). So: what body built is freed while the group is registered, a
    barrier and a pause with the GIL released let the threads finish, and only then is the group destroyed."""
    import gc
    import time

    import torch.distributed as dist

    if init_method is None:
        init_method = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=1)
    try:
        return body()
    finally:
        gc.collect()  # what body built, cycles included, goes while the group is still registered
        dist.barrier()
        time.sleep(0.2)
        dist.destroy_process_group()


def random_llama(
    folder: Path,
    *,
    hidden: int,
    layers: int,
    intermediate: int,
    heads: int,
    tied: bool = False,
    kv_heads: int | None = None,
    vocab: int | None = None,
) -> int:
    """Save a Llama with random bf16 weights (uniform, norms at 1) and ft's tiny tokenizer; returns its parameter count.
    Built on the meta device and then filled: seconds even at 400M parameters. `vocab`: embedding rows (default: the
    tokenizer's; more leaves rows no token reaches, as a large vocabulary has)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.tiny import build_tokenizer

    tok = build_tokenizer()
    cfg = LlamaConfig(
        vocab_size=max(vocab or 0, len(tok)),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or max(1, heads // 2),
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gave each name its own tensor
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0) if p.ndim == 1 else p.uniform_(-0.05, 0.05, generator=gen)
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return sum(p.numel() for p in model.parameters())


def tiny_llama(attn: str):
    """A 2-layer Llama (vocab 256) with random weights (seed 0) in eval mode, on the given attention implementation."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation=attn,
    )
    model = LlamaForCausalLM(config).eval()
    assert model.config._attn_implementation == attn
    return model


def make_examples(lengths, seed=0, vocab=256) -> list[dict]:
    """Rows with a prompt part (labels -100) and a trained part; token values random."""
    import random

    rng = random.Random(seed)
    rows = []
    for n in lengths:
        ids = [rng.randrange(vocab) for _ in range(n)]
        prompt = rng.randint(0, n - 1)
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:], "source": "x"})
    return rows


def spec(path, fmt="chat", **kw):
    """The DatasetSpec of one data file."""
    from finetune.config.schema import DatasetSpec

    return DatasetSpec(path=str(path), format=fmt, **kw)


# ---------------------------------------------------------------- a model folder that ships code (trust_remote_code)
EVIL = """
import pathlib
pathlib.Path({marker!r}).write_text("the model folder's own code ran")
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

class EvilConfig(LlamaConfig):
    pass

class EvilModel(LlamaForCausalLM):
    config_class = EvilConfig

class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""


def evil_model(model_dir, folder, marker):
    """A copy of the tiny model whose config.json and tokenizer_config.json point (auto_map) at evil.py,
    which writes `marker` when imported."""
    import shutil

    shutil.copytree(model_dir, folder)
    for name, auto_map in (
        ("config.json", {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}),
        ("tokenizer_config.json", {"AutoTokenizer": [None, "evil.EvilTokenizer"]}),
    ):
        config = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**config, "auto_map": auto_map}))
    (folder / "evil.py").write_text(EVIL.format(marker=str(marker)))
    return folder


def crafted_run(model_dir, root, marker, model_name="ft-tiny"):
    """A run folder whose config.yaml turns trust_remote_code on and whose final/ model ships evil.py."""
    import yaml

    run = root / "run"
    evil_model(model_dir, run / "final", marker)
    (run / "config.yaml").write_text(
        yaml.safe_dump({"model": {"name": model_name, "trust_remote_code": True}, "adapter": {"type": "full"}})
    )
    return run


# ---------------------------------------------------------------- GPU checks (tests/test_gpu*.py)
GPU_TIMEOUT = 300  # per ft train; a warm run of the tiny model takes seconds, DeepSpeed's first CPU Adam build a minute


def visible_gpus(n: int) -> dict:
    """Environment that shows a job the first n of the GPUs this process sees (ft then plans for exactly those)."""
    seen = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return {"CUDA_VISIBLE_DEVICES": ",".join(seen[:n] if seen else map(str, range(n)))}


# ---------------------------------------------------------------- the training loop's test hook (FT_STEP_HOOK)
def step_hook(
    folder,
    *,
    fail: tuple[int, int] | None = None,
    hang: tuple[int, int, float] | None = None,
    stop_at: int | None = None,
    signal: tuple[int, int, str] | None = None,
) -> dict[str, str]:
    """The environment that makes every rank of a run call a hook written into `folder` at the start of each step
    (FT_STEP_HOOK, see finetune/rank.py): fail=(RANK, STEP) makes that rank raise there ("injected failure on rank
    RANK at step STEP"), hang=(RANK, STEP, SECONDS) makes it sleep there (its peers' collectives wait), stop_at=STEP
    stops every rank after that step as if SIGTERM had arrived, signal=(RANK, STEP, NAME) makes that rank alone send
    itself that signal there (what its peers have not heard)."""
    import tempfile
    from pathlib import Path

    fd, path = tempfile.mkstemp(dir=folder, prefix="step_hook_", suffix=".py")
    with open(fd, "w", encoding="utf-8") as f:
        f.write(
            "import os\nimport signal\nimport time\n\n"
            f"FAIL, HANG, STOP_AT, SIGNAL = {fail!r}, {hang!r}, {stop_at!r}, {signal!r}\n\n\ndef hook(rank, step):\n"
            "    if FAIL is not None and (rank, step) == tuple(FAIL):\n"
            '        raise RuntimeError(f"injected failure on rank {rank} at step {step}")\n'
            "    if HANG is not None and (rank, step) == tuple(HANG[:2]):\n        time.sleep(HANG[2])\n"
            "    if SIGNAL is not None and (rank, step) == tuple(SIGNAL[:2]):\n"
            "        os.kill(os.getpid(), getattr(signal, SIGNAL[2]))\n"
            "    return step == STOP_AT\n"
        )
    return {"FT_STEP_HOOK": f"{Path(path)}:hook"}


def policy_and_reference():
    """The tiny model perturbed (a policy), its unperturbed copy (the reference), and the tokenizer: what the loss
    oracle tests compare with trl on."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.tiny import ensure_model

    path = str(ensure_model())
    policy, reference = AutoModelForCausalLM.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return policy, reference, AutoTokenizer.from_pretrained(path)


def _cpu_flags() -> tuple[str, set[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "", set()
    vendor = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("vendor_id")), "")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return vendor, set(flags)


def _zero3_diverges() -> bool:
    vendor, _ = _cpu_flags()
    return vendor == "AuthenticAMD"


# DeepSpeed 0.19.8's ZeRO-3 on CPU differs on AMD EPYC CPUs (seen on two such machines, with and without AVX-512):
# per-step losses 5-6e-4 apart from one process from step 3 on, and a bf16 ZeRO-3 job leaves a later fp32 job of the
# same process with bf16 weights. An earlier landing's code does exactly the same there, so it is the CPU's (or
# DeepSpeed's on it), not ft's: the ZeRO-3 comparisons are expected to fail on such CPUs and must pass everywhere else.
# There they are not run (run=False): a test expected to fail shows nothing whatever happens in it (an error included),
# and these four took ~4 minutes of test time there. The chunked-loss and partitioned-load probes still run and check
# what does not depend on the losses matching (their own pytest.xfail, after those checks).
ZERO3_CPU_DIVERGES = _zero3_diverges()
ZERO3_XFAIL = dict(
    condition=ZERO3_CPU_DIVERGES,
    reason="DeepSpeed ZeRO-3 on an AMD CPU differs from one process (also before this change)",
    strict=False,
    run=False,
)


def tiny_moe(folder: Path, kind: str = "qwen3_moe", seed: int = 0) -> Path:
    """A 2-layer mixture-of-experts model of transformers family `kind` (qwen3_moe, mixtral, deepseek_v3: hidden 64,
    4 experts, top-2) with ft's tiny tokenizer, saved to `folder` as save_pretrained writes it (one matrix per expert).
    The routers' weights are drawn larger than their initialisation (std 0.5), so that routing is decisive rather
    than near ties that rounding could flip."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.tiny import build_tokenizer

    tok = build_tokenizer()
    shape = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    shape.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, num_experts_per_tok=2)
    per_kind = {
        "qwen3_moe": dict(head_dim=16, num_experts=4, moe_intermediate_size=32),
        "mixtral": dict(head_dim=16, num_local_experts=4, intermediate_size=64),
        "deepseek_v3": dict(
            n_routed_experts=4,
            num_key_value_heads=4,  # multi-head latent attention: as many key/value heads as query heads
            moe_intermediate_size=32,
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
        ),
    }
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    shape.update(per_kind[kind], **ids)  # a family's own keys replace the shared ones (Mixtral's expert width)
    config = AutoConfig.for_model(kind, **shape, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def crash_hook(folder, parts, rank: int, batches: int) -> str:
    """FT_BATCH_HOOK's value for a hook (written into `folder`) that kills process `rank` after its `batches`-th
    batch, leaving half a line in its part file under `parts`, as a kill in the middle of a write does."""
    hook = folder / "crash_hook.py"
    hook.write_text(
        f"import os\nimport pathlib\n\n\ndef hook(rank, batches_done):\n    if (rank, batches_done) == ({rank}, "
        f"{batches}):\n        (part,) = pathlib.Path({str(parts)!r}).glob(f'part-*-r{{rank}}.jsonl')\n        with "
        "open(part, 'a', encoding='utf-8') as f:\n"
        '            f.write(\'{"id": "cut sh\')\n'
        "        os._exit(137)\n"
    )
    return f"{hook}:hook"


# ---------------------------------------------------------------- tiny models of other families (GGUF export)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def qwen_style_tokenizer(vocab_size: int = 400):
    """A byte-level BPE trained on ft's arithmetic chat text that splits text as Qwen 2's tokenizer does (its regex,
    then bytes), with ChatML's tokens and template: a tokenizer of another family than ft-tiny's."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from finetune.templates import CHATML
    from finetune.tiny import arithmetic_records

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    text = [f"{m['content']}\n" for r in arithmetic_records(2000, seed=3) for m in r["messages"]]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def tiny_family(folder: Path, kind: str, tokenizer=None, seed: int = 0, std: float = 0.1, **extra) -> Path:
    """A tiny model of transformers family `kind` (llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, ...) built
    from its config class (2 layers, width 64, 4 heads of 16, 2 for keys and values), weights drawn with `std` (so
    greedy completions differ from prompt to prompt), saved with `tokenizer` (default: ft's tiny one) to `folder`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.tiny import build_tokenizer

    tok = tokenizer or build_tokenizer()
    shape = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    config = AutoConfig.for_model(kind, **{**shape, **extra})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 or name.endswith("bias"):
                p.normal_(0, std, generator=gen)
            elif kind.startswith("gemma"):  # norms scale by 1 + weight: near 1 either way
                p.normal_(0, 0.1, generator=gen)
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def sentencepiece_tokenizer(folder: Path, prefix_space: bool = False, vocab_size: int = 300):
    """A sentencepiece BPE (byte fallback, digits split, ChatML's tokens) trained on ft's arithmetic chat text, loaded
    by transformers as Llama's tokenizer (tokenizer.json), with ChatML as its template: the kind of tokenizer Llama 2,
    Mistral and Gemma have. `prefix_space`: a space is put before the text (as Llama 2's; Gemma's puts none)."""
    import json

    import sentencepiece
    from transformers import AutoTokenizer

    from finetune.templates import CHATML
    from finetune.tiny import arithmetic_records

    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(m["content"] for r in arithmetic_records(2000, seed=3) for m in r["messages"]))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "tokenizer"), vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, split_digits=True, user_defined_symbols=["<|im_start|>", "<|im_end|>"],
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )  # fmt: skip
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    config.update(add_bos_token=True, legacy=False, add_prefix_space=prefix_space)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.chat_template = CHATML
    return tokenizer
