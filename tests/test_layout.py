"""Layout helpers against positions spelled out independently in the oracle module."""

from __future__ import annotations

import pytest
import torch

from oracle import owned_positions, sharded_positions
from tokenring import Layout, global_positions, position_ids, shard, unshard
from tokenring.core.layout import make_sharding


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_positions_and_round_trip(layout: str, world_size: int) -> None:
    seq = 2 * world_size * 3
    x = torch.arange(2 * seq * 5).view(2, seq, 5)  # (B, S, H*D) with distinct values
    shards = []
    for rank in range(world_size):
        expected = owned_positions(layout, rank, world_size, seq)
        got = global_positions(
            rank=rank, world_size=world_size, seq_local=seq // world_size, layout=layout
        )
        assert got.tolist() == expected
        part = shard(x, rank=rank, world_size=world_size, layout=layout)
        assert torch.equal(part, x[:, expected])
        shards.append(part)
    assert torch.equal(unshard(shards, layout=layout), x)
    assert sorted(
        p for r in range(world_size) for p in owned_positions(layout, r, world_size, seq)
    ) == list(range(seq))


def test_zigzag_balances_causal_work() -> None:
    world_size, seq = 4, 32
    work = []
    for rank in range(world_size):
        positions = owned_positions("zigzag", rank, world_size, seq)
        work.append(sum(p + 1 for p in positions))  # keys visible to each query, causal
    assert len(set(work)) == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": 0, "world_size": 2, "seq_local": 3, "layout": "zigzag"}, "even"),
        ({"rank": 0, "world_size": 0, "seq_local": 4, "layout": "zigzag"}, "world_size"),
        ({"rank": 2, "world_size": 2, "seq_local": 4, "layout": "zigzag"}, "rank"),
        ({"rank": 0, "world_size": 2, "seq_local": 4, "layout": "diagonal"}, "layout"),
        ({"rank": 0, "world_size": 2, "seq_local": 0, "layout": "contiguous"}, "seq_local"),
        # a fractional or boolean seq_local is named, not reported as the S it implies
        ({"rank": 0, "world_size": 2, "seq_local": 2.5, "layout": "contiguous"}, "seq_local"),
        ({"rank": 0, "world_size": 2, "seq_local": 4.0, "layout": "zigzag"}, "seq_local"),
        ({"rank": 0, "world_size": 2, "seq_local": True, "layout": "contiguous"}, "seq_local"),
    ],
)
def test_bad_layout_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        global_positions(**kwargs)


CASES = [  # (seq_len, cu_seqlens): any length, with and without packed documents
    (1, None),
    (7, None),
    (13, None),
    (24, None),
    (1001, None),
    (24, [0, 24]),
    (30, [0, 5, 17, 30]),
    (23, [0, 1, 2, 20, 23]),
    (40, [0, 0, 16, 16, 40]),  # empty documents
]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize(("seq_len", "cu_seqlens"), CASES)
def test_any_length_and_documents(
    layout: str, world_size: int, seq_len: int, cu_seqlens: list[int] | None
) -> None:
    x = torch.arange(2 * seq_len).view(2, seq_len, 1)
    sharding = make_sharding(
        layout=layout, world_size=world_size, seq_len=seq_len, cu_seqlens=cu_seqlens
    )
    shards = []
    for rank in range(world_size):
        expected = sharded_positions(layout, rank, world_size, seq_len, cu_seqlens)
        got = global_positions(
            rank=rank, world_size=world_size, seq_len=seq_len, layout=layout, cu_seqlens=cu_seqlens
        )
        assert got.tolist() == expected
        part = shard(x, rank=rank, world_size=world_size, layout=layout, cu_seqlens=cu_seqlens)
        assert torch.equal(part, x[:, expected])
        shards.append(part)
        # RoPE positions restart at every document
        starts = cu_seqlens or [0, seq_len]
        doc_start = [max(b for b in starts if b <= p) for p in expected]
        rope = position_ids(
            rank=rank, world_size=world_size, seq_len=seq_len, layout=layout, cu_seqlens=cu_seqlens
        )
        assert rope.tolist() == [p - b for p, b in zip(expected, doc_start, strict=True)]
        # the padded buffer: every token at its row, every other row -1, same size on all ranks
        padded = sharding.padded_positions(rank)
        assert padded.shape == (sharding.seq_local,)
        assert padded[padded >= 0].tolist() == expected
    assert torch.equal(unshard(shards, layout=layout, cu_seqlens=cu_seqlens), x)
    # padding stays small: at most one row per chunk of the layout (per document for zigzag)
    chunks = world_size if layout == "contiguous" else 2 * world_size
    docs = 1 if layout == "contiguous" else len([d for d in (cu_seqlens or [0, 1])[1:]]) or 1
    per_rank_tokens = max(1, -(-seq_len // chunks)) * (1 if layout == "contiguous" else 2)
    assert sharding.seq_local <= per_rank_tokens + 2 * docs


def test_unshard_rejects_bad_shards() -> None:
    with pytest.raises(ValueError, match="only dim 1"):
        unshard([torch.zeros(1, 2, 2), torch.zeros(1, 2, 3)], layout="contiguous")
    with pytest.raises(ValueError, match=r"shards\[0\].shape\[1\] must be 2"):
        unshard([torch.zeros(1, 1, 2), torch.zeros(1, 3, 2)], layout="contiguous")
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        shard(torch.zeros(1, 6, 2), rank=0, world_size=2, layout="zigzag", cu_seqlens=[1, 6])
    with pytest.raises(ValueError, match="non-decreasing"):
        shard(torch.zeros(1, 6, 2), rank=0, world_size=2, layout="zigzag", cu_seqlens=[0, 4, 3, 6])
    assert shard(torch.zeros(1, 6, 2), rank=0, world_size=4, layout=Layout.ZIGZAG).shape[1] == 1


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda x: shard(x, rank=0, world_size=2, layout="zigzag", seq_dim=5), "seq_dim"),
        (lambda x: shard(x, rank=0.0, world_size=2, layout="zigzag"), "rank must be"),
        (lambda x: shard(x, rank=0, world_size=2.5, layout="zigzag"), "world_size"),
        (lambda x: unshard([x, x], layout="zigzag", seq_dim=-7), "seq_dim"),
        (
            lambda x: make_sharding(layout="zigzag", world_size=2, seq_len=10.0),
            "seq_len must be an int >= 0; got 10.0",
        ),
    ],
)
def test_layout_helpers_reject_arguments_of_the_wrong_type(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(torch.zeros(1, 8, 2, 4))


@pytest.mark.parametrize(
    "cu_seqlens",
    [[0, 4.7, 8], [0, 3.0, 8], [0, True, 8], [[0, 8]], "08", [0, None, 8]],
)
def test_document_boundaries_must_be_ints(cu_seqlens: object) -> None:
    """A boundary that is not a whole number of tokens is refused, naming cu_seqlens, as a
    float tensor is: 4.7 is not rounded to 4 (that would silently move a document)."""
    x = torch.arange(8.0).view(1, 8, 1, 1)
    with pytest.raises(ValueError, match=r"cu_seqlens must hold ints"):
        shard(x, rank=0, world_size=2, layout="zigzag", cu_seqlens=cu_seqlens)
    with pytest.raises(ValueError, match=r"cu_seqlens must hold ints"):
        make_sharding(layout="contiguous", world_size=2, seq_len=8, cu_seqlens=cu_seqlens)


def test_document_boundaries_of_any_integer_kind() -> None:
    """Integer boundaries are read alike from a list, NumPy and 0-d tensors."""
    import numpy as np

    want = make_sharding(layout="zigzag", world_size=2, seq_len=8, cu_seqlens=[0, 3, 8])
    for cu in (np.array([0, 3, 8]), [torch.tensor(0), torch.tensor(3), torch.tensor(8)]):
        got = make_sharding(layout="zigzag", world_size=2, seq_len=8, cu_seqlens=cu)
        assert got == want


@pytest.mark.parametrize("rank", [-1, 3, 1.0, True])
def test_sharding_methods_name_a_rank_outside_the_group(rank: object) -> None:
    """A Sharding's per-rank methods take ranks 0 .. P-1: -1 is not read as the last rank
    (Python indexing) and 3 is not an IndexError from inside, as global_positions does."""
    sharding = make_sharding(layout="zigzag", world_size=3, seq_len=10)
    calls = [sharding.positions, sharding.doc_positions, sharding.padded_rows]
    calls += [sharding.padded_positions, sharding.local_len]
    for call in calls:
        with pytest.raises(ValueError, match=rf"rank must be in \[0, 3\); got {rank}"):
            call(rank)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank must be in"):
        sharding.padding(rank, torch.device("cpu"))  # type: ignore[arg-type]
