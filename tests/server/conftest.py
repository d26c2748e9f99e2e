"""Fixtures for tests that start real `vllm serve` processes (patched install).

A server takes ~30-60 s to start on 2 CPU cores, so servers are session-scoped
and shared by every module of tests/server: `hs_server` (with
--hidden-states-config) and `plain_server` (without, for the 400 test). When a
collected test needs `plain_server`, it is launched together with `hs_server`
so that both start in parallel; both are stopped (process group) at the end.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_hs.patched_vllm import skip_reason
from vllm_hs_testing import expected_model_runner

SKIP_REASON = skip_reason()

from vllm_hs_testing.server import (  # noqa: E402
    HS_CONFIG,
    REFS_API_KEY,
    REFS_MAX_BYTES,
    REFS_TTL_S,
    ServerProcess,
)

# The server speculators' online training reads (vllm_hs.client.speculators_online):
# the layers `vllm-hs extract` writes for the tiny model, answered in
# kv_transfer_params.
ONLINE_CONFIG = {"layers": [1, 2, 3, 4], "respond_in_kv_transfer_params": True}
#: The "spec" server: HS_CONFIG with ngram speculative decoding (Model Runner V1).
SPEC_ARGS = (
    "--speculative-config",
    '{"method": "ngram", "num_speculative_tokens": 3, '
    '"prompt_lookup_min": 1, "prompt_lookup_max": 3}',
)
from vllm_hs.models.tiny import build_tiny_model  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "server: starts a real (patched) vLLM OpenAI-compatible server"
    )


def _is_server_test(item: pytest.Item) -> bool:
    return item.nodeid.startswith("tests/server/")


_LAST_SERVER_TEST: list[str] = []  # node id of the last server test to run
_LAUNCHED: list[_Servers] = []


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    server_tests = [item for item in items if _is_server_test(item)]
    for item in server_tests:
        item.add_marker(pytest.mark.server)
        if SKIP_REASON:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))
    _LAST_SERVER_TEST[:] = [server_tests[-1].nodeid] if server_tests else []


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the servers after the last server test, not at the end of the
    session: the tests collected after tests/server get the cores and memory."""
    if _LAST_SERVER_TEST and item.nodeid == _LAST_SERVER_TEST[0]:
        for servers in _LAUNCHED:
            servers.stop_all()


@pytest.fixture(scope="session")
def model_dir() -> str:
    return str(build_tiny_model("llama", "float32"))


class _Servers:
    """Lazily launched servers of the session, by name."""

    def __init__(self, model_dir: str, log_dir: Path) -> None:
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.servers: dict[str, ServerProcess] = {}

    def launch(self, name: str) -> ServerProcess:
        server = self.servers.get(name)
        if server is None:
            config = {
                "hs": HS_CONFIG,
                "online": ONLINE_CONFIG,
                "spec": HS_CONFIG,
                "refs": HS_CONFIG,
            }.get(name)
            # The worker probe answers the dev-mode /collective_rpc route.
            probe = ["--worker-extension-cls", "vllm_hs_testing.ChannelStateProbe"]
            refs = (
                *("--hidden-states-ref-ttl", str(REFS_TTL_S)),
                *("--hidden-states-ref-max-bytes", str(REFS_MAX_BYTES)),
                *("--api-key", REFS_API_KEY),
                # Two API server processes: a reference made by one is
                # answered by either.
                *("--api-server-count", "2"),
            )
            extra = {"hs": probe, "spec": SPEC_ARGS, "refs": refs}.get(name, ())
            server = ServerProcess(
                self.model_dir,
                self.log_dir / f"vllm-serve-{name}.log",
                config,
                extra_args=extra,
            )
            self.servers[name] = server.start()
        return server

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.stop()


@pytest.fixture(scope="session")
def _servers(
    request: pytest.FixtureRequest,
    model_dir: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[_Servers]:
    servers = _Servers(model_dir, tmp_path_factory.mktemp("server-logs"))
    _LAUNCHED.append(servers)
    try:
        yield servers
    finally:
        servers.stop_all()


def _session_uses(request: pytest.FixtureRequest, fixture: str) -> bool:
    return any(
        fixture in getattr(item, "fixturenames", ())
        for item in request.session.items
        if not item.get_closest_marker("skip")
    )


@pytest.fixture(scope="session")
def hs_server(request: pytest.FixtureRequest, _servers: _Servers) -> ServerProcess:
    """The tiny Llama fp32 server with --hidden-states-config (layers
    [0, 2, -1, "final_norm"], cap 256 rows of all 4 layers)."""
    server = _servers.launch("hs")
    if _session_uses(request, "plain_server"):
        _servers.launch("plain")  # start in parallel; waited for on first use
    server.wait_ready()
    kinds = server.collective_rpc("model_runner_kind")
    assert kinds == [expected_model_runner()], f"hs server runs {kinds}"
    return server


@pytest.fixture(scope="session")
def plain_server(_servers: _Servers) -> ServerProcess:
    """The same model served without --hidden-states-config."""
    return _servers.launch("plain").wait_ready()


@pytest.fixture(scope="session")
def online_server(_servers: _Servers) -> ServerProcess:
    """The same model served with ONLINE_CONFIG."""
    return _servers.launch("online").wait_ready()


@pytest.fixture(scope="session")
def spec_server(_servers: _Servers) -> ServerProcess:
    """The hs server's model and config with ngram speculative decoding."""
    return _servers.launch("spec").wait_ready()


@pytest.fixture(scope="session")
def refs_server(_servers: _Servers) -> ServerProcess:
    """HS_CONFIG with two API server processes sharing the shm reference
    store, REFS_TTL_S, REFS_MAX_BYTES and REFS_API_KEY."""
    return _servers.launch("refs").wait_ready()


@pytest.fixture(scope="session")
def served_model(hs_server: ServerProcess) -> str:
    """Model name of the servers (the model directory)."""
    return hs_server.model_dir


@pytest.fixture(scope="session")
def oai(hs_server: ServerProcess):
    """`openai.OpenAI` client of `hs_server`."""
    import openai

    client = openai.OpenAI(
        base_url=hs_server.base_url, api_key="x", timeout=120.0, max_retries=0
    )
    yield client
    client.close()


@pytest.fixture(scope="session")
def http(hs_server: ServerProcess):
    """`httpx.Client` of `hs_server`."""
    import httpx

    with httpx.Client(base_url=hs_server.url, timeout=120.0) as client:
        yield client
