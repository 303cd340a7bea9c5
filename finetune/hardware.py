"""The machine a job runs on, probed or described.

`probe()` reads the machine ft is on; `parse("8xH100-80GB")` builds the same object from a description,
so `ft plan` can plan for hardware you do not have. The planner takes a `Hardware` as an argument and
never probes by itself. torch is imported only inside `probe()`, so this module loads without it.

Sizes are bytes. A preset's `memory_bytes` is the total the driver reports
(`torch.cuda.get_device_properties(i).total_memory`), less than the marketing size: an "80GB" H100
reports about 79.1 GiB. The figure moves by a few hundred MiB with driver and ECC settings, so the
planner should keep its own margin. Sizes written in descriptions use SI units: 80GB = 80 * 10**9.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

_MIB, _GIB, _TIB = 1024**2, 1024**3, 1024**4


@dataclass(frozen=True)
class Accelerator:
    """One GPU model; every device of a node is assumed to be this one."""

    name: str  # "H100-80GB" for presets, the device name when probed
    memory_bytes: int  # total per device, as the driver reports it (not the marketing size)
    compute_capability: tuple[int, int] | None  # NVIDIA only
    vendor: str  # "nvidia" | "amd" | "apple"
    bf16: bool
    fp16: bool
    tf32: bool
    fp8: bool


@dataclass(frozen=True)
class LaunchEnv:
    """What a launcher told this process through the environment; the defaults mean run by hand."""

    launcher: str = "none"  # "torchrun" | "slurm" | "mpi" | "none"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    nnodes: int = 1
    master_addr: str | None = None
    master_port: int | None = None


@dataclass(frozen=True)
class Hardware:
    """The nodes a job gets: which accelerator, how many per node, and each node's CPU, RAM and disk."""

    accelerator: Accelerator | None  # None: CPU only
    devices_per_node: int  # GPUs per node; CPU only: processes per node
    nodes: int
    cpu_cores: int  # per node
    host_memory_bytes: int  # per node
    free_disk_bytes: int | None  # in the current directory; None when described
    source: str  # "probed", or the description given to parse()
    launch: LaunchEnv  # this process's launcher; described hardware gets the by-hand default

    def __post_init__(self) -> None:
        for field in ("devices_per_node", "nodes", "cpu_cores", "host_memory_bytes"):
            if getattr(self, field) < 1:
                raise ValueError(f"Hardware.{field} must be at least 1, got {getattr(self, field)}")

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def is_cpu(self) -> bool:
        return self.accelerator is None

    @property
    def device_memory_bytes(self) -> int:
        """Memory one rank may use: its GPU's, or on CPU an equal share of the node's RAM."""
        if self.accelerator is not None:
            return self.accelerator.memory_bytes
        return self.host_memory_bytes // self.devices_per_node

    def describe(self) -> str:
        """One line, e.g. '2 nodes × 8 × H100-80GB (79.1 GiB each), 2 TiB host RAM per node, ...'."""
        per_node = " per node" if self.nodes > 1 else ""
        line = f"{self.nodes} nodes × " if self.nodes > 1 else ""
        if self.accelerator is None:
            line += f"CPU only, {self.devices_per_node} process{'es' if self.devices_per_node > 1 else ''}"
        else:
            line += f"{self.devices_per_node} × {self.accelerator.name}"
            line += f" ({_human_bytes(self.accelerator.memory_bytes)} each)"
        line += f", {_human_bytes(self.host_memory_bytes)} host RAM{per_node}"
        line += f", {self.cpu_cores} CPU cores{per_node}"
        if self.free_disk_bytes is not None:
            line += f", {_human_bytes(self.free_disk_bytes)} free disk"
        if self.launch.launcher != "none":
            line += f"; {self.launch.launcher} rank {self.launch.rank} of {self.launch.world_size}"
        return line


def _human_bytes(n: int) -> str:
    for unit, size in (("TiB", _TIB), ("GiB", _GIB), ("MiB", _MIB)):
        if n >= size:
            return f"{n / size:.1f}".removesuffix(".0") + f" {unit}"
    return f"{n} B"


# --- Presets ---------------------------------------------------------------------------------------


class _Family(NamedTuple):
    vendor: str
    capability: tuple[int, int] | None
    sizes: dict[int, int]  # nominal GB -> driver-reported MiB; the first (smallest) is the default
    amd_flags: tuple[bool, bool, bool, bool] | None = None  # (bf16, fp16, tf32, fp8), AMD only


# Typical driver-reported totals per board. A name without a size means the smallest variant,
# so a plan never assumes memory the user may not have.
_FAMILIES: dict[str, _Family] = {
    "H200": _Family("nvidia", (9, 0), {141: 143155}),
    "H100": _Family("nvidia", (9, 0), {80: 81009, 94: 95334}),  # 94GB is the H100 NVL
    "B200": _Family("nvidia", (10, 0), {180: 182630}),
    "A100": _Family("nvidia", (8, 0), {40: 40335, 80: 81050}),
    "L40S": _Family("nvidia", (8, 9), {48: 45455}),
    "A6000": _Family("nvidia", (8, 6), {48: 48681}),
    "L4": _Family("nvidia", (8, 9), {24: 22559}),
    "A10G": _Family("nvidia", (8, 6), {24: 22589}),
    "A10": _Family("nvidia", (8, 6), {24: 22589}),
    "RTX4090": _Family("nvidia", (8, 9), {24: 24218}),
    "RTX3090": _Family("nvidia", (8, 6), {24: 24259}),
    "T4": _Family("nvidia", (7, 5), {16: 15104}),
    "V100": _Family("nvidia", (7, 0), {16: 16148, 32: 32502}),
    # AMD flags per board. torch's TF32 switch is an NVIDIA setting, so tf32 stays False here.
    "MI300X": _Family("amd", None, {192: 196288}, (True, True, False, True)),
    "MI250": _Family("amd", None, {64: 65520}, (True, True, False, False)),  # one GCD; a card has two
}
# Other spellings of a board: (family, nominal GB).
_ALIASES: dict[str, tuple[str, int]] = {"H100NVL": ("H100", 94), "RTXA6000": ("A6000", 48)}
_FLAGS = ("bf16", "fp16", "tf32", "fp8")


def _nvidia_flags(cc: tuple[int, int]) -> dict[str, bool]:
    return dict(zip(_FLAGS, (cc >= (8, 0), cc >= (5, 3), cc >= (8, 0), cc >= (8, 9))))


def _family_accelerator(family: str, nominal_gb: int, memory_bytes: int) -> Accelerator:
    fam = _FAMILIES[family]
    flags = dict(zip(_FLAGS, fam.amd_flags)) if fam.amd_flags else _nvidia_flags(fam.capability or (0, 0))
    return Accelerator(f"{family}-{nominal_gb}GB", memory_bytes, fam.capability, fam.vendor, **flags)


PRESETS: dict[str, Accelerator] = {
    f"{family}-{gb}GB": _family_accelerator(family, gb, mib * _MIB)
    for family, fam in _FAMILIES.items()
    for gb, mib in fam.sizes.items()
}


# --- parse(): descriptions -------------------------------------------------------------------------

# Described GPU nodes without `cpus=`: 8 cores per GPU (cloud GPU nodes give 4 to 24 per GPU).
_DEFAULT_CORES_PER_GPU = 8
# Described GPU nodes without `host=`: max(64 GiB, 2 × the node's total GPU memory), room to stage
# a full checkpoint of the node's GPUs in host RAM.
_MIN_DEFAULT_HOST_BYTES = 64 * _GIB
_HOST_UNITS = {"GB": 10**9, "GIB": _GIB, "TB": 10**12, "TIB": _TIB}


class HardwareSpecError(ValueError):
    """A hardware description that parse() cannot read; the message lists every accepted form."""

    def __init__(self, description: str, problem: str) -> None:
        self.description, self.problem = description, problem
        super().__init__(f"Cannot read the hardware description {description!r}: {problem}.\n{_forms()}")


def _forms() -> str:
    multi = [(name, next(iter(fam.sizes))) for name, fam in _FAMILIES.items() if len(fam.sizes) > 1]
    defaults = ", ".join(f"{name.lower()} = {name}-{gb}GB" for name, gb in multi)
    return (
        "Accepted forms (case-insensitive):\n  cpu              this machine's CPU, 1 process\n  cpu:N, Nxcpu     N "
        "processes on this machine's CPU         e.g. cpu:4, 4xcpu\n  GPU              one GPU                        "
        "           e.g. h100, A100-40GB\n  NxGPU            N GPUs on one node                        e.g. "
        "8xH100-80GB, 1xA10G-24GB\n  MxNxGPU          M nodes of N GPUs each                    e.g. 2x8xA100-40GB\n  "
        "NAME-SIZEGB      a GPU that is not a preset, SIZE in GB    e.g. 4xMyGPU-32GB\n  ...,host=SIZE    host RAM "
        "per node: GB, GiB, TB or TiB     e.g. 8xH100-80GB,host=2TiB\n  ...,cpus=N       CPU cores per node           "
        f"             e.g. 8xH100-80GB,cpus=192\nGPU presets: {', '.join(PRESETS)}.\nA name without a size means the "
        f"smallest variant ({defaults})."
    )


def parse(description: str) -> Hardware:
    """Build Hardware from a description such as 'cpu:4', '8xH100-80GB' or '2x8xA100-40GB,host=1TiB'."""
    text = "".join(description.split()).upper().replace("×", "X")
    if not text:
        raise HardwareSpecError(description, "it is empty")
    head, *option_texts = text.split(",")
    options = _parse_options(description, option_texts)
    head = re.sub(r"^CPU:(\d+)$", r"\1XCPU", head)
    nodes, per_node, target = _split_counts(description, head)
    if target == "CPU":  # this machine's CPU
        accelerator, cores = None, options.get("CPUS") or _cpu_cores()
        host = options.get("HOST") or _host_memory_bytes()
    else:
        accelerator = _parse_gpu(description, target)
        cores = options.get("CPUS") or _DEFAULT_CORES_PER_GPU * per_node
        host = options.get("HOST") or max(_MIN_DEFAULT_HOST_BYTES, 2 * per_node * accelerator.memory_bytes)
    return Hardware(accelerator, per_node, nodes, cores, host, None, description, LaunchEnv())


def _split_counts(description: str, head: str) -> tuple[int, int, str]:
    """'2X8XA100' -> (2 nodes, 8 per node, 'A100'): the counts are the leading 'digitsX' prefixes."""
    match = re.fullmatch(r"((?:\d+X)*)(.*)", head)
    assert match is not None  # the pattern matches any string
    counts, target = [int(c) for c in match.group(1).split("X")[:-1]], match.group(2)
    if not target:
        raise HardwareSpecError(description, "a count must be followed by 'cpu' or a GPU name")
    if len(counts) > 2:
        raise HardwareSpecError(description, f"at most two counts (nodes x GPUs per node), got {len(counts)}")
    if any(c < 1 for c in counts):
        raise HardwareSpecError(description, "counts of nodes and devices must be at least 1")
    nodes = counts[0] if len(counts) == 2 else 1
    per_node = counts[-1] if counts else 1
    return nodes, per_node, target


def _parse_options(description: str, texts: list[str]) -> dict[str, int]:
    options: dict[str, int] = {}
    for text in texts:
        key, sep, value = text.partition("=")
        if not text:
            raise HardwareSpecError(description, "it has an empty option after a comma")
        if not sep or key not in ("HOST", "CPUS") or key in options:
            raise HardwareSpecError(description, f"unknown or repeated option {text.lower()!r}")
        if key == "CPUS":
            if not value.isdigit() or int(value) < 1:
                raise HardwareSpecError(description, f"cpus= takes a whole number of cores, got {value!r}")
            options[key] = int(value)
            continue
        size = re.fullmatch(r"(\d+(?:\.\d+)?)(GB|GIB|TB|TIB)", value)
        if not size or float(size.group(1)) <= 0:
            raise HardwareSpecError(description, f"host= takes a size such as 512GB or 2TiB, got {value!r}")
        options[key] = int(float(size.group(1)) * _HOST_UNITS[size.group(2)])
    return options


def _parse_gpu(description: str, target: str) -> Accelerator:
    match = re.fullmatch(r"([A-Z0-9][A-Z0-9_\-]*?)(?:-(\d+)GB)?", target)
    if not match:
        raise HardwareSpecError(description, f"{target!r} is not a GPU name such as H100 or A100-40GB")
    name, gb = match.group(1), int(match.group(2) or 0)
    if match.group(2) and gb < 1:
        raise HardwareSpecError(description, "a GPU's memory must be at least 1GB")
    key = re.sub(r"(SXM\d?|PCIE)$", "", re.sub(r"[-_]", "", name))  # the form factor does not matter
    family, alias_gb = _ALIASES.get(key, (key, 0))
    if family in _FAMILIES:
        gb = gb or alias_gb or next(iter(_FAMILIES[family].sizes))
        if gb in _FAMILIES[family].sizes:
            return PRESETS[f"{family}-{gb}GB"]
        return _family_accelerator(family, gb, gb * 10**9)  # a known board, unlisted size
    if not gb:
        hint = " (a memory size needs its unit, e.g. -80GB)" if re.search(r"-\d+$", name) else ""
        raise HardwareSpecError(description, f"unknown GPU {name!r} and no memory size given{hint}")
    # An unknown board with a size: assume a current GPU with bf16 but claim neither TF32 nor FP8;
    # the name says so, so plans show the assumption.
    return Accelerator(
        f"{name}-{gb}GB (unknown GPU: assumed bf16, no tf32/fp8)", gb * 10**9, None, "nvidia",
        bf16=True, fp16=True, tf32=False, fp8=False,
    )  # fmt: skip


# --- launch_env(): what a launcher told this process -----------------------------------------------


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Rank and world from the environment (default os.environ); a pure function of `environ`.

    Precedence: torchrun (it sets RANK/WORLD_SIZE per process, also under sbatch) > MPI (mpirun
    inside an allocation inherits the batch shell's SLURM_PROCID=0 in every process) > SLURM.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return _torchrun_env(env)
    if "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:
        return _mpi_env(env)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _slurm_env(env)
    return LaunchEnv()


def _int(env: Mapping[str, str], *names: str, default: int | None = None) -> int:
    """The first of `names` that env sets, as an int; SLURM's '4(x2)' reads as 4."""
    for name in names:
        if name in env:
            match = re.match(r"\s*(\d+)", env[name])
            if not match:
                raise ValueError(
                    f"Environment variable {name}={env[name]!r} is not a whole number. Launchers "
                    "(torchrun, srun, mpirun) set it; fix the launch script or unset it."
                )
            return int(match.group(1))
    if default is None:
        raise ValueError(f"The launcher set none of {', '.join(names)}; set it or launch with torchrun.")
    return default


def _port(env: Mapping[str, str]) -> int | None:
    return _int(env, "MASTER_PORT") if "MASTER_PORT" in env else None


def _torchrun_env(env: Mapping[str, str]) -> LaunchEnv:
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    local_world = max(1, _int(env, "LOCAL_WORLD_SIZE", default=world))
    return LaunchEnv(
        "torchrun", rank, _int(env, "LOCAL_RANK", default=rank % local_world), world, local_world,
        _int(env, "GROUP_RANK", "NODE_RANK", default=rank // local_world),
        max(1, world // local_world), env.get("MASTER_ADDR"), _port(env),
    )  # fmt: skip


def _mpi_env(env: Mapping[str, str]) -> LaunchEnv:
    rank = _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK")
    world = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    # Plain PMI without a local size (MPICH outside Intel MPI): assume every rank is on this node.
    local_world = max(1, _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", default=world))
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", default=rank % local_world)
    return LaunchEnv(
        "mpi", rank, local_rank, world, local_world, rank // local_world,
        max(1, world // local_world), env.get("MASTER_ADDR"), _port(env),
    )  # fmt: skip


def _slurm_env(env: Mapping[str, str]) -> LaunchEnv:
    world = _int(env, "SLURM_NTASKS")
    nnodes = max(1, _int(env, "SLURM_NNODES", "SLURM_JOB_NUM_NODES", default=1))
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    return LaunchEnv(
        "slurm", _int(env, "SLURM_PROCID"), _int(env, "SLURM_LOCALID", default=0), world,
        _int(env, "SLURM_NTASKS_PER_NODE", default=max(1, world // nnodes)),
        _int(env, "SLURM_NODEID", default=0), nnodes,
        env.get("MASTER_ADDR") or (_first_host(nodelist) if nodelist else None), _port(env),
    )  # fmt: skip


def _first_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'node[01-04]' -> 'node01', 'a,b' -> 'a', 'gpu[3,5-7]' -> 'gpu3'."""
    first = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist.strip())
    if not first:
        raise ValueError(f"Cannot read the SLURM node list {nodelist!r}; set MASTER_ADDR to the first host.")
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], first.group(0))


# --- probe(): this machine -------------------------------------------------------------------------


def probe() -> Hardware:
    """Read this machine: accelerators through torch (CPU only without it), CPU, RAM, disk, launcher.

    Run by hand, every visible GPU counts (ft train starts one rank per GPU). Under a launcher its
    world is authoritative: devices_per_node = local_world_size, nodes = nnodes.
    """
    launch = launch_env()
    torch = _import_torch()
    accelerator, count = _probe_accelerator(torch)
    if accelerator is None and torch is not None:
        from finetune.gpucheck import require_usable_gpus

        require_usable_gpus(torch)  # never plan for the CPU of a machine whose GPUs torch cannot use
    per_node, nodes = max(1, count), 1
    if launch.launcher != "none":
        per_node, nodes = launch.local_world_size, launch.nnodes
    try:
        free_disk: int | None = shutil.disk_usage(os.getcwd()).free
    except OSError:
        free_disk = None
    return Hardware(accelerator, per_node, nodes, _cpu_cores(), _host_memory_bytes(), free_disk, "probed", launch)


def _import_torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def _probe_accelerator(torch: Any) -> tuple[Accelerator | None, int]:
    """(accelerator, device count) from a torch module; (None, 0) for CPU only."""
    if torch is None:
        return None, 0
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        count = torch.cuda.device_count()
        # Mixed boards: describe the smallest, since every rank must fit on its device.
        props = min((torch.cuda.get_device_properties(i) for i in range(count)), key=lambda p: p.total_memory)
        if getattr(torch.version, "hip", None):
            # ROCm reports an arch such as gfx942 (MI300) rather than an NVIDIA compute capability.
            fp8 = str(getattr(props, "gcnArchName", "")).startswith(("gfx94", "gfx95"))
            bf16 = bool(torch.cuda.is_bf16_supported())
            return Accelerator(props.name, props.total_memory, None, "amd", bf16, True, False, fp8), count
        cc = (props.major, props.minor)
        return Accelerator(props.name, props.total_memory, cc, "nvidia", **_nvidia_flags(cc)), count
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        # Apple GPUs share the host's unified memory. Metal's recommended working set is the share
        # one process may use (torch >= 2.5 reports it); older torch: three quarters of host RAM.
        recommended = getattr(getattr(torch, "mps", None), "recommended_max_memory", None)
        memory = int(recommended()) if recommended else _host_memory_bytes() * 3 // 4
        bf16 = int((platform.mac_ver()[0] or "0").split(".")[0]) >= 14  # MPS bf16 needs macOS 14
        return Accelerator("Apple MPS", memory, None, "apple", bf16, True, False, False), 1
    return None, 0


def _cpu_cores() -> int:
    """Cores this process may run on (honours taskset and cgroup cpusets where the OS reports them)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _host_memory_bytes() -> int:
    """Total RAM: MemTotal from /proc/meminfo on Linux, else physical pages times the page size."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return max(1, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        raise RuntimeError(
            "Cannot read this machine's RAM (no /proc/meminfo, no sysconf); describe it instead, "
            "e.g. --hardware 'cpu,host=64GB'."
        ) from None
