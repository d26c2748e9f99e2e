"""The worker probe: a vLLM worker extension that tests load by name
(``worker_extension_cls="vllm_hs_testing.ChannelStateProbe"``) into every
worker process, in-process or not, and into test servers
(``--worker-extension-cls``). Nothing here imports vLLM at module level."""

from __future__ import annotations

from typing import Any


class ChannelStateProbe:
    """A vLLM worker extension for tests (``worker_extension_cls=
    "vllm_hs_testing.ChannelStateProbe"``): what the worker side of the channel
    still holds, through ``collective_rpc("hidden_states_request_ids")`` (or the
    server's dev-mode ``/collective_rpc``), and which model runner the worker
    runs (``collective_rpc("model_runner_kind")``)."""

    model_runner: Any  # set by vLLM's worker

    def model_runner_kind(self) -> str:
        """Which model runner this worker runs: "v2" or "v1"."""
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as ModelRunnerV2

        return "v2" if isinstance(self.model_runner, ModelRunnerV2) else "v1"

    def hidden_states_request_ids(self) -> list[str]:
        connector = getattr(self.model_runner, "aux_output_connector", None)
        worker = getattr(connector, "hidden_states", None)
        return [] if worker is None else sorted(worker.request_ids)
