"""Tests of vllm_hs.fs: the cache root, atomic writes and umask-following modes."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_hs import fs


@pytest.fixture
def umask_027() -> Iterator[None]:
    """Run with umask 027 (group read, others nothing): a mode that is neither
    the temporary-file default 0600 nor the usual 0644."""
    previous = os.umask(0o027)
    fs.umask.cache_clear()
    try:
        yield
    finally:
        os.umask(previous)
        fs.umask.cache_clear()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_cache_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("VLLM_HS_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert fs.cache_root() == tmp_path / "home" / ".cache" / "vllm-hs"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert fs.cache_root() == tmp_path / "xdg" / "vllm-hs"
    monkeypatch.setenv("VLLM_HS_CACHE", str(tmp_path / "own"))
    assert fs.cache_root() == tmp_path / "own"


def test_atomic_writes_follow_the_umask(tmp_path: Path, umask_027: None) -> None:
    text, blob, doc = tmp_path / "a.txt", tmp_path / "b.bin", tmp_path / "c.json"
    fs.atomic_write_text(text, "x")
    fs.atomic_write_bytes(blob, b"\0\1")
    fs.atomic_write_json(doc, {"b": 1, "a": [2]})
    with fs.atomic_path(tmp_path / "d.bin") as tmp:
        tmp.write_bytes(b"d")
    fs.atomic_copy(blob, tmp_path / "e.bin", link=False)
    with fs.atomic_path(tmp_path / "f.bin") as tmp:
        # A writer that creates its file privately, as safetensors does.
        os.close(os.open(tmp, os.O_CREAT | os.O_WRONLY, 0o600))
    plain = tmp_path / "plain"
    plain.write_text("reference")  # what open() gives under this umask
    for path in (text, blob, doc, *(tmp_path / f"{n}.bin" for n in "def")):
        assert mode(path) == mode(plain) == 0o640, path
    assert doc.read_text() == '{\n "a": [\n  2\n ],\n "b": 1\n}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a.txt", "b.bin", "c.json", "d.bin", "e.bin", "f.bin", "plain",
    ]  # fmt: skip


def test_atomic_path_keeps_the_old_file_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "t"
    target.write_text("old")
    with pytest.raises(RuntimeError), fs.atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("writer failed")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["t"]


def test_atomic_copy_links_when_asked(tmp_path: Path) -> None:
    source = tmp_path / "s"
    source.write_text("data")
    fs.atomic_copy(source, tmp_path / "linked", link=True)
    assert (tmp_path / "linked").stat().st_ino == source.stat().st_ino
    fs.atomic_copy(source, tmp_path / "copied")
    assert (tmp_path / "copied").stat().st_ino != source.stat().st_ino
    assert (tmp_path / "copied").read_text() == "data"


def test_staging_and_publish(tmp_path: Path, umask_027: None) -> None:
    final = tmp_path / "out" / "model"
    with fs.staging_dir(final.parent, final.name) as tmp:
        assert mode(tmp) == 0o750
        (tmp / "done").write_text("1")
        fs.publish_dir(tmp, final, complete="done")
    assert (final / "done").read_text() == "1"
    # A rival that publishes second keeps the complete directory it finds.
    with fs.staging_dir(final.parent, final.name) as tmp:
        (tmp / "done").write_text("2")
        fs.publish_dir(tmp, final, complete="done")
    assert (final / "done").read_text() == "1"
    # An incomplete directory (no marker) is replaced.
    (final / "done").unlink()
    with fs.staging_dir(final.parent, final.name) as tmp:
        (tmp / "done").write_text("3")
        fs.publish_dir(tmp, final, complete="done")
    assert (final / "done").read_text() == "3"
    assert [p.name for p in final.parent.iterdir()] == ["model"]  # no leftovers
