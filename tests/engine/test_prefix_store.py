"""HiddenStatesPrefixStore (patch 0011) on its own: what a hit may be served
from, and what must be refused (the engine-level behaviour is in
test_channel.py::test_prefix_caching)."""

from __future__ import annotations

import pytest
import torch

BLOCK = 4
LAYERS = (0, 2, "final_norm")


def _rows(seed: int, num_layers: int = len(LAYERS)) -> torch.Tensor:
    return torch.randn(
        BLOCK, num_layers, 8, generator=torch.Generator().manual_seed(seed)
    )


@pytest.fixture
def store():
    from vllm.v1.hidden_states.prefix_store import HiddenStatesPrefixStore

    block_bytes = _rows(0).numel() * 4
    return HiddenStatesPrefixStore(3 * block_bytes, BLOCK)


def test_hit_rows_in_position_and_layer_order(store):
    blocks = [_rows(i) for i in range(3)]
    for i, rows in enumerate(blocks):
        store.put(f"h{i}".encode(), LAYERS, rows)
    hashes = [b"h0", b"h1", b"h2"]
    whole = torch.cat(blocks)
    assert torch.equal(store.get(hashes, 0, 12, LAYERS), whole)
    # From a cursor inside block 1 to the end of block 2 (resumed request).
    assert torch.equal(store.get(hashes, 6, 12, LAYERS), whole[6:12])
    # A subset in another order: the columns of those layers.
    assert torch.equal(store.get(hashes, 0, 8, ["final_norm", 0]), whole[:8][:, [2, 0]])


def test_refusals(store):
    store.put(b"h0", LAYERS, _rows(0))
    store.put(b"h1", (0, 2), _rows(1, 2))
    hashes = [b"h0", b"h1", b"h2"]
    assert store.get(hashes, 0, 6, LAYERS) is None  # not on a block boundary
    assert store.get(hashes, 0, 8, LAYERS) is None  # h1 lacks final_norm
    assert store.get(hashes, 0, 12, [0]) is None  # h2 never stored
    assert store.get(hashes[:1], 0, 8, [0]) is None  # more blocks than hashes
    assert store.get(hashes, 0, 8, [2, 0]) is not None


def test_lru_eviction_and_byte_bound(store):
    for i in range(3):
        store.put(f"h{i}".encode(), LAYERS, _rows(i))
    assert store.get([b"h0"], 0, 4, LAYERS) is not None  # h0 now most recent
    store.put(b"h3", LAYERS, _rows(3))  # evicts h1, the least recent
    assert len(store) == 3 and store.num_bytes <= store.capacity_bytes
    assert store.get([b"h1"], 0, 4, LAYERS) is None
    assert store.get([b"h0"], 0, 4, LAYERS) is not None
    store.clear()
    assert len(store) == 0 and store.num_bytes == 0


def test_stored_rows_are_copies(store):
    buffer = torch.cat([_rows(0), _rows(1)])
    store.put(b"h0", LAYERS, buffer[:BLOCK])
    expected = buffer[:BLOCK].clone()
    buffer.zero_()  # the received buffer is reused or freed
    served = store.get([b"h0"], 0, BLOCK, LAYERS)
    assert torch.equal(served, expected)
    served.zero_()  # a served tensor is the caller's
    assert torch.equal(store.get([b"h0"], 0, BLOCK, LAYERS), expected)


def test_superset_replaces_subset_not_the_reverse(store):
    store.put(b"h0", (0,), _rows(0, 1))
    full = _rows(1)
    store.put(b"h0", LAYERS, full)
    assert torch.equal(store.get([b"h0"], 0, BLOCK, LAYERS), full)
    store.put(b"h0", (2,), _rows(2, 1))
    assert torch.equal(store.get([b"h0"], 0, BLOCK, LAYERS), full)
