"""Fuzzing `ft validate` and `ft plan`: hundreds of bad job files, each answered with exit code 2 and a message
naming the key or file:line; no traceback, no hang, no runaway memory.

The cases come from tests/fuzz/configs.py (seeded, so the same every run) and run in this process
(tests/fuzz/runner.py); a few go through a real `ft` subprocess to check the top-level handler too.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time

import pytest

from tests.fuzz.configs import generate
from tests.fuzz.runner import run_all, summary
from tests.helpers import REPO

KINDS = {
    "bool-for-int",
    "int-out-of-range",
    "huge-int",
    "unknown-value",
    "template-typo",
    "misspelled-key",
    "missing-key",
    "broken-yaml",
    "binary",
    "latin1",
    "utf16",
    "control-char",
    "nul-in-string",
    "alias-bomb",
    "alias-quadratic",
    "alias-recursive",
    "deep-flow",
    "deep-block",
    "tag",
    "long-string",
    "too-big",
    "env-nested-missing",
    "env-bad-value",
    "set",
}


@pytest.fixture(scope="module")
def cases():
    return generate(seed=0)


@pytest.mark.slow
def test_the_generator_is_seeded_and_covers_every_kind_of_mistake(cases):
    def digest(cs):
        return hashlib.sha256(b"".join(c.name.encode() + c.body + repr(c.args).encode() for c in cs)).hexdigest()

    assert len(cases) >= 300
    assert digest(cases) == digest(generate(seed=0)) != digest(generate(seed=1))
    assert KINDS <= {c.name.split("/")[1] for c in cases}
    assert {c.command for c in cases} == {"validate", "plan"}


@pytest.mark.slow
def test_every_bad_config_is_a_clear_user_error(cases, tmp_path):
    start = time.monotonic()
    outcomes = run_all(cases, tmp_path, timeout=20)
    elapsed = time.monotonic() - start
    bad = [o for o in outcomes if o.verdict != "ok"]
    report = "\n".join(
        f"{o.verdict} {o.case.name} {o.case.command} {o.case.args[:2]}: {o.output[-400:]!r}" for o in bad[:10]
    )
    assert not bad, f"{summary(outcomes)}\n{report}"
    assert max(o.seconds for o in outcomes) < 20
    assert elapsed < 120, summary(outcomes)


def _ft(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "finetune", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("kind", ["binary", "alias-bomb", "tag", "env-nested-missing", "huge-int"])
def test_a_real_ft_process_answers_bad_files_with_one_message(cases, kind, tmp_path):
    case = next(c for c in cases if c.name.split("/")[1] == kind)
    path = tmp_path / "job.yaml"
    path.write_bytes(case.body)
    r = _ft(case.command, str(path), *case.args, env=case.env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and r.stderr.startswith("error: ") and str(path) in r.stderr
