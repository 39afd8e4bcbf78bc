"""Who owns the P2pShmConnector's files in `shm_dir`, so that an instance killed without
shutting down (SIGKILL, the OOM killer) leaves its files behind only briefly.

    <shm_dir>/pagedllm-kv-<owner_id>.lock                       held by the live owner
    <shm_dir>/pagedllm-kv-<owner_id>-<key>.r<rank>[.tmp<pid>]   its transfer files

Owners are producers (their files wait to be pulled; owner id = engine id) and consumers (a
pull hands the files over: the consumer renames them into its own name, owner id
`<producer engine id>-decode<pid>`, and deletes them after loading them). Each owner's engine
core holds an exclusive `flock` on its lock file for its lifetime. The kernel drops a flock
when its process dies, however it dies, so a lock that can be taken belongs to a dead owner:
no pid is compared, so a reused pid cannot fool the check. An owner creates its lock before any
file of its name exists and removes it last, after its files.

A starting owner (`ShmOwnership`) takes its own lock and then sweeps the folder, deleting:

- the files of its own owner id (a previous run's: same `kv_port`, same default id);
- the files of every owner id whose lock it can take, then that lock file;
- files whose owner id has no lock file at all.

While it runs, each owner sweeps again every `sweep_interval` seconds (`maybe_sweep`, from
its scheduler side's step), leaving its own files alone: the files a consumer pulled and never
loaded because it was killed go while its producer still runs. The files of a live owner are
never touched.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import time
from pathlib import Path

logger = logging.getLogger(__name__)

_PREFIX = "pagedllm-kv-"
# A transfer file (or its temporary name while written): engine id, 32-hex key, rank.
_TRANSFER_FILE = re.compile(r"pagedllm-kv-(.+)-[0-9a-f]{32}\.r\d+(\.tmp\d+)?")
_LOCK_FILE = re.compile(r"pagedllm-kv-(.+)\.lock")


def lock_file(shm_dir: Path, engine_id: str) -> Path:
    """The lock file of producer `engine_id`."""
    return shm_dir / f"{_PREFIX}{engine_id}.lock"


def _try_lock(path: Path, create: bool) -> int | None:
    """An open descriptor of `path` holding its exclusive flock, or None when another process
    holds it (or, without `create`, when there is no such file).

    NOTE(flock): the lock is taken on whatever inode `path` names at open; if the file was
    unlinked (its owner just shut down) or replaced in between, the lock guards nothing, so the
    inode is compared after locking and the attempt repeated.
    """
    while True:
        try:
            fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)
        if not create:
            return None


class ShmOwnership:
    """An owner's hold on its id in `shm_dir`; sweeps stale files at construction and, while
    it runs, every `sweep_interval` seconds (`maybe_sweep`).

    Args:
        shm_dir: the transfer folder.
        engine_id: this owner's id (a producer's engine id, or a consumer's owner id; already
            checked to be a safe name).
        sweep_interval: seconds between `maybe_sweep`'s sweeps.

    Raises:
        ValueError: `shm_dir` is not a folder, or a live owner holds `engine_id` there (two
            producers with one engine id would overwrite each other's files).
    """

    def __init__(self, shm_dir: Path, engine_id: str, sweep_interval: float = 60.0) -> None:
        if not shm_dir.is_dir():
            raise ValueError(f"P2pShmConnector: shm_dir {str(shm_dir)!r} is not a folder")
        self.shm_dir, self.engine_id = shm_dir, engine_id
        self._lock_path = lock_file(shm_dir, engine_id)
        fd = _try_lock(self._lock_path, create=True)
        if fd is None:
            raise ValueError(f"P2pShmConnector: a live producer already uses engine_id "
                             f"{engine_id!r} in {shm_dir} (give each producer its own "
                             f"engine_id or kv_port)")
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd: int | None = fd
        self.num_swept = sweep_stale_files(shm_dir, engine_id)
        if self.num_swept:
            logger.info("P2pShmConnector: removed %d stale transfer file(s) of stopped "
                        "instances from %s", self.num_swept, shm_dir)
        self.sweep_interval = sweep_interval
        self._last_sweep = time.monotonic()

    def maybe_sweep(self) -> int:
        """Every `sweep_interval` seconds: delete dead owners' files (never this owner's);
        returns how many."""
        now = time.monotonic()
        if self._fd is None or now - self._last_sweep < self.sweep_interval:
            return 0
        self._last_sweep = now
        removed = sweep_stale_files(self.shm_dir, self.engine_id, include_own=False)
        self.num_swept += removed
        if removed:
            logger.info("P2pShmConnector: removed %d transfer file(s) of stopped instances "
                        "from %s", removed, self.shm_dir)
        return removed

    def release(self) -> None:
        """Give up the engine id (at shutdown, after this producer's files are deleted)."""
        if self._fd is None:
            return
        self._lock_path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


def sweep_stale_files(shm_dir: Path, own_engine_id: str, include_own: bool = True) -> int:
    """Delete the transfer files in `shm_dir` of owners that are gone, and with `include_own`
    those of `own_engine_id` (whose lock the caller holds; see the module docstring); returns
    files deleted."""
    by_engine: dict[str, list[Path]] = {}
    locks: dict[str, Path] = {}
    for path in shm_dir.iterdir():
        if m := _TRANSFER_FILE.fullmatch(path.name):
            by_engine.setdefault(m[1], []).append(path)
        elif m := _LOCK_FILE.fullmatch(path.name):
            locks[m[1]] = path
    removed = 0
    for engine_id in set(by_engine) | set(locks):
        if engine_id == own_engine_id:
            if include_own:
                removed += _unlink_all(by_engine.get(engine_id, []))
            continue
        try:
            fd = _try_lock(lock_file(shm_dir, engine_id), create=False)
        except PermissionError:   # another user's producer: not ours to judge
            continue
        if fd is None:
            if not lock_file(shm_dir, engine_id).exists():
                # No lock: its owner shut down (deleting its files) or never had one.
                removed += _unlink_all(by_engine.get(engine_id, []))
            continue
        # Its owner is dead: its files, then its lock (while holding it).
        removed += _unlink_all(by_engine.get(engine_id, []))
        lock_file(shm_dir, engine_id).unlink(missing_ok=True)
        os.close(fd)
    return removed


def _unlink_all(paths: list[Path]) -> int:
    removed = 0
    for path in paths:
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed
