"""The prepared-data cache: fingerprints, digests, atomic builds, stale folders, cross-process locking."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune.data.cache import DataCache, file_digest, fingerprint
from finetune.errors import DataError

REPO = Path(__file__).resolve().parent.parent
PARTS = {"model": "tiny", "data": {"seq_len": 512, "files": ["a.jsonl", "b.jsonl"], "packing": True}, "seed": 0}


def temp_entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-")) if root.exists() else []


# ------------------------------------------------------------------ fingerprints and digests
def test_fingerprint_ignores_key_order():
    reordered = {"seed": 0, "data": {"packing": True, "files": ["a.jsonl", "b.jsonl"], "seq_len": 512}, "model": "tiny"}
    assert fingerprint(PARTS) == fingerprint(reordered)
    assert len(fingerprint(PARTS)) == 64


@pytest.mark.parametrize(
    "change",
    [
        {"model": "tiny2"},
        {"seed": 1},
        {"data": {**PARTS["data"], "seq_len": 1024}},
        {"data": {**PARTS["data"], "files": ["b.jsonl", "a.jsonl"]}},
        {"data": {**PARTS["data"], "packing": False}},
        {"data": {**PARTS["data"], "seq_len": "512"}},
        {"extra": None},
    ],
)
def test_fingerprint_changes_with_any_part(change):
    assert fingerprint({**PARTS, **change}) != fingerprint(PARTS)


def test_fingerprint_is_stable_across_processes():
    code = f"from finetune.data.cache import fingerprint; print(fingerprint({PARTS!r}))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True, timeout=300
    )
    assert out.stdout.strip() == fingerprint(PARTS)


def test_fingerprint_accepts_paths_and_rejects_other_objects():
    assert fingerprint({"f": Path("/a/b")}) == fingerprint({"f": "/a/b"})
    with pytest.raises(TypeError, match=r"parts\.x is a set"):
        fingerprint({"x": {1, 2}})


def test_file_digest_follows_content(tmp_path):
    path = tmp_path / "data.jsonl"
    content = b"x" * 3000 + b"y"
    path.write_bytes(content)
    first = file_digest(path, chunk_size=1024)
    assert first == hashlib.sha256(content).hexdigest() == file_digest(path)
    path.write_bytes(content[:-1] + b"z")
    assert file_digest(path) != first
    with pytest.raises(DataError, match="missing.jsonl"):
        file_digest(tmp_path / "missing.jsonl")


# ------------------------------------------------------------------ builds
def test_build_creates_a_complete_entry(tmp_path):
    cache = DataCache(tmp_path / "cache")
    assert not cache.is_complete("k1")
    info = {"rows": 0}
    with cache.build("k1", info=info) as tmp:
        assert tmp.parent == cache.root and tmp.is_dir() and not any(tmp.iterdir())
        (tmp / "train").mkdir()
        (tmp / "train" / "data.bin").write_bytes(b"abc")
        info["rows"] = 3
    assert cache.is_complete("k1")
    manifest = cache.manifest("k1")
    assert manifest["key"] == "k1" and manifest["info"] == {"rows": 3}
    assert manifest["files"] == {"train/data.bin": 3}
    assert (cache.path("k1") / "train" / "data.bin").read_bytes() == b"abc"
    assert temp_entries(cache.root) == []


def test_exception_in_build_leaves_nothing(tmp_path):
    cache = DataCache(tmp_path)
    with pytest.raises(RuntimeError, match="tokenizer broke"):
        with cache.build("k1") as tmp:
            (tmp / "part.bin").write_bytes(b"half")
            raise RuntimeError("tokenizer broke")
    assert not cache.is_complete("k1") and not cache.path("k1").exists()
    assert temp_entries(tmp_path) == []
    with pytest.raises(DataError, match="no complete cache entry"):
        cache.manifest("k1")


KILLED_BUILD = """
import os, sys
from finetune.data.cache import DataCache
with DataCache(sys.argv[1]).build("k1") as tmp:
    (tmp / "part.bin").write_bytes(b"half")
    os._exit(3)
"""


def test_killed_build_leaves_no_entry_and_is_cleaned_later(tmp_path):
    done = subprocess.run([sys.executable, "-c", KILLED_BUILD, str(tmp_path)], cwd=REPO, timeout=300)
    assert done.returncode == 3
    cache = DataCache(tmp_path)
    assert not cache.is_complete("k1") and not cache.path("k1").exists()
    leftovers = temp_entries(tmp_path)
    assert leftovers  # the killed builder's folder (and its lock file) remain ...
    with cache.build("k2"):
        pass
    assert temp_entries(tmp_path) == leftovers  # ... young ones are kept
    old = time.time() - 2 * 3600
    for name in leftovers:
        os.utime(tmp_path / name, (old, old))
    with cache.build("k1"):
        pass
    assert temp_entries(tmp_path) == [] and cache.is_complete("k1") and cache.is_complete("k2")


def test_stale_cleaning_spares_a_live_build(tmp_path):
    cache = DataCache(tmp_path)
    with cache.build("k1") as tmp:
        old = time.time() - 2 * 3600
        os.utime(tmp, (old, old))
        os.utime(str(tmp) + ".lock", (old, old))
        assert cache.clean_stale() == []
        assert tmp.is_dir()
    assert cache.is_complete("k1")


def test_build_discards_ours_when_another_completed_first(tmp_path):
    cache = DataCache(tmp_path)
    with cache.build("k1") as ours:
        (ours / "who").write_text("ours")
        with cache.build("k1") as theirs:
            (theirs / "who").write_text("theirs")
    assert (cache.path("k1") / "who").read_text() == "theirs"
    assert temp_entries(tmp_path) == []


def test_remove_and_key_rules(tmp_path):
    cache = DataCache(tmp_path)
    with cache.build("data-abc.1"):
        pass
    cache.remove("data-abc.1")
    assert not cache.path("data-abc.1").exists() and temp_entries(tmp_path) == []
    for bad in ["", "../x", "a/b", ".hidden", "k.lock"]:
        with pytest.raises(ValueError, match="cache key"):
            cache.path(bad)
    assert DataCache("~/ft-cache").root == Path.home() / "ft-cache"


# ------------------------------------------------------------------ locking across processes
def build_under_lock(root: str, counter: str, start) -> None:
    cache = DataCache(root)
    start.wait(timeout=120)
    with cache.lock("k1"):
        if not cache.is_complete("k1"):
            with cache.build("k1") as tmp:
                with open(counter, "a") as f:
                    f.write(f"{os.getpid()}\n")
                time.sleep(0.5)
                (tmp / "data.bin").write_bytes(b"data")


@pytest.mark.slow
def test_racing_processes_build_once(tmp_path):
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(2)
    counter = tmp_path / "builds.txt"
    procs = [
        ctx.Process(target=build_under_lock, args=(str(tmp_path / "cache"), str(counter), start)) for _ in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert len(counter.read_text().splitlines()) == 1
    assert DataCache(tmp_path / "cache").is_complete("k1")


HOLD_LOCK = """
import sys, time
from finetune.data.cache import DataCache
with DataCache(sys.argv[1]).lock("k1"):
    print("locked", flush=True)
    time.sleep(30)
"""


def test_lock_timeout_names_the_entry(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(DataError, match="cache entry k1"):
            with DataCache(tmp_path).lock("k1", timeout=0.2):
                pass
    finally:
        holder.kill()
        holder.wait(timeout=300)
    with DataCache(tmp_path).lock("k1", timeout=5):  # a dead holder's lock is free again
        pass
