"""pytest plugin loaded into vLLM's own test runs by `vllm-hs upstream-tests`.

Offline, vLLM retries Hugging Face lookups that cannot succeed (for example
`try_get_safetensors_metadata`, an API call with no cache), sleeping 2 s before
giving up, for every ModelConfig a test builds: ~2 s per scheduler test. This
shim makes `OfflineModeIsEnabled` a definitive answer for `with_retry`, so such a
lookup fails at once with the same outcome. It changes nothing else, and it is
loaded the same way into the unpatched and the patched tree.

This file is copied next to the trees and loaded with `-p`; it must not import
vllm_hs.
"""

from __future__ import annotations

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
        return original(func, log_msg, max_retries, retry_delay, fatal)

    repo_utils.with_retry = with_retry
    if getattr(config_utils, "with_retry", None) is original:
        config_utils.with_retry = with_retry
