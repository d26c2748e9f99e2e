"""Hidden-state references in a Mooncake Store, against a real `mooncake_master`
on loopback and a real `vllm serve --data-parallel-size 2` (two engines, and
the two API server processes vLLM picks for them) with
`--hidden-states-ref-store mooncake`.

Rows are read back three ways and checked against HF: the server's GET route
(either process), hs-connectors' own Mooncake reader given the response's
manifest, and speculators' online dataset with its stock `mooncake` backend on
the `kv_transfer_params` the server answers. The last test kills the master:
the requests it affects fail clearly and the server keeps serving. The tests
that need the master skip with one line where Mooncake is not installed or its
master cannot start; bad store options are refused before the engine starts,
Mooncake or not."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from vllm_hs.client import RefFetcher
from vllm_hs.hf_reference import assert_states_close, hf_hidden_states
from vllm_hs.models.tiny import seeded_prompt
from vllm_hs_testing.extract_output import (
    assert_speculators_item_equals_hf,
    online_dataset,
)
from vllm_hs_testing.mooncake import MooncakeMaster, unavailable_reason
from vllm_hs_testing.server import ServerProcess

LAYERS = [1, 2, 3, 4]  # the server's set: speculators' aux layers and the last
HIDDEN = 128


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"Mooncake tests skipped: {reason}")
    logs = tmp_path_factory.mktemp("mooncake")
    try:
        master = MooncakeMaster(logs / "master.log").start()
    except RuntimeError as error:
        pytest.skip(f"Mooncake tests skipped: {str(error).splitlines()[0]}")
    yield master
    master.stop()


@pytest.fixture(scope="module")
def server(
    master: MooncakeMaster, model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    import json

    server = ServerProcess(
        model_dir,
        tmp_path_factory.mktemp("mooncake-serve") / "vllm-serve.log",
        {"layers": LAYERS, "respond_in_kv_transfer_params": True},
        extra_args=(
            *("--data-parallel-size", "2"),
            *("--hidden-states-ref-store", "mooncake"),
            *("--hidden-states-ref-store-config", json.dumps(master.store_config())),
        ),
    )
    server.start()
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("store_args", "expected"),
    [
        (
            ("--hidden-states-ref-store", "mooncake"),
            ("cannot reach the Mooncake master at 127.0.0.1:1", "needs Mooncake"),
        ),
        (("--hidden-states-ref-store", "disk"), ("invalid choice: 'disk'",)),
        (
            ("--hidden-states-ref-store-config", '{"dir": "/tmp"}'),
            ("it takes 'directory'",),
        ),
    ],
    ids=["unreachable-master", "unknown-store", "unknown-key"],
)
def test_a_bad_store_is_refused_before_the_engine_starts(
    model_dir: str, tmp_path: Path, store_args: tuple[str, ...], expected
):
    """Refused with a line naming the option, in seconds: no model is loaded."""
    import json
    import subprocess

    server = ServerProcess(
        model_dir,
        tmp_path / "serve.log",
        {"layers": LAYERS},
        extra_args=(
            *store_args,
            *(
                (
                    "--hidden-states-ref-store-config",
                    json.dumps({"master_server_address": "127.0.0.1:1"}),
                )
                if "mooncake" in store_args
                else ()
            ),
        ),
    )
    done = subprocess.run(server.cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert any(e in output for e in expected), output[-3000:]
    assert "Loading weights" not in output and "EngineCore" not in output


def _complete(server: ServerProcess, prompt: list[int], **hs) -> dict:
    body = {
        "model": server.model_dir,
        "prompt": prompt,
        "max_tokens": 2,
        "temperature": 0.0,
        "hidden_states": {"encoding": "ref", "output": False, **hs},
    }
    with httpx.Client(base_url=server.url, timeout=120) as http:  # new connection
        reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_references_read_from_any_process_and_by_hs_connectors(
    server: ServerProcess, master: MooncakeMaster, model_dir: str
):
    from hs_connectors.mooncake_store import (
        MooncakeHiddenStatesStore,
        MooncakeStoreConfig,
    )

    reader = MooncakeHiddenStatesStore(
        MooncakeStoreConfig.from_dict(master.store_config(segment_bytes=0))
    ).setup()
    over_http = RefFetcher(server.url, local=False)
    for seed in range(8):
        prompt = seeded_prompt(200 + seed, 7)
        payload = _complete(server, prompt, layers=[2, 4])["choices"][0][
            "prompt_hidden_states"
        ]
        manifest = payload["manifest"]
        assert manifest["handle"] == payload["url"].rsplit("/", 1)[-1]
        assert manifest["metadata"]["layers"] == [2, 4]
        expected = hf_hidden_states(model_dir, prompt, [2, 4])
        sample = reader.get_sample(manifest, timeout=30)
        assert_states_close(
            sample["hidden_states"], expected, dtype=torch.float32, what="mooncake"
        )
        assert_states_close(
            over_http(payload), expected, dtype=torch.float32, what="GET"
        )
    # A reference deleted through any process is gone from the store.
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.delete(payload["url"]).status_code == 204
        assert http.get(payload["url"]).status_code == 404
    assert reader._store.is_exist(manifest["handle"]) == 0


def test_speculators_mooncake_backend_reads_the_server(
    server: ServerProcess, master: MooncakeMaster, model_dir: str, tmp_path: Path
):
    """speculators' online dataset with its own `mooncake` backend
    (hs-connectors' MooncakeTransfer), unchanged, on the server's
    kv_transfer_params: the rows it trains on equal HF's."""
    from hs_connectors.transfer import MooncakeBackend

    from vllm_hs.extract.records import HS_DIR

    config = master.store_config(segment_bytes=0)
    args = argparse.Namespace(
        mooncake_master=config["master_server_address"],
        mooncake_metadata_server=config["metadata_server"],
        mooncake_protocol="tcp",
        mooncake_device="",
        mooncake_global_segment_gib=0.0,
        mooncake_local_buffer_gib=0.0625,
    )
    transfer = MooncakeBackend.from_train_args(args, str(tmp_path))
    dataset, rendered = online_dataset(
        tmp_path, model_dir, transfer, server.base_url, 3
    )
    for i, (ids, _mask) in enumerate(rendered):
        item = dataset[i]
        assert_speculators_item_equals_hf(item, model_dir, ids, f"sample {i}")
    assert not list((tmp_path / HS_DIR).iterdir()), "states went through files"


def test_vllm_hs_backend_reads_mooncake_when_configured(
    server: ServerProcess, master: MooncakeMaster, model_dir: str
):
    from vllm_hs.client.speculators_online import RefTransfer

    prompt = seeded_prompt(300, 9)
    with httpx.Client(base_url=server.url, timeout=120) as http:
        body = {"model": model_dir, "prompt": prompt, "max_tokens": 1}
        params = http.post("/v1/completions", json=body).json()["kv_transfer_params"]
    assert params["version"] == 1 and params["handle"] and params["tensors"]
    transfer = RefTransfer(
        "http://127.0.0.1:1",  # unreachable: the rows come from Mooncake
        mooncake=master.store_config(segment_bytes=0),
    )
    got = transfer.get_generated(params)
    assert got["token_ids"].tolist() == prompt
    expected = hf_hidden_states(model_dir, prompt, LAYERS)
    assert_states_close(got["hidden_states"], expected, dtype=torch.float32, what="")


def test_losing_the_master_fails_only_the_requests_it_affects(
    server: ServerProcess, master: MooncakeMaster, model_dir: str
):
    """Last in this module: the master is gone afterwards."""
    held = _complete(server, seeded_prompt(400, 5))["choices"][0][
        "prompt_hidden_states"
    ]
    master.kill()
    body = {
        "model": model_dir,
        "prompt": seeded_prompt(401, 5),
        "max_tokens": 2,
        "hidden_states": {"encoding": "ref", "output": False},
    }
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for _ in range(2):  # whichever process answers
            failed = http.post("/v1/completions", json=body)
            assert failed.status_code == 503, failed.text
            message = failed.json()["error"]["message"]
            assert master.address in message and "Mooncake" in message
        gone = http.get(held["url"])
        assert gone.status_code in (404, 503), gone.text
        # Everything that does not need the store is served.
        inline = {**body, "hidden_states": {"encoding": "base64", "output": False}}
        assert http.post("/v1/completions", json=inline).status_code == 200
        plain = {"model": model_dir, "prompt": [5, 6, 7], "max_tokens": 2}
        plain_reply = http.post("/v1/completions", json={**plain})
        assert http.get("/health").status_code == 200
    # The server answers plain requests in kv_transfer_params: with the store
    # gone, that is the one part that fails, with the same clear error.
    assert plain_reply.status_code == 503 and "Mooncake" in plain_reply.text
