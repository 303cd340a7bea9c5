"""scripts/gpu-check.sh, checked on the CPU: it parses, every section its header documents exists, the default
sections' caps fit the budget, and every test file and -k selection it names collects at least one test."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu-check.sh"
TEXT = SCRIPT.read_text()
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=300)


def header_sections() -> list[str]:
    header = TEXT[TEXT.index("# Sections:") : TEXT.index("# Environment:")]
    return re.findall(r"^#   ([a-z0-9-]+)\s", header, re.M)


def caps() -> dict[str, int]:
    body = re.search(r"declare -A CAP=\((.*?)\)\n", TEXT, re.S).group(1)
    return {k: int(v) for k, v in re.findall(r"\[([a-z0-9-]+)\]=(\d+)", body)}


def test_every_documented_section_exists_and_has_a_cap():
    documented = header_sections()
    assert {"setup", "first-contact", "vllm", "pytest", "memory", "savers", "loss", "bf16pure"} <= set(documented)
    for name in documented:
        assert re.search(rf"^    {re.escape(name)}\) ", TEXT, re.M), name
        assert name == "setup" or name in caps(), name


def test_the_default_sections_caps_fit_the_budget():
    default = re.search(r'^DEFAULT_SECTIONS="([^"]+)"', TEXT, re.M).group(1).split()
    budget = int(re.search(r"FT_GPU_CHECK_BUDGET:-(\d+)", TEXT).group(1))
    assert default[0] == "first-contact" and budget <= 560
    assert sum(caps()[s] for s in default) <= budget, {s: caps()[s] for s in default}


def selections() -> list[tuple[str, str | None, str]]:
    """(file, -k selection or None, python) for each pytest run the script names."""
    found = []
    for line in TEXT.splitlines():
        line = line.replace("$fc", "tests/test_gpu_first_contact.py")
        if ("pytest" not in line and "${g[@]}" not in line) or not re.search(r"tests/test_\w+\.py", line):
            continue
        line = line.replace("$fc", "tests/test_gpu_first_contact.py")
        words = shlex.split(line.split("||")[0], comments=False, posix=True)
        files = [w for w in words if re.fullmatch(r"tests/test_\w+\.py", w)]
        k = words[words.index("-k") + 1] if "-k" in words else None
        found += [(f, k, "vllm" if "$py" in line or "VLLM" in line else "main") for f in files]
    return found


SELECTIONS = selections()


def test_the_script_names_the_first_contact_checks():
    files = {f for f, _, _ in SELECTIONS}
    assert {
        "tests/test_gpu_first_contact.py",
        "tests/test_attention.py",
        "tests/test_activation_savers.py",
        "tests/test_gpu.py",
        "tests/test_gpu_rollout.py",
        "tests/test_weight_transfer_versions.py",
    } <= files


@pytest.mark.slow
@pytest.mark.parametrize("file,k,python", SELECTIONS, ids=[f"{f}-{k}" for f, k, _ in SELECTIONS])
def test_every_selection_collects_a_test(file, k, python):
    assert (REPO / file).exists(), file
    py = sys.executable
    if python == "vllm":
        if not VLLM_PY.exists() or subprocess.run([str(VLLM_PY), "-c", "import pytest, vllm"], timeout=300).returncode:
            pytest.skip("no .venv-vllm with pytest and vLLM")
        py = str(VLLM_PY)
    marks = ["-m", "gpu"] if "test_weight_transfer_versions" not in file else []
    cmd = [py, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *marks, file]
    r = subprocess.run(cmd + (["-k", k] if k else []), capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0 and re.search(r"^tests/\S+::", r.stdout, re.M), r.stdout[-2000:] + r.stderr[-2000:]
