"""A folder of prepared datasets, one entry per fingerprint.

An entry is complete exactly when its folder holds `manifest.json`. Entries are built in a private
temporary folder inside the root and renamed into place only after the manifest is written, so a
build that fails or is killed never leaves an entry that looks complete. `lock(key)` serialises
builders across processes with a file lock (no torch.distributed collective is involved), e.g.:

    cache = DataCache(root)
    with cache.lock(key):
        if not cache.is_complete(key):
            with cache.build(key) as tmp:
                ...  # write the prepared data under tmp
    data_dir = cache.path(key)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from finetune.errors import DataError

MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
STALE_AFTER_S = 3600.0  # a temporary folder this old whose builder is gone is removed
_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def file_digest(path: str | Path, chunk_size: int = 1 << 20) -> str:
    """sha256 (hex) of a file's content, read in chunks."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(chunk_size):
                digest.update(chunk)
    except OSError as exc:
        raise DataError(f"cannot read {path} to fingerprint it: {exc.strerror or exc}") from exc
    return digest.hexdigest()


def _canonical(value, where: str = "parts"):
    """Plain JSON values only (paths become strings), so that the encoding is the same in every process."""
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"fingerprint: {where} has a non-string key {k!r}")
            out[k] = _canonical(v, f"{where}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [_canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise TypeError(f"fingerprint: {where} is a {type(value).__name__}; use str, number, bool, None, list or dict")


def fingerprint(parts: Mapping) -> str:
    """sha256 (hex) of the canonical JSON of `parts`: sorted keys, no whitespace, no NaN.

    Equal parts give the same fingerprint in any run or process; key order does not matter.
    """
    text = json.dumps(_canonical(parts), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _files(folder: Path) -> dict[str, int]:
    """Relative path -> size of every file under folder."""
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


class DataCache:
    """Prepared datasets under `root`, one folder per key (a fingerprint)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()

    def path(self, key: str) -> Path:
        """The folder of entry `key` (it may not exist yet)."""
        if not isinstance(key, str) or not _KEY.fullmatch(key) or key.endswith(".lock"):
            raise ValueError(
                f"cache key {key!r} must be letters, digits, '.', '_' or '-', "
                "start with a letter or digit and not end in '.lock'"
            )
        return self.root / key

    def is_complete(self, key: str) -> bool:
        """True when entry `key` exists with its manifest (which is written last)."""
        return (self.path(key) / MANIFEST).is_file()

    def manifest(self, key: str) -> dict:
        """The manifest of a complete entry: key, created (UTC), files {path: bytes}, info."""
        if not self.is_complete(key):
            raise DataError(f"no complete cache entry {key} in {self.root}")
        return json.loads((self.path(key) / MANIFEST).read_text())

    @contextmanager
    def lock(self, key: str, timeout: float | None = None) -> Iterator[None]:
        """Hold `root/<key>.lock` across processes; wait at most `timeout` seconds (None: forever)."""
        from filelock import FileLock, Timeout

        path = self.path(key)
        self.root.mkdir(parents=True, exist_ok=True)
        file_lock = FileLock(str(path) + ".lock", timeout=-1 if timeout is None else timeout)
        try:
            file_lock.acquire()
        except Timeout:
            raise DataError(
                f"waited {timeout:g} s for another process preparing cache entry {key} "
                f"(lock {file_lock.lock_file}); wait longer or stop the other process"
            ) from None
        try:
            yield
        finally:
            file_lock.release()

    @contextmanager
    def build(self, key: str, info: Mapping | None = None) -> Iterator[Path]:
        """Yield an empty private folder to write entry `key` into.

        On normal exit the manifest is written last (with `info`, read at exit, so the caller may fill
        it in inside the block) and the folder is renamed to `path(key)` in one step. If another
        process completed the entry meanwhile, ours is discarded. On an exception the folder is
        removed and the exception propagates. Stale folders of killed builds are removed first.
        """
        from filelock import FileLock

        final = self.path(key)
        self.root.mkdir(parents=True, exist_ok=True)
        self.clean_stale()
        tmp = self.root / f"{TMP_PREFIX}{key}-{uuid.uuid4().hex[:12]}"
        owner = FileLock(str(tmp) + ".lock")  # held while we build: tells clean_stale() we are alive
        owner.acquire()
        try:
            tmp.mkdir()
            try:
                yield tmp
                self._write_manifest(tmp, key, info)
                self._publish(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
        finally:
            owner.release()
            Path(owner.lock_file).unlink(missing_ok=True)

    def remove(self, key: str) -> None:
        """Delete entry `key` if present; it stops looking complete at once (renamed aside first)."""
        final = self.path(key)
        if not final.exists():
            return
        aside = self.root / f"{TMP_PREFIX}{key}-removed-{uuid.uuid4().hex[:12]}"
        os.rename(final, aside)
        shutil.rmtree(aside, ignore_errors=True)

    def clean_stale(self, older_than_s: float = STALE_AFTER_S) -> list[Path]:
        """Remove temporary folders older than `older_than_s` whose builder no longer holds its lock."""
        from filelock import FileLock, Timeout

        if not self.root.is_dir():
            return []
        names = {p.name.removesuffix(".lock") for p in self.root.glob(f"{TMP_PREFIX}*")}
        removed = []
        for name in sorted(names):
            tmp, lock_path = self.root / name, self.root / f"{name}.lock"
            if min(_age_s(tmp), _age_s(lock_path)) < older_than_s:
                continue
            probe = FileLock(str(lock_path), timeout=0)
            try:
                probe.acquire()
            except Timeout:
                continue  # its builder is still running
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                removed.append(tmp)
            finally:
                probe.release()
                lock_path.unlink(missing_ok=True)
        return removed

    @staticmethod
    def _write_manifest(tmp: Path, key: str, info: Mapping | None) -> None:
        manifest = {
            "key": key,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "files": _files(tmp),
            "info": dict(info or {}),
        }
        staging = tmp / f".{MANIFEST}.partial"
        with open(staging, "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True, default=str)  # str() what JSON lacks
            f.flush()
            os.fsync(f.fileno())
        os.replace(staging, tmp / MANIFEST)

    def _publish(self, tmp: Path, final: Path) -> None:
        """Rename tmp to final; if a complete entry is already there, keep it and drop ours."""
        if final.exists() and not (final / MANIFEST).is_file():
            self.remove(final.name)  # a folder without manifest is not an entry: replace it
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / MANIFEST).is_file():
                raise
            # another process completed the entry meanwhile: theirs stands, ours is discarded
