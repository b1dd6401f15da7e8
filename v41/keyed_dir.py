"""Keyed cache directories, shared by concurrent processes (pytest-xdist workers, a prebuild next
to a server): the compile cache (runtime/compile/cache.py) and the preset checkpoint cache
(v41/loader/load.py). Also the one source hasher their keys (and the pass manager's uuid) are
made of, and the default cache roots. A leaf: stdlib only.

`<root>/<key>/` is complete when its marker file exists; the marker is written last and
atomically (a temporary file renamed over it). Builders of one key serialize on an exclusive
`fcntl.flock` of `<root>/.<key>.lock`: the first builds, a second waits, then finds the marker
and reuses the directory. flock is stdlib (no dependency to declare), is per open file (two
threads of one process exclude each other too), and the kernel drops it when its holder exits,
so a builder that dies leaves no stale lock (only, for `build`, a temporary directory that the
next builder removes). Linux and macOS; v41 runs on nothing else.

Two ways to fill a directory:

* `build(write)`: `write(tmp)` fills `<root>/.<key>.tmp-<pid>`, which is renamed to
  `<root>/<key>` before the marker goes in: a reader never sees a partial directory
  (checkpoints).
* in place: `with d.lock(): ... d.mark_ready(info)`: for caches that must be written where they
  are read (Inductor's and Triton's caches live under the compile key directory from the start).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable

# cache kind -> (environment variable naming its root, subdirectory of ~/.cache/v41)
CACHE_ROOTS = {"compile": ("V41_COMPILE_CACHE", "compile"), "checkpoints": ("V41_CACHE", "checkpoints")}


def default_cache_root(kind: str) -> Path:
    """Root of a kind of cache: its environment variable, else ~/.cache/v41/<kind>."""
    env, sub = CACHE_ROOTS[kind]
    value = os.environ.get(env)
    return Path(value) if value else Path.home() / ".cache" / "v41" / sub


def hash_files(paths: Iterable, root=None, hasher=None, missing: bytes | None = None):
    """Feed files to `hasher` (default a fresh sha256), sorted by path: each one's path relative
    to `root` when a root is given, then its bytes (`missing` for a file that does not exist,
    when given; else the read fails). Returns the hasher (`.hexdigest()` for a key)."""
    h = hasher if hasher is not None else hashlib.sha256()
    for p in sorted(Path(p) for p in paths):
        if root is not None:
            h.update(str(p.relative_to(root)).encode())
        if missing is not None and not p.exists():
            h.update(missing)
        else:
            h.update(p.read_bytes())
    return h


class KeyedDir:
    """`<root>/<key>/`, complete once `<root>/<key>/<marker>` exists (see the module docstring)."""

    def __init__(self, root, key: str, marker: str = "READY"):
        self.root, self.key = Path(root), key
        self.path = self.root / key
        self.marker = self.path / marker
        self.lock_file = self.root / f".{key}.lock"

    @property
    def ready(self) -> bool:
        return self.marker.exists()

    @contextlib.contextmanager
    def lock(self, blocking: bool = True):
        """Hold the key's exclusive lock. `blocking=False`: raise BlockingIOError at once when
        another holder has it."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.lock_file, "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:
                yield self
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def mark_ready(self, info: dict | None = None) -> None:
        """Write the marker (JSON `info`) atomically: the directory is complete."""
        tmp = self.marker.with_name(f".{self.marker.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(info if info is not None else {}, indent=1, default=str) + "\n")
        tmp.replace(self.marker)

    def build(self, write: Callable[[Path], object], info: dict | None = None) -> Path:
        """The complete directory: as found, or written once by `write(tmp)` under the lock into a
        temporary directory renamed into place, then marked."""
        if self.ready:
            return self.path
        with self.lock():
            if self.ready:                              # another builder finished while we waited
                return self.path
            if self.path.exists():                      # a rename whose marker never came
                shutil.rmtree(self.path)
            for stale in self.root.glob(f".{self.key}.tmp-*"):      # left by a builder that died
                shutil.rmtree(stale, ignore_errors=True)
            tmp = self.root / f".{self.key}.tmp-{os.getpid()}"
            write(tmp)
            tmp.rename(self.path)
            self.mark_ready(info)
        return self.path
