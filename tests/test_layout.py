"""Layout helpers against positions spelled out independently in the oracle module."""

from __future__ import annotations

import pytest
import torch

from oracle import owned_positions
from tokenring import Layout, global_positions, shard, unshard


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
    ],
)
def test_bad_layout_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        global_positions(**kwargs)


def test_shard_rejects_indivisible_length() -> None:
    with pytest.raises(ValueError, match="divisible by 4"):
        shard(torch.zeros(1, 6, 2), rank=0, world_size=2, layout=Layout.ZIGZAG)
    with pytest.raises(ValueError, match="shape"):
        unshard([torch.zeros(1, 2, 2), torch.zeros(1, 4, 2)], layout="contiguous")
