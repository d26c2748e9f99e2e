"""vllm-hs upstream-tests: vLLM's own unit tests pass on the patched trees as unpatched.

This is the CI check of the oldest and the newest series against upstream's
tests (for 0.34.0, which has no CPU build, the only run of its code here), on a
quick subset: the tests of what a series adds or fixes, and AuxOutput's own.
The negative control proves the comparison can fail: a series that breaks
SamplingParams must show regressions.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vllm_hs.series.model import available_versions
from vllm_hs.series.refresh import refresh
from vllm_hs.series.stage import stage
from vllm_hs.series.upstream_tests import Outcome, compare, listed_tests

SERIES_ROOT = Path(__file__).resolve().parents[2] / "patches"


VERSIONS = available_versions(SERIES_ROOT)
NEWEST = VERSIONS[-1]
# CI time: a quick subset of each series' listed group, the tests of what the
# series adds or fixes and AuxOutput's own. The whole group (and --extended) is
# patches/v<X>/UPSTREAM-TESTS.md, regenerated whenever the series changes.
QUICK = [
    # The fixes' and the backport's regression tests (each fails without it).
    "tests/entrypoints/cli/test_version.py",
    "tests/v1/kv_connector/unit/test_hidden_states_connector_cpu.py",
    "tests/model_executor/test_aux_hidden_state_layer0.py",
    "tests/v1/engine/test_sync_client_output_thread_shutdown.py",
    "tests/multimodal/media/test_local_file_url.py",
    "tests/multimodal/media/test_unreadable_local_file.py",
    "tests/v1/core/test_max_cache_hit_length.py",
    "tests/test_outputs.py",
    "tests/v1/test_serial_utils.py",
    "tests/v1/hidden_states/test_positions.py",
    "tests/v1/hidden_states/test_buffer.py",
    "tests/distributed/aux_output_connector/test_hidden_states.py",
    # AuxOutput's own tests: routed experts behave as before.
    "tests/distributed/aux_output_connector/test_store.py",
    "tests/config/test_aux_output_config.py",
    "tests/model_executor/test_routed_experts_capture.py",
    "tests/v1/core/test_aux_output_cache_hit.py",
    "tests/v1/core/test_output.py",
    "tests/v1/engine/test_parallel_sampling.py",
    "tests/v1/kv_connector/unit/test_hidden_states_connector.py",
    "tests/entrypoints/openai/completion/test_completion_error.py",
    "tests/entrypoints/openai/test_hidden_states_refs.py",
    "tests/model_executor/test_triton_dispatcher.py",
    # The torch kernels of Model Runner V2 on CPU (v0.32.0): every engine test
    # runs them; here only their registration (the kernel-by-kernel comparison
    # with Triton's interpreter is in UPSTREAM-TESTS.md).
    "tests/v1/worker/cpu_kernels/test_registration.py",
]


# CI time: the CPU test base and the newest series; the others' runs are their
# UPSTREAM-TESTS.md (regenerated when their series changes).
@pytest.mark.parametrize("version", sorted({VERSIONS[0], NEWEST}))
def test_no_upstream_test_regresses(version: str, sdist, tmp_path: Path) -> None:
    listed = listed_tests(SERIES_ROOT, version)
    tests = [t for t in QUICK if t in listed]
    comparison = compare(
        version,
        series_root=SERIES_ROOT,
        sdist=sdist[version],
        tests=tests,
        keep=tmp_path / "w",
    )
    assert comparison.regressions == [], comparison.report()
    assert comparison.new_failures == [], comparison.report()
    # The runs were real: every listed file ran tests that pass on both trees.
    for test_file in tests:
        ran = [
            test
            for test, outcome in comparison.patched.outcomes.items()
            if test.startswith(test_file + "::") and outcome is Outcome.PASSED
        ]
        assert ran, f"no test of {test_file} passed patched:\n{comparison.report()}"
    # ... and the patched tree really held the series.
    assert (tmp_path / "w/patched/vllm/v1/hidden_states/params.py").is_file()
    assert not (tmp_path / "w/unpatched/vllm/v1/hidden_states").exists()


def test_a_breaking_series_shows_regressions(tmp_path: Path, sdist) -> None:
    staged = stage(
        "0.32.0",
        dest=tmp_path / "broken",
        sdist=sdist["0.32.0"],
        series_root=SERIES_ROOT,
    )
    tree = staged.repo.path
    params = tree / "vllm/sampling_params.py"
    hook = (
        "    def __post_init__(self) -> None:\n"
        "        if 0 < self.temperature < _MAX_TEMP:"
    )
    text = params.read_text()
    assert text.count(hook) == 1
    broken = hook.replace(
        ":\n", ":\n        raise ValueError('deliberately broken')\n", 1
    )
    params.write_text(text.replace(hook, broken))
    message = "[Core] Break SamplingParams\n\nA negative control."
    staged.repo.git("commit", "-q", "-a", "-m", message)
    root = tmp_path / "patches"
    shutil.copytree(SERIES_ROOT / "v0.32.0", root / "v0.32.0")
    refresh(tree, series_root=root)

    comparison = compare(
        "0.32.0",
        series_root=root,
        sdist=sdist["0.32.0"],
        tests=["tests/test_sampling_params.py"],
    )
    assert comparison.regressions, comparison.report()
    assert all(
        t.startswith("tests/test_sampling_params.py::") for t in comparison.regressions
    )
    assert "Regressions (pass unpatched, not patched): 0" not in comparison.report()


def test_a_tree_without_the_asked_files_runs_nothing(tmp_path: Path) -> None:
    """Files only the series adds: the unpatched tree runs no pytest at all
    (pytest given no path would collect vLLM's whole suite)."""
    from vllm_hs.series.upstream_tests import _run_pytest

    run = _run_pytest("unpatched", tmp_path / "no-tree", [], tmp_path, tmp_path, 1)
    assert run.name == "unpatched" and run.outcomes == {} and run.exit_code == 0
    assert not (tmp_path / "unpatched.xml").exists()
