"""vllm-hs lint: the shipped series are clean; each kind of defect is caught."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import pytest

from vllm_hs.cli import main
from vllm_hs.series.git import Repo
from vllm_hs.series.lint import header_problems, lint_series, mypy_problems
from vllm_hs.series.model import available_versions, load_series

SERIES_ROOT = Path(__file__).resolve().parents[2] / "patches"
VERSIONS = available_versions(SERIES_ROOT)


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One mypy cache for the versions, as `vllm-hs lint` shares it (torch and
    transformers are checked once: about 90 s, then about 25 s a version)."""
    return tmp_path_factory.mktemp("mypy-cache")


@pytest.mark.parametrize("version", VERSIONS)
def test_shipped_series_is_clean(version: str, sdist, mypy_cache: Path) -> None:
    """For 0.33.0 and 0.34.0 this is the CI check: applies, compiles, passes
    vLLM's ruff and mypy (on the Python files the series adds)."""
    findings = lint_series(
        version, series_root=SERIES_ROOT, sdist=sdist[version], mypy_cache=mypy_cache
    )
    assert [str(finding) for finding in findings] == []


def _edit(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert text.count(old) >= count, (path.name, old)
    path.write_text(text.replace(old, new, count))


def _patch_with(directory: Path, text: str, last: bool = False) -> Path:
    """The (first, or last) patch of the series whose text contains `text`."""
    patches = [p for p in sorted(directory.glob("*.patch")) if text in p.read_text()]
    assert patches, text
    return patches[-1 if last else 0]


def test_each_defect_is_reported(tmp_path: Path, sdist, capsys) -> None:
    root = tmp_path / "patches"
    shutil.copytree(SERIES_ROOT / "v0.32.0", root / "v0.32.0")
    directory = root / "v0.32.0"
    params = sorted(directory.glob("*.patch"))[0]  # left as it is
    config = _patch_with(directory, "+            verify_hidden_states_config(self)\n")
    # The last patch that changes vllm/v1/hidden_states/output.py's imports (no
    # later patch touches the file, so an added line moves no other hunk).
    imports = "+from vllm.utils import length_from_prompt_token_ids_or_embeds\n"
    positions = _patch_with(directory, imports, last=True)
    client = _patch_with(directory, "vllm/v1/engine/core_client.py")
    assert len({params, config, client}) == 3
    # The config hook's patch: a header field gone, a sign-off (the series
    # carries none), and an added line that no longer compiles.
    _edit(
        config, "Upstream-Status: Pending\n", "Signed-off-by: A <a@example.invalid>\n"
    )
    _edit(
        config,
        "+            verify_hidden_states_config(self)\n",
        "+            verify_hidden_states_config(self))\n",
    )
    # That patch: an added import that is never used (F401 under vLLM's ruff
    # config).
    _edit(positions, imports, "+import os\n" + imports)
    _fix_hunk_counts(positions)
    # Another patch: the hunks moved by a few lines (applies only with an offset).
    text = client.read_text()
    moved = re.sub(
        r"^@@ -(\d+),(\d+) \+(\d+),(\d+) @@",
        lambda m: (
            m[0]
            if m[1] == "0"  # a new file's hunk stays
            else f"@@ -{int(m[1]) + 3},{m[2]} +{int(m[3]) + 3},{m[4]} @@"
        ),
        text,
        flags=re.MULTILINE,
    )
    assert moved != text
    # ... and an Upstream-PR value lint does not know.
    client.write_text(moved.replace("Upstream-PR: separate", "Upstream-PR: x", 1))
    # A patch file the series does not list.
    (directory / "0099-stray.patch").write_text(params.read_text())

    findings = [
        str(f) for f in lint_series("0.32.0", series_root=root, sdist=sdist["0.32.0"])
    ]

    def found(patch: Path | str, check: str, text: str) -> bool:
        name = patch if isinstance(patch, str) else patch.name
        return any(
            f.startswith(f"v0.32.0 {name}: [{check}]") and text in f for f in findings
        )

    assert found(config, "header", "no 'Upstream-Status:' field"), findings
    assert found(config, "header", "a 'Signed-off-by:' trailer"), findings
    assert found(client, "header", "Upstream-PR 'x'"), findings
    assert found(config, "compile", "vllm/config/vllm.py"), findings
    assert found(client, "offset", "other line numbers"), findings
    assert found("0099-stray.patch", "series", "not listed"), findings
    assert found("series", "ruff", "F401"), findings
    # A tree that does not compile is not type-checked (mypy stops at it).
    assert not any("[mypy]" in f for f in findings), findings
    assert not any("[header]" in f for f in findings if params.name in f)

    assert (
        main(
            [
                "lint",
                "--version",
                "0.32.0",
                "--series-dir",
                str(root),
                "--sdist",
                str(sdist["0.32.0"]),
            ]
        )
        == 1
    )
    assert "problem(s)" in capsys.readouterr().out


def _fix_hunk_counts(path: Path) -> None:
    """Recount the +side line counts of every hunk after lines were added."""
    lines = path.read_text().split("\n")
    out, index = [], 0
    while index < len(lines):
        line = lines[index]
        match = re.match(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(.*)$", line)
        if not match:
            out.append(line)
            index += 1
            continue
        body = []
        index += 1
        while index < len(lines) and lines[index][:1] in ("+", "-", " ", "\\"):
            if lines[index].startswith(("+++", "---")) and body:
                break
            body.append(lines[index])
            index += 1
        old = sum(1 for b in body if b[:1] in ("-", " "))
        new = sum(1 for b in body if b[:1] in ("+", " "))
        out.append(f"@@ -{match[1]},{old} +{match[3]},{new} @@{match[5]}")
        out.extend(body)
    path.write_text("\n".join(out))


def test_mypy_reports_errors_in_the_modules_the_series_adds(tmp_path: Path) -> None:
    """mypy with the tree's configuration: an error in a file the commits
    add (a module or a test) is reported with its place; one in a file they
    only change is not (vLLM's own files have errors of their own), nor is a
    clean new module."""
    repo = Repo.init(tmp_path / "tree")
    (repo.path / "pyproject.toml").write_text(
        "[tool.mypy]\ncheck_untyped_defs = true\n"
    )
    (repo.path / "vllm").mkdir()
    (repo.path / "vllm" / "__init__.py").write_text("")
    (repo.path / "vllm" / "old.py").write_text("A: int = 1\n")
    repo.git("add", "-A")
    repo.git("commit", "-q", "-m", "base")
    base = repo.git("rev-parse", "HEAD").strip()
    (repo.path / "vllm" / "old.py").write_text('A: int = 1\nB: int = "b"\n')
    (repo.path / "vllm" / "clean.py").write_text("from vllm.old import A\n\nC = A\n")
    (repo.path / "vllm" / "new.py").write_text("def f(x: int) -> str:\n    return x\n")
    (repo.path / "tests").mkdir()
    (repo.path / "tests" / "test_new.py").write_text(
        "from vllm.new import f\n\nY: str = f(1) + 1\n"
    )
    repo.git("add", "-A")
    repo.git("commit", "-q", "-m", "series")
    problems = mypy_problems(repo, base)
    tests_error, module_error = sorted(problems)
    assert tests_error.startswith("tests/test_new.py:3: Unsupported operand types")
    assert module_error.startswith("vllm/new.py:2: Incompatible return value type")

    # A cache shared between trees (as `vllm-hs lint` shares it between
    # versions) hides nothing: the same errors again, and those of another
    # tree with the same module names.
    cache = tmp_path / "mypy-cache"
    assert sorted(mypy_problems(repo, base, cache)) == sorted(problems)
    assert sorted(mypy_problems(repo, base, cache)) == sorted(problems)
    other = Repo.init(tmp_path / "other")
    (other.path / "vllm").mkdir()
    for name in ("pyproject.toml", "vllm/__init__.py", "vllm/old.py"):
        shutil.copy(repo.path / name, other.path / name)
    other.git("add", "-A")
    other.git("commit", "-q", "-m", "base")
    other_base = other.git("rev-parse", "HEAD").strip()
    (other.path / "vllm" / "new.py").write_text(
        "def f(x: int) -> str:\n    return str(x)\n\n\nZ: int = f(2)\n"
    )
    other.git("add", "-A")
    other.git("commit", "-q", "-m", "series")
    (moved,) = mypy_problems(other, other_base, cache)
    assert moved.startswith("vllm/new.py:5: Incompatible types in assignment")


def test_a_backport_names_the_release_it_comes_from() -> None:
    series = load_series(SERIES_ROOT, "0.32.0")
    backports = [
        p for p in series.patches if p.headers["Upstream-Status"].startswith("Backport")
    ]
    assert backports, "v0.32.0 carries a backport"
    patch = backports[0]
    assert header_problems(patch, "0.32.0") == []
    for status in ("Backport", "Backport 0.34.0", "Backport vLLM next"):
        headers = {**patch.headers, "Upstream-Status": status}
        bad = dataclasses.replace(patch, headers=headers)
        assert any("Upstream-Status" in p for p in header_problems(bad, "0.32.0")), (
            status
        )
