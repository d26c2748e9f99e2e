"""vLLM's source release (the PyPI sdist): find it on the package index, fetch, unpack.

The index is read with the simple repository API (PEP 691 JSON, else PEP 503 HTML)
at $VLLM_HS_INDEX_URL, else $PIP_INDEX_URL, else https://pypi.org/simple. The file's
sha256 from the index is checked; downloads are cached under $VLLM_HS_CACHE/sdists.
No build step runs: `pip download` would build the sdist's metadata, which for vLLM
means its CMake build.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tarfile
import urllib.error
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

from vllm_hs.errors import VllmHsError
from vllm_hs.fs import atomic_path, atomic_write_text, cache_root, staging_dir
from vllm_hs.series.model import sha256_file, version_sort_key

logger = logging.getLogger(__name__)

DEFAULT_INDEX_URL = "https://pypi.org/simple"
PROJECT = "vllm"
_JSON_ACCEPT = "application/vnd.pypi.simple.v1+json"


def index_url() -> str:
    for variable in ("VLLM_HS_INDEX_URL", "PIP_INDEX_URL"):
        if os.environ.get(variable):
            return os.environ[variable].rstrip("/")
    return DEFAULT_INDEX_URL


def sdist_filename(version: str) -> str:
    return f"{PROJECT}-{version}.tar.gz"


def fetch_sdist(version: str, cache_dir: Path | None = None) -> Path:
    """The sdist of vLLM `version` from the cache, downloading it if needed."""
    cache_dir = cache_dir or cache_root() / "sdists"
    filename = sdist_filename(version)
    target = cache_dir / filename
    checksum_file = target.with_name(filename + ".sha256")
    if target.is_file() and checksum_file.is_file():
        if sha256_file(target) == checksum_file.read_text().strip():
            return target
    url, expected = _find_on_index(version)
    cache_dir.mkdir(parents=True, exist_ok=True)
    logger.info("fetching %s", url)
    digest = hashlib.sha256()
    try:
        with atomic_path(target) as partial:  # removed unless complete and checked
            with urllib.request.urlopen(url, timeout=120) as response:
                with partial.open("wb") as stream:
                    for block in iter(lambda: response.read(1 << 20), b""):
                        digest.update(block)
                        stream.write(block)
            if expected and digest.hexdigest() != expected:
                raise VllmHsError(
                    f"{url}: sha256 {digest.hexdigest()} does not match the index's "
                    f"{expected}"
                )
    except (urllib.error.URLError, OSError) as error:
        raise VllmHsError(f"downloading {url} failed: {error}") from None
    atomic_write_text(checksum_file, digest.hexdigest() + "\n")
    return target


def unpack_sdist(archive: Path, dest: Path) -> Path:
    """Unpack the sdist's single top-level folder as `dest` (which must not exist)."""
    if dest.exists():
        raise VllmHsError(f"{dest} already exists")
    # The scratch folder (next to dest) is removed also when unpacking fails.
    with staging_dir(dest.parent, dest.name) as scratch:
        try:
            with tarfile.open(archive) as tar:
                # The "data" filter refuses links out of the tree and absolute
                # paths and does not restore the archive's owners (a root-owned
                # checkout, as git wants).
                tar.extractall(scratch, filter="data")
        except (tarfile.TarError, OSError) as e:
            reason = str(e).splitlines()[0].rstrip(":")
            raise VllmHsError(f"{archive}: not an sdist to unpack ({reason})") from None
        entries = list(scratch.iterdir())
        if len(entries) != 1 or not entries[0].is_dir():
            raise VllmHsError(f"{archive} does not hold one top-level folder")
        entries[0].rename(dest)
    return dest


def released_versions(timeout: float = 60) -> list[str]:
    """The final releases of vLLM with an sdist on the index, oldest first."""
    _, files = _index_files(timeout)
    versions = {
        match.group(1)
        for name, _, _ in files
        if (match := re.fullmatch(rf"{PROJECT}-(\d+(?:\.\d+)*)\.tar\.gz", name))
    }
    return sorted(versions, key=version_sort_key)


def _find_on_index(version: str) -> tuple[str, str | None]:
    """(download URL, sha256 or None) of the sdist of `version` on the index."""
    filename = sdist_filename(version)
    page_url, files = _index_files()
    for name, url, sha256 in files:
        if name == filename:
            return url, sha256
    raise VllmHsError(
        f"{filename} is not on {page_url} (is {version} a released vLLM version?)"
    )


def _index_files(timeout: float = 60) -> tuple[str, list[tuple[str, str, str | None]]]:
    """(the project page's URL, its files: (name, absolute URL, sha256 or None))."""
    page_url = f"{index_url()}/{PROJECT}/"
    if page_url.startswith("file:"):
        page_url += "index.html"
    request = urllib.request.Request(
        page_url, headers={"Accept": f"{_JSON_ACCEPT}, text/html;q=0.1"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            content_type = response.headers.get("Content-Type", "")
            body = response.read()
            final_url = response.geturl()
    except (urllib.error.URLError, OSError) as error:
        message = f"reading the package index {page_url} failed: {error}"
        raise VllmHsError(message) from None
    if "json" in content_type:
        files = [
            (entry["filename"], entry["url"], entry.get("hashes", {}).get("sha256"))
            for entry in json.loads(body)["files"]
        ]
    else:
        files = _LinkParser.files(body.decode("utf-8", errors="replace"))
    return page_url, [
        (name, urllib.parse.urljoin(final_url, url), sha256)
        for name, url, sha256 in files
    ]


class _LinkParser(HTMLParser):
    """PEP 503 page: <a href="url#sha256=...">filename</a>."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str, str | None]] = []
        self._href: str | None = None

    @classmethod
    def files(cls, html: str) -> list[tuple[str, str, str | None]]:
        parser = cls()
        parser.feed(html)
        return parser.links

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data: str) -> None:
        if self._href is not None and data.strip():
            url, _, fragment = self._href.partition("#")
            match = re.fullmatch(r"sha256=([0-9a-f]{64})", fragment)
            self.links.append((data.strip(), url, match.group(1) if match else None))
            self._href = None
