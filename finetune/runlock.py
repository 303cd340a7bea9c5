"""The lock of a run folder: one job writes it at a time.

`ft train` takes the lock (RUN/.ft-lock, artifacts.run.LOCK) exclusively before it reads, removes (`--overwrite`) or
writes anything in the folder, and writes into the file which process holds it (PID, host, command, since when). A
second `ft train` of the same folder, with `--overwrite` or `--resume` or neither, is refused with that holder. Before
it starts torchrun the launcher shares the lock, and each rank joins it (a shared lock on the same file): the lock
stays held while any process of the job runs, also ranks that finish their checkpoint after their launcher was
killed. Only node 0's `ft train` takes it; the other nodes' launchers never remove or write the folder's files, and
their ranks join it like node 0's.

The lock is an flock(2) lock, so the kernel releases it when its holders exit, however they end (SIGKILL too): a
lock file left behind locks nothing, and its PID and host are only information for the message. The last holder
removes the file (taking it exclusively first, so that it never removes a lock someone else holds; a process that
opened the file just before checks, once it has the lock, that the path still names it). On filesystems without
locks (some Lustre mounts) ft warns and goes on unlocked. NFS carries flock locks between its clients (Linux emulates
them with byte-range locks); a client that crashes keeps them until the server's lease ends (NFSv4) or, on NFSv3,
until it comes back: the message says how to remove the file by hand.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from finetune.artifacts.run import LOCK
from finetune.distributed.lifecycle import alive
from finetune.errors import FtError

try:
    import fcntl
except ImportError:  # Windows: no flock
    fcntl = None

UNSUPPORTED = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL)
ATTEMPTS = 20  # a file replaced between open and lock (its holder removed it): open the new one


class RunLock:
    """One process's hold on a run folder's lock; `fd` None when the filesystem has no locks."""

    def __init__(self, run_dir: Path, fd: int | None, created: list[Path]):
        self.path = Path(run_dir) / LOCK
        self.fd = fd
        self.created = created  # folders made to hold the lock: removed again if the job leaves them empty

    def share(self) -> None:
        """Turn the exclusive lock into a shared one that the job's ranks join (before they start)."""
        if self.fd is None:
            return
        try:  # flock(2) may drop the lock before it takes the shared one: another process could win in between
            fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FtError(
                f"{self.path}: another process took the run folder's lock while ft train handed it to its ranks; "
                f"{_holder(self.fd, self.path)}. No rank was started: run ft train again once it is done"
            ) from None

    def release(self) -> None:
        """Let go; the last holder removes the file, and the folders made for it if the job left them empty."""
        fd, self.fd = self.fd, None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while a rank (or anyone) still holds it
                if _names(self.path, fd):
                    self.path.unlink()
            except OSError:
                pass
            finally:
                os.close(fd)
        for folder in reversed(self.created):
            try:
                folder.rmdir()
            except OSError:
                break


@contextlib.contextmanager
def locked(run_dir: Path, what: str, make: bool = True) -> Iterator[RunLock]:
    """Hold `run_dir`'s lock exclusively (a job's launcher, which writes the folder), making the folder if needed
    (`make`; otherwise a missing folder is not locked: the caller reports it); refuses with the holder's PID and host
    when another process holds it. `what`: the command, for the message."""
    run_dir = Path(run_dir)
    lock = acquire(run_dir, what) if make or run_dir.is_dir() else RunLock(run_dir, None, [])
    try:
        yield lock
    finally:
        lock.release()


@contextlib.contextmanager
def joined(run_dir: Path) -> Iterator[None]:
    """A rank of the job whose launcher holds the lock (shared): hold it shared too while the rank runs."""
    path = Path(run_dir) / LOCK
    fd = _open_locked(path, shared=True) if path.parent.is_dir() else None  # missing: the rank reports it
    try:
        yield
    finally:
        if fd is not None:
            RunLock(Path(run_dir), fd, []).release()


def acquire(run_dir: Path, what: str) -> RunLock:
    created = [p for p in (run_dir, *run_dir.parents) if not p.exists()][::-1]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FtError(
            f"output.dir {run_dir}: cannot make the folder ({e.strerror or e}); choose one you can write to"
        ) from None
    try:
        fd = _open_locked(run_dir / LOCK, shared=False)
    except BaseException:
        RunLock(run_dir, None, created).release()  # refused: leave no folder behind
        raise
    if fd is not None:  # who holds it, for the message of the next one (a full disk only makes that message vaguer)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "command": what, "since": _now()}
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    return RunLock(run_dir, fd, created)


def _open_locked(path: Path, shared: bool) -> int | None:
    """A descriptor of `path` holding its lock (shared or exclusive); None where the filesystem has no locks."""
    if fcntl is None:
        return None
    for _ in range(ATTEMPTS):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise FtError(
                f"{path}: cannot open the run folder's lock file ({e.strerror or e}); output.dir must be a folder "
                "you can write to"
            ) from None
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            message = _busy(path, fd, shared)
            os.close(fd)
            raise FtError(message) from None
        except OSError as e:
            os.close(fd)
            if e.errno not in UNSUPPORTED:
                raise
            sys.stderr.write(
                f"warning: {path.parent}: this filesystem does not lock files ({e.strerror}); nothing stops a second "
                "job from writing this run folder at the same time\n"
            )
            return None
        if _names(path, fd):
            return fd
        os.close(fd)  # its holder removed the file after we opened it: lock the file the path names now
    raise FtError(f"{path}: the lock file keeps being replaced; is another ft starting in this folder?")


def _names(path: Path, fd: int) -> bool:
    """Whether `path` still names the file open as `fd` (not removed or replaced by its previous holder)."""
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _busy(path: Path, fd: int, shared: bool) -> str:
    run_dir = path.parent
    if shared:  # a rank: the lock is held exclusively by someone other than its launcher
        return (
            f"output.dir {run_dir} is locked by another job: {_holder(fd, path)}. This rank's launcher no longer "
            "holds the run folder; start the job again with ft train once the other one is done"
        )
    return (
        f"output.dir {run_dir} is in use: {_holder(fd, path)}. ft writes a run folder from one job at a time "
        "(--overwrite and --resume included): wait for that job to end, stop it (it stops after its step with a "
        f"checkpoint), or choose another output.dir. Should that host be gone for good with its filesystem still "
        f"holding the lock (NFSv3), delete {path}"
    )


def _holder(fd: int, path: Path) -> str:
    """Who holds the lock, from what the holder wrote into the file."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError, UnicodeDecodeError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return f"a process that has not said which (one starting now, or ranks started by hand) holds {path}"
    pid, host = info.get("pid"), info.get("host") or "an unknown host"
    text = f"{info.get('command') or 'ft'} (PID {pid} on host {host}, since {info.get('since', '?')}) holds {path}"
    if host == socket.gethostname() and isinstance(pid, int) and not alive(pid):
        text += f"; PID {pid} has exited, and processes it started (its ranks) still hold the lock while they finish"
    return text


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %z")
