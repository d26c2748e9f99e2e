"""File-system helpers every vllm-hs module uses: the cache root, atomic writes of
files and directories, and file modes that follow the umask.

Atomic means: readers see the old content or the new content, never a partial
file; the temporary file or directory lives next to its target (same file
system, so the final step is one `os.replace` / `os.rename`) and is removed when
the write fails.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    """vllm-hs's cache: ``$VLLM_HS_CACHE``, else ``$XDG_CACHE_HOME/vllm-hs``, else
    ``~/.cache/vllm-hs``."""
    if os.environ.get("VLLM_HS_CACHE"):
        return Path(os.environ["VLLM_HS_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "vllm-hs"


@functools.cache
def umask() -> int:
    """The process umask (read once; Linux reports it in /proc without changing it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode `open(path, "w")` gives a new file: 0o666 less the umask."""
    return 0o666 & ~umask()


def dir_mode() -> int:
    """The mode `mkdir` would give a new directory: 0o777 less the umask."""
    return 0o777 & ~umask()


@contextlib.contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """Yield a temporary path next to `target` for the caller to create and
    write; on success give it the umask's mode (`file_mode`) and move it over
    `target`, else remove it.

    For writers that want a path (safetensors' `save_file`, `torch.save`). The
    path does not exist yet: nothing is spent creating it (extraction writes
    one file per sample). The mode is set explicitly because some writers
    create their file privately (safetensors writes a 0600 temporary file and
    renames it). The name is unique per process and thread:
    `.{name}.{pid}-{thread}.tmp`.
    """
    tmp = target.with_name(f".{target.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        yield tmp
        os.chmod(tmp, file_mode())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(target: Path, data: bytes) -> None:
    with atomic_path(target) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(target: Path, text: str) -> None:
    atomic_write_bytes(target, text.encode("utf-8"))


def atomic_write_json(target: Path, value: Any) -> None:
    """Pretty, key-sorted JSON with a final newline."""
    atomic_write_text(target, json.dumps(value, indent=1, sort_keys=True) + "\n")


def atomic_copy(source: Path, target: Path, *, link: bool = False) -> None:
    """Make `target` a copy of `source` (a hard link, sharing the source's mode,
    when `link` and the file system allows it), atomically."""
    if link:
        tmp = target.with_name(
            f".{target.name}.{os.getpid()}-{threading.get_ident()}.link"
        )
        tmp.unlink(missing_ok=True)
        try:
            os.link(source, tmp)
        except OSError:
            pass  # another file system, or no links: copy
        else:
            os.replace(tmp, target)
            return
    with atomic_path(target) as tmp:
        shutil.copyfile(source, tmp)


@contextlib.contextmanager
def staging_dir(parent: Path, name: str) -> Iterator[Path]:
    """A fresh directory in `parent` (umask mode) to build `name` in; removed on
    exit unless the caller has moved it away (see `publish_dir`)."""
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=parent))
    tmp.chmod(dir_mode())  # mkdtemp makes it 0700
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def publish_dir(tmp: Path, final: Path, *, complete: str | None = None) -> None:
    """Atomically move the finished directory `tmp` to `final`.

    If `final` exists and holds the file `complete` (the builder's completion
    marker), another process published first: keep theirs and leave `tmp` for
    the caller to remove. Any other existing `final` (a partial or foreign
    directory) is moved aside and replaced.
    """
    try:
        os.rename(tmp, final)
        return
    except OSError:
        if not final.exists():
            raise
    if complete is not None and (final / complete).is_file():
        return
    stale = Path(tempfile.mkdtemp(prefix=f".stale-{final.name}-", dir=final.parent))
    try:
        with contextlib.suppress(FileNotFoundError):
            os.rename(final, stale / "old")
        try:
            os.rename(tmp, final)
        except OSError:
            if complete is None or not (final / complete).is_file():
                raise
    finally:
        shutil.rmtree(stale, ignore_errors=True)
