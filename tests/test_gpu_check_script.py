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


# One process per environment collects every selection in turn (pytest.main again and again: the test files and
# their imports load once), in place of a new pytest process per selection.
COLLECT = """
import json, sys
import pytest

class Found:
    def pytest_collection_finish(self, session):
        self.ids = [item.nodeid for item in session.items]

out = {}
for file, k, marks in json.loads(sys.argv[1]):
    found = Found()
    found.ids = []
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *marks, file, *(["-k", k] if k else [])],
                       plugins=[found])
    out[f"{file}|{k}"] = [int(code), found.ids]
print("COLLECTED " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def collected() -> dict:
    """{python: {"file|k": (pytest's exit code, the node ids collected)}}, or {python: reason} where it cannot run."""
    import json

    found = {}
    for python in ("main", "vllm"):
        chosen = [(f, k, ["-m", "gpu"] if "test_weight_transfer_versions" not in f else []) for f, k, p in SELECTIONS]
        chosen = [c for c, (_, _, p) in zip(chosen, SELECTIONS) if p == python]
        py = sys.executable
        if python == "vllm":
            if not VLLM_PY.exists():
                found[python] = "no .venv-vllm"
                continue
            py = str(VLLM_PY)
        r = subprocess.run(
            [py, "-c", COLLECT, json.dumps(chosen)], capture_output=True, text=True, cwd=REPO, timeout=300
        )
        line = [s for s in r.stdout.splitlines() if s.startswith("COLLECTED ")]
        if python == "vllm" and not line and "No module named" in r.stderr:
            found[python] = "no pytest or vLLM in .venv-vllm"
            continue
        assert line, r.stdout[-2000:] + r.stderr[-2000:]
        found[python] = json.loads(line[-1].removeprefix("COLLECTED "))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("file,k,python", SELECTIONS, ids=[f"{f}-{k}" for f, k, _ in SELECTIONS])
def test_every_selection_collects_a_test(file, k, python, collected):
    assert (REPO / file).exists(), file
    if isinstance(collected[python], str):
        pytest.skip(collected[python])
    code, ids = collected[python][f"{file}|{k}"]
    assert code == 0 and ids and all(i.startswith(f"{file}::") for i in ids), (code, ids)
