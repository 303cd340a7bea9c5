"""Tests for finetune.hardware: descriptions, presets, launcher environments and probing."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from finetune import gpucheck, hardware
from finetune.hardware import (
    PRESETS,
    Accelerator,
    Hardware,
    HardwareSpecError,
    LaunchEnv,
    launch_env,
    parse,
    probe,
)

GIB, TIB = 1024**3, 1024**4
REPO = Path(__file__).resolve().parents[1]


# --- parse(): accepted forms -----------------------------------------------------------------------

VALID = [
    # description, accelerator name (None: CPU), devices per node, nodes
    ("cpu", None, 1, 1),
    ("CPU", None, 1, 1),
    ("cpu:4", None, 4, 1),
    ("4xcpu", None, 4, 1),
    ("2x4xcpu", None, 4, 2),
    ("H100", "H100-80GB", 1, 1),
    ("h100-80gb", "H100-80GB", 1, 1),
    ("1xA10G-24GB", "A10G-24GB", 1, 1),
    ("a10", "A10-24GB", 1, 1),
    ("8xH100-80GB", "H100-80GB", 8, 1),
    ("8XH100-94GB", "H100-94GB", 8, 1),
    ("8 x h100nvl", "H100-94GB", 8, 1),
    ("2x8xA100-40GB", "A100-40GB", 8, 2),
    ("2×8×B200", "B200-180GB", 8, 2),
    ("a100", "A100-40GB", 1, 1),  # no size: the smallest variant
    ("v100", "V100-16GB", 1, 1),
    ("4xRTX4090", "RTX4090-24GB", 4, 1),
    ("8xMI300X-192GB", "MI300X-192GB", 8, 1),
    ("t4", "T4-16GB", 1, 1),
    ("8xA100-SXM4-80GB", "A100-80GB", 8, 1),  # form factors are ignored
    ("h100_pcie", "H100-80GB", 1, 1),
    ("  8xH100-80GB  ", "H100-80GB", 8, 1),
]


@pytest.mark.parametrize("description, name, per_node, nodes", VALID)
def test_parse_accepted_forms(description: str, name: str | None, per_node: int, nodes: int) -> None:
    hw = parse(description)
    assert (hw.accelerator.name if hw.accelerator else None) == name
    assert (hw.devices_per_node, hw.nodes, hw.world_size) == (per_node, nodes, per_node * nodes)
    assert hw.is_cpu == (name is None)
    assert hw.source == description
    assert hw.free_disk_bytes is None
    assert hw.launch == LaunchEnv()


def test_parse_cpu_uses_this_machine() -> None:
    hw = parse("cpu:4")
    assert hw.cpu_cores == hardware._cpu_cores() >= 1
    assert hw.host_memory_bytes == hardware._host_memory_bytes() > 0
    assert hw.device_memory_bytes == hw.host_memory_bytes // 4


@pytest.mark.parametrize("description", ["H100", "h100-80gb", "8xH100-80GB", "2x8xh100-80GB"])
def test_nominal_size_uses_preset_driver_memory(description: str) -> None:
    acc = parse(description).accelerator
    assert acc == PRESETS["H100-80GB"]
    assert 78 * GIB < acc.memory_bytes < 80 * GIB  # driver-reported: about 79.1 GiB
    assert acc.memory_bytes != 80 * 10**9  # not the nominal size


def test_known_gpu_with_unlisted_size_uses_nominal_bytes() -> None:
    acc = parse("2xA100-64GB").accelerator
    assert acc.name == "A100-64GB"
    assert acc.memory_bytes == 64 * 10**9
    assert acc.compute_capability == (8, 0) and acc.bf16 and acc.tf32 and not acc.fp8


def test_unknown_gpu_with_size_is_assumed_bf16() -> None:
    acc = parse("4xMyGPU-32GB").accelerator
    assert acc.memory_bytes == 32 * 10**9
    assert acc.compute_capability is None
    assert acc.bf16 and acc.fp16 and not acc.tf32 and not acc.fp8
    assert "MYGPU-32GB" in acc.name and "unknown" in acc.name


# --- parse(): host RAM, cores, defaults ------------------------------------------------------------


@pytest.mark.parametrize(
    "description, host",
    [
        ("8xH100-80GB,host=2TiB", 2 * TIB),
        ("8xH100-80GB, host=512GB", 512 * 10**9),
        ("H100,HOST=256gib", 256 * GIB),
        ("2x8xA100-80GB,host=1.5TB", 1_500_000_000_000),
        ("cpu:2,host=64GiB", 64 * GIB),
    ],
)
def test_host_suffix(description: str, host: int) -> None:
    assert parse(description).host_memory_bytes == host


def test_default_host_ram_is_twice_node_gpu_memory_at_least_64_gib() -> None:
    assert parse("8xH100-80GB").host_memory_bytes == 2 * 8 * PRESETS["H100-80GB"].memory_bytes
    assert parse("T4").host_memory_bytes == 64 * GIB


def test_cores_default_and_suffix() -> None:
    assert parse("8xH100-80GB").cpu_cores == 8 * 8
    assert parse("8xH100-80GB,cpus=192,host=2TiB").cpu_cores == 192


# --- parse(): errors ------------------------------------------------------------------------------

INVALID = [
    # description, part of the problem
    ("8xH100-80,", "empty option"),
    ("8xH100-80", "needs its unit"),
    ("0xH100", "at least 1"),
    ("2x0xH100", "at least 1"),
    ("cpu:0", "at least 1"),
    ("fooGPU", "unknown GPU"),
    ("2x", "must be followed"),
    ("", "empty"),
    ("   ", "empty"),
    ("1x2x3xH100", "at most two counts"),
    ("H100-0GB", "at least 1GB"),
    ("H100,host=5", "host="),
    ("H100,host=0GB", "host="),
    ("H100,host=1TB,host=2TB", "repeated"),
    ("cpu,foo=1", "unknown or repeated option"),
    ("H100,cpus=0", "cpus="),
    ("H100/80", "not a GPU name"),
]


@pytest.mark.parametrize("description, problem", INVALID)
def test_bad_descriptions_list_accepted_forms(description: str, problem: str) -> None:
    with pytest.raises(HardwareSpecError) as info:
        parse(description)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert problem in info.value.problem
    assert repr(description) in message
    for form in ("cpu:N", "Nxcpu", "8xH100-80GB", "2x8xA100-40GB", "host=", "MyGPU-32GB"):
        assert form in message
    for preset in PRESETS:
        assert preset in message


# --- presets and capability flags -----------------------------------------------------------------


@pytest.mark.parametrize(
    "name, bf16, fp16, tf32, fp8",
    [
        ("T4-16GB", False, True, False, False),
        ("V100-32GB", False, True, False, False),
        ("A100-80GB", True, True, True, False),
        ("A10G-24GB", True, True, True, False),
        ("L4-24GB", True, True, True, True),
        ("H100-80GB", True, True, True, True),
        ("B200-180GB", True, True, True, True),
        ("MI300X-192GB", True, True, False, True),
        ("MI250-64GB", True, True, False, False),
    ],
)
def test_capability_flags(name: str, bf16: bool, fp16: bool, tf32: bool, fp8: bool) -> None:
    acc = PRESETS[name]
    assert (acc.bf16, acc.fp16, acc.tf32, acc.fp8) == (bf16, fp16, tf32, fp8)


def test_preset_table_is_consistent() -> None:
    assert PRESETS["B200-180GB"].compute_capability == (10, 0)
    assert PRESETS["H100-80GB"].compute_capability == (9, 0)
    for key, acc in PRESETS.items():
        nominal_gb = int(key.rsplit("-", 1)[1].removesuffix("GB"))
        assert acc.name == key
        assert 0.9 * nominal_gb * 10**9 < acc.memory_bytes < nominal_gb * GIB  # driver-reported
        assert (acc.compute_capability is None) == (acc.vendor == "amd")


def test_objects_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["T4-16GB"].memory_bytes = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        parse("cpu").nodes = 2  # type: ignore[misc]


def test_hardware_rejects_zero_devices() -> None:
    with pytest.raises(ValueError, match="devices_per_node"):
        Hardware(None, 0, 1, 1, GIB, None, "test", LaunchEnv())


def test_describe() -> None:
    line = parse("2x8xH100-80GB,host=2TiB").describe()
    assert line.startswith("2 nodes × 8 × H100-80GB (79.1 GiB each), 2 TiB host RAM per node")
    assert "CPU only, 4 processes" in parse("cpu:4").describe()
    assert parse("t4").describe().startswith("1 × T4-16GB (14.8 GiB each), 64 GiB host RAM, 8 CPU cores")


# --- launch_env() ---------------------------------------------------------------------------------

TORCHRUN = {
    "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
    "MASTER_ADDR": "host0", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x",
}  # fmt: skip
SLURM = {
    "SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_NTASKS": "16", "SLURM_NNODES": "2",
    "SLURM_NODEID": "1", "SLURM_NTASKS_PER_NODE": "8", "SLURM_JOB_NODELIST": "gpu[07-08]",
}  # fmt: skip
OMPI = {
    "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}  # fmt: skip


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, LaunchEnv("none", 0, 0, 1, 1, 0, 1, None, None)),
        ({"PATH": "/bin", "MASTER_ADDR": "x"}, LaunchEnv()),
        (TORCHRUN, LaunchEnv("torchrun", 5, 1, 16, 4, 1, 4, "host0", 29500)),
        ({"RANK": "0", "WORLD_SIZE": "2"}, LaunchEnv("torchrun", 0, 0, 2, 2, 0, 1, None, None)),
        (SLURM, LaunchEnv("slurm", 9, 1, 16, 8, 1, 2, "gpu07", None)),
        # torchrun under sbatch: torchrun's variables win
        ({**SLURM, **TORCHRUN}, LaunchEnv("torchrun", 5, 1, 16, 4, 1, 4, "host0", 29500)),
        (OMPI, LaunchEnv("mpi", 3, 1, 8, 2, 1, 4, None, None)),
        ({**OMPI, "SLURM_PROCID": "0", "SLURM_NTASKS": "8"}, LaunchEnv("mpi", 3, 1, 8, 2, 1, 4, None, None)),
        ({"PMI_RANK": "2", "PMI_SIZE": "4"}, LaunchEnv("mpi", 2, 2, 4, 4, 0, 1, None, None)),
    ],
)
def test_launch_env(environ: dict[str, str], expected: LaunchEnv) -> None:
    assert launch_env(environ) == expected


def test_slurm_alternative_variables() -> None:
    env = {
        "SLURM_PROCID": "3", "SLURM_NTASKS": "6", "SLURM_JOB_NUM_NODES": "3", "SLURM_NODEID": "1",
        "SLURM_LOCALID": "1", "SLURM_NODELIST": "alpha,beta,gamma", "MASTER_PORT": "1234",
    }  # fmt: skip
    assert launch_env(env) == LaunchEnv("slurm", 3, 1, 6, 2, 1, 3, "alpha", 1234)
    assert launch_env({**env, "SLURM_NTASKS_PER_NODE": "2(x3)"}).local_world_size == 2
    assert launch_env({**env, "MASTER_ADDR": "head"}).master_addr == "head"


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("node[01-04]", "node01"),
        ("a,b", "a"),
        ("single", "single"),
        ("gpu[3,5-7]", "gpu3"),
        ("rack1-[02-04],rack2-[01-02]", "rack1-02"),
        ("n[1-2]-ib,x", "n1-ib"),
    ],
)
def test_slurm_node_list_first_host(nodelist: str, first: str) -> None:
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": nodelist}
    assert launch_env(env).master_addr == first


def test_launch_env_bad_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match="RANK='x'"):
        launch_env({"RANK": "x", "WORLD_SIZE": "2"})


def test_launch_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    assert launch_env() == launch_env(TORCHRUN)


# --- probe() ---------------------------------------------------------------------------------------

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


@pytest.fixture
def by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)


def _has_accelerator() -> bool:
    import torch

    mps = getattr(torch.backends, "mps", None)
    return torch.cuda.is_available() or bool(mps and mps.is_available())


def test_probe_this_machine(by_hand: None) -> None:
    hw = probe()
    if not _has_accelerator():
        assert hw.accelerator is None and hw.is_cpu
        assert (hw.devices_per_node, hw.nodes) == (1, 1)
        assert hw.device_memory_bytes == hw.host_memory_bytes
    assert hw.cpu_cores >= 1
    assert hw.host_memory_bytes > 0
    assert hw.free_disk_bytes is not None and hw.free_disk_bytes > 0
    assert hw.source == "probed" and hw.launch == LaunchEnv()
    assert hw.describe()


def test_probe_without_torch(by_hand: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    hw = probe()
    assert hw.accelerator is None and hw.world_size == 1


def test_probe_under_launcher_uses_launch_world(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    hw = probe()
    assert (hw.devices_per_node, hw.nodes, hw.world_size) == (4, 4, 16)
    assert hw.launch.launcher == "torchrun"
    assert "torchrun rank 5 of 16" in hw.describe()


def _fake_torch(props: list[SimpleNamespace], hip: str | None = None) -> SimpleNamespace:
    cuda = SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: len(props),
        get_device_properties=lambda i: props[i],
        is_bf16_supported=lambda: True,
    )
    return SimpleNamespace(cuda=cuda, version=SimpleNamespace(hip=hip), backends=SimpleNamespace())


def test_probe_cuda_devices_from_torch() -> None:
    props = [
        SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=85 * 10**9, major=9, minor=0),
        SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=84 * 10**9, major=9, minor=0),
    ]
    acc, count = hardware._probe_accelerator(_fake_torch(props))
    assert count == 2
    assert acc == Accelerator("NVIDIA H100 80GB HBM3", 84 * 10**9, (9, 0), "nvidia", True, True, True, True)
    t4 = SimpleNamespace(name="Tesla T4", total_memory=15 * 10**9, major=7, minor=5)
    acc, _ = hardware._probe_accelerator(_fake_torch([t4]))
    assert (acc.bf16, acc.fp16, acc.tf32, acc.fp8) == (False, True, False, False)


def test_probe_rocm_devices_from_torch() -> None:
    mi300 = SimpleNamespace(
        name="AMD Instinct MI300X", total_memory=205822885888, major=9, minor=4, gcnArchName="gfx942:sramecc+"
    )
    acc, count = hardware._probe_accelerator(_fake_torch([mi300] * 8, hip="6.2"))
    assert count == 8
    assert acc.vendor == "amd" and acc.compute_capability is None
    assert acc.bf16 and acc.fp8 and not acc.tf32


@pytest.mark.gpu
@pytest.mark.skipif(not _has_accelerator(), reason="needs a GPU")
def test_probe_finds_the_gpu(by_hand: None) -> None:
    hw = probe()
    assert hw.accelerator is not None and hw.accelerator.memory_bytes > 0
    assert hw.devices_per_node >= 1


def test_import_does_not_import_torch() -> None:
    code = "import sys, finetune.hardware; sys.exit('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr or "importing finetune.hardware imported torch"


# --- GPUs that torch cannot use --------------------------------------------------------------------

H100_LIST = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0a)\nGPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1b)\n"


@pytest.fixture
def fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """fake_smi(listing, driver, code): an `nvidia-smi` alone on PATH that prints `listing` for -L and `driver`
    per GPU for the driver query, exiting with `code`; fake_smi(None): no nvidia-smi at all."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv(gpucheck.ALLOW_CPU_WITH_GPUS, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))

    def make(listing: str | None, driver: str = "535.183.01", code: int = 0) -> None:
        if listing is None:
            return
        script = tmp_path / "nvidia-smi"
        script.write_text(
            f'#!/bin/sh\nif [ "$1" = -L ]; then printf %s "{listing}"; else printf "{driver}\\n{driver}\\n"; fi\n'
            f"exit {code}\n"
        )
        script.chmod(0o755)

    return make


def _torch_without_cuda(cuda: str | None = "13.0", reason: str = "The NVIDIA driver on your system is too old"):
    def init():
        raise RuntimeError(reason)

    cuda_module = SimpleNamespace(is_available=lambda: False, init=init)
    version = SimpleNamespace(cuda=cuda, hip=None)
    return SimpleNamespace(__version__="2.13.0+cu130", cuda=cuda_module, version=version, backends=SimpleNamespace())


def test_gpus_listed_but_driver_too_old_for_torch(fake_smi) -> None:
    fake_smi(H100_LIST, driver="535.183.01")
    message = gpucheck.gpu_visibility_problem(_torch_without_cuda("13.0"))
    assert message is not None
    for words in ("2 GPUs", "535.183.01", "torch 2.13.0+cu130", "CUDA 13.0", "driver 580 or newer", "cu128"):
        assert words in message, words
    assert "FT_ALLOW_CPU_WITH_GPUS=1" in message and "fix:" in message


def test_gpus_listed_and_torch_without_cuda_for_other_reasons(fake_smi) -> None:
    fake_smi(H100_LIST, driver="570.86.10")
    cpu_build = gpucheck.gpu_visibility_problem(_torch_without_cuda(None))
    assert cpu_build and "CPU-only build" in cpu_build and "570.86.10" in cpu_build
    other = gpucheck.gpu_visibility_problem(_torch_without_cuda("12.8", reason="CUDA unknown error\nmore"))
    assert other and "CUDA 12.8" in other and "cannot start CUDA: CUDA unknown error" in other and "more" not in other
    assert "--gpus all" in other


@pytest.mark.parametrize(
    "listing, code, visible",
    [
        (None, 0, None),  # no nvidia-smi
        ("", 0, None),  # nvidia-smi lists nothing
        ("No devices were found\n", 6, None),
        (H100_LIST, 9, None),  # nvidia-smi fails: its output is not trusted
        ("\x01garbage GPU x\n", 0, None),
        (H100_LIST, 0, ""),  # GPUs hidden on purpose
        (H100_LIST, 0, "-1"),
    ],
)
def test_no_problem_without_listed_gpus(fake_smi, monkeypatch, listing, code, visible) -> None:
    fake_smi(listing, code=code)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert gpucheck.gpu_visibility_problem(_torch_without_cuda()) is None


def test_no_problem_when_torch_sees_the_gpus(fake_smi) -> None:
    fake_smi(H100_LIST)
    h100 = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=85 * 10**9, major=9, minor=0)
    assert gpucheck.gpu_visibility_problem(_fake_torch([h100])) is None


def test_probe_refuses_to_plan_for_the_cpu_beside_unusable_gpus(fake_smi, by_hand, monkeypatch) -> None:
    from finetune.errors import FtError

    fake_smi(H100_LIST)
    monkeypatch.setattr(hardware, "_import_torch", lambda: _torch_without_cuda("13.0"))
    with pytest.raises(FtError, match="nvidia-smi lists 2 GPUs"):
        probe()
    monkeypatch.setenv(gpucheck.ALLOW_CPU_WITH_GPUS, "1")
    assert probe().is_cpu
