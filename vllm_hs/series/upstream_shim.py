"""pytest plugin loaded into vLLM's own test runs by `vllm-hs upstream-tests`.

Offline, vLLM retries Hugging Face lookups that cannot succeed (for example
`try_get_safetensors_metadata`, an API call with no cache, or the config of a
model the offline hub does not hold), sleeping 2 s before giving up, for every
ModelConfig or tokenizer a test builds: ~2 s per scheduler test. This shim makes
`OfflineModeIsEnabled` a definitive answer for `with_retry`, and retries other
failures without sleeping (nothing can change offline), so such a lookup fails
at once with the same outcome.

vLLM's autouse `cleanup_fixture` calls `cleanup_dist_env_and_memory()` after every
test: `gc.unfreeze()` then a full `gc.collect()` over the ~640k objects that
importing vLLM and torch leaves, ~0.35-0.6 s per test here. The shim freezes that
heap once, after collection, and hands `cleanup_dist_env_and_memory` a `gc` whose
`unfreeze()` keeps that baseline frozen, so each cleanup's full collection walks
only what the test allocated. Garbage cycles among the baseline objects stay
uncollected (memory only). When something else unfroze the heap (an engine core
unfreezes at shutdown what it froze at start), the next cleanup's collection
freezes what survives it as the new baseline.

It changes nothing else, and it is loaded the same way into the unpatched and the
patched tree.

This file is copied next to the trees and loaded with `-p`; it must not import
vllm_hs.
"""

from __future__ import annotations

import gc
from types import ModuleType
from typing import Any


def pytest_configure(config: Any) -> None:
    try:
        from huggingface_hub.errors import OfflineModeIsEnabled
        from vllm.transformers_utils import config as config_utils
        from vllm.transformers_utils import repo_utils
    except ImportError:
        return
    original = repo_utils.with_retry

    def with_retry(func, log_msg, max_retries=2, retry_delay=2, fatal_errors=()):
        fatal = (*tuple(fatal_errors), OfflineModeIsEnabled)
        return original(func, log_msg, max_retries, 0, fatal)

    repo_utils.with_retry = with_retry
    if getattr(config_utils, "with_retry", None) is original:
        config_utils.with_retry = with_retry


class _FrozenBaselineGC:
    """`gc` for vLLM's per-test cleanup: collects only above a frozen baseline."""

    def __init__(self, module: ModuleType) -> None:
        self._gc = module
        self._baseline = module.get_freeze_count()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gc, name)

    def unfreeze(self) -> None:
        """Keeps the baseline frozen (see the module docstring)."""

    def collect(self, generation: int = 2) -> int:
        found = self._gc.collect(generation)
        # Someone else unfroze the heap (an engine core at shutdown): what
        # survived this full collection becomes the new baseline.
        if self._gc.get_freeze_count() < self._baseline // 2:
            self._gc.freeze()
            self._baseline = self._gc.get_freeze_count()
        return found


def pytest_collection_finish(session: Any) -> None:
    try:
        from vllm.distributed import parallel_state
    except ImportError:
        return
    if getattr(parallel_state, "gc", None) is not gc:
        return
    gc.collect()
    gc.freeze()
    parallel_state.gc = _FrozenBaselineGC(gc)


def pytest_unconfigure(config: Any) -> None:
    # Lets interpreter exit free the baseline as it would without the shim.
    gc.unfreeze()
