"""The package's declared shape: subpackages listed for setuptools, every
third-party import declared as a dependency, product code apart from test
support (the vllm-hs-testing distribution in testing/, never in the vllm-hs
wheel), and a command line that starts without torch or vLLM."""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "vllm_hs"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
TESTING = REPO / "testing"
TEST_SUPPORT = "vllm_hs_testing"

# Chosen by the user, never declared (see pyproject.toml): vLLM's flavour, and
# what comes with it (its torch build; huggingface_hub, which only the pytest
# plugin loaded into vLLM's own test runs imports).
USER_CHOSEN = {"vllm", "torch", "huggingface_hub"}


def product_modules() -> list[Path]:
    """vllm_hs's modules (the data generator aside)."""
    return [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "make_conversations.py"  # data generator, run by hand
    ]


def imported_modules(path: Path) -> set[str]:
    """Absolute imports anywhere in the file (also inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def declared(extras: tuple[str, ...]) -> set[str]:
    project = PYPROJECT["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def packages_found(root: Path, package: str) -> set[str]:
    """Dotted names of `package` (a folder under `root`) and its subpackages."""
    return {
        ".".join(init.parent.relative_to(root).parts)
        for init in (root / package).rglob("__init__.py")
    }


def test_every_subpackage_is_listed() -> None:
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = packages_found(REPO, "vllm_hs")
    assert found <= listed, f"not in pyproject's packages: {sorted(found - listed)}"


def test_test_support_is_its_own_distribution() -> None:
    """vllm_hs_testing is listed by testing/pyproject.toml, and the vllm-hs
    wheel ships no test support."""
    shipped = PYPROJECT["tool"]["setuptools"]["packages"]
    assert not [p for p in shipped if p.startswith(("vllm_hs.testing", TEST_SUPPORT))]
    testing = tomllib.loads((TESTING / "pyproject.toml").read_text())
    assert testing["project"]["name"] == "vllm-hs-testing"
    listed = set(testing["tool"]["setuptools"]["packages"])
    found = packages_found(TESTING, TEST_SUPPORT)
    assert found == listed, f"testing/pyproject.toml lists {sorted(listed)}"


def test_every_third_party_import_is_declared() -> None:
    distributions = importlib.metadata.packages_distributions()
    allowed = declared(("extract", "speculators"))
    missing = {}
    for path in product_modules():
        for module in imported_modules(path):
            top = module.split(".")[0]
            if top in sys.stdlib_module_names or top == "vllm_hs":
                continue
            if top in USER_CHOSEN:
                continue
            names = {canonicalize_name(d) for d in distributions.get(top, [top])}
            if not names & allowed:
                missing.setdefault(top, []).append(str(path.relative_to(REPO)))
    assert not missing, f"imports not declared in pyproject.toml: {missing}"


def test_product_code_never_imports_test_support() -> None:
    offenders = [
        str(path.relative_to(REPO))
        for path in product_modules()
        if any(m.split(".")[0] == TEST_SUPPORT for m in imported_modules(path))
    ]
    assert not offenders


def test_help_imports_neither_torch_nor_vllm() -> None:
    """Every subcommand module is imported to build `vllm-hs --help`: heavy
    imports belong inside the commands."""
    code = (
        "import sys\n"
        "from vllm_hs.cli import build_parser\n"
        "build_parser().format_help()\n"
        "print(sorted(m for m in ('torch', 'vllm', 'transformers', 'datasets')"
        " if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout


def test_test_module_basenames_are_unique() -> None:
    """tests/ has no __init__.py files: pytest imports test modules by
    basename, and two with the same name fail the whole collection (CI exit
    2), which a run of one directory never shows."""
    seen: dict[str, Path] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        other = seen.setdefault(path.name, path)
        assert other == path, f"{path} and {other} share a basename"
