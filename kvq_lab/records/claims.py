"""Claims: while a run is under way it holds an exclusive lock (`flock`) on `<results_dir>/claims/<row_key>.lock`,
which names its host and PID; a second process asking for the same row is told who runs it and skips it. The kernel
drops the lock when its holder exits or dies, so a claim left behind by a killed run is simply taken over."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import platform
from datetime import datetime
from pathlib import Path


class Claim:
    """An exclusive claim on one row (run key) of a results folder; see the module docstring.

    `Claim.acquire(results_dir, key)` -> a held Claim, or None when another live process holds it (`holder` then
    tells who). Use as a context manager or call `release()`."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    @staticmethod
    def holder(results_dir: Path, key: str) -> str:
        try:
            info = json.loads((Path(results_dir) / "claims" / f"{key}.lock").read_text() or "{}")
        except (OSError, ValueError):
            return "another process"
        return f"pid {info.get('pid')} on host {info.get('host')} (since {info.get('since')})"

    @classmethod
    def acquire(cls, results_dir: Path, key: str, run_dir: str | None = None) -> Claim | None:
        d = Path(results_dir) / "claims"
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"{key}.lock"
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EAGAIN, errno.EACCES):
                    return None
                raise
            # the holder before us may have released and unlinked the file between our open and our lock: then
            # we locked an orphaned inode, and must lock the file that is at the path now
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        info = {"host": platform.node(), "pid": os.getpid(), "since": datetime.now().isoformat(timespec="seconds")}
        claim = cls(path, fd)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(info).encode())
        except OSError:  # a full disk: give the claim back before saying so
            claim.release()
            raise
        return claim

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still locked: nobody can hold the claim we remove
        finally:
            os.close(self.fd)  # closing drops the lock
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
