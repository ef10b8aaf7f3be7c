"""``tokenring bench --mode decode|prefill-cached``: its float64 check and its size guard
(``tokenring.cli.bench_inference``)."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

# imported before the fixture below patches launch(): one imported under the patch would keep
# the refusing stand-in for every later test
import tokenring.cli.bench_inference
import tokenring.cli.ranks
import tokenring.launch  # noqa: F401  (sys.modules["tokenring.launch"] below)
from oracle import full_attention
from test_cli import _usage_error
from tokenring.cli import bench_inference, main, reference
from tokenring.strategies.cached import uniform_shards


class Started(Exception):
    """Raised by the patched launcher: the command got past its checks."""


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise Started

    monkeypatch.setattr(sys.modules["tokenring.launch"], "launch", refuse)
    monkeypatch.setattr("tokenring.cli.ranks.launch", refuse)


def test_the_oracle_of_new_rows_equals_full_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows a rank owns after a cached step (block-cyclic, scattered positions), GQA, in
    whole tiles and in tiles of 3 rows, against full causal attention in float64."""
    whole_tiles = reference._tile_rows
    cached, new, world = 21, 19, 3
    total = cached + new
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(total, h, 8, generator=gen, dtype=torch.float64) for h in (6, 2, 2))
    want, _ = full_attention(q[None], k[None], v[None], causal=True, scale=0.3)
    shards = uniform_shards(world_size=world, batch=1, cached=cached, new=new, block_size=2)
    for rank in range(world):
        (positions,) = shards.q_positions[rank]
        gaps = positions[1:] - positions[:-1]
        assert len(positions) > 1 and (gaps > 1).any(), "scattered rows: more than one run"
        for tiles in (whole_tiles, lambda *_: 3):
            monkeypatch.setattr(reference, "_tile_rows", tiles)
            got = bench_inference._oracle_rows(q, k, v, positions, 0.3)
            torch.testing.assert_close(got, want[0, positions], rtol=0, atol=1e-12)


def _peak_rss_growth_bytes(fn: Any) -> int:
    """How far the resident set rose above its level at the call while ``fn`` ran (Linux)."""

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith(key + ":"))
        return int(line.split()[1]) * 1024

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark back to the current resident set
    base = status("VmRSS")
    fn()
    return status("VmHWM") - base


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_oracle_of_new_rows_holds_tiles_not_rows_by_keys() -> None:
    """2048 new rows against 8192 keys, 8 query heads: the (Hq, rows, keys) float64 scores
    are 1 GiB (the oracle held about three of them, with K/V repeated per query head, so
    prefill-cached C = T = 16384 needed ~24 GB per rank). K and V in float64 (8 MiB here),
    the rows' out (1 MiB) and a few score tiles (TILE_BYTES each) stay far below one GiB."""
    total, rows, hq, hkv, d = 8192, 2048, 8, 2, 32
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(total, hq, d, generator=gen)
    k, v = (torch.randn(total, hkv, d, generator=gen) for _ in range(2))
    positions = torch.arange(total - rows, total)
    growth = _peak_rss_growth_bytes(
        lambda: bench_inference._oracle_rows(q, k, v, positions, d**-0.5)
    )
    scores = hq * rows * total * 8
    assert growth < min(8 * reference.TILE_BYTES, scores / 4), (growth, scores)


def test_a_prefill_that_cannot_fit_in_memory_is_refused_with_the_estimate(
    capsys: pytest.CaptureFixture[str], nothing_starts: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """C = T = 16384 on 4 ranks: every rank draws every sequence's global q, k, v (S (Hq + 2
    Hkv) D float32: 192 MiB for the 8/8 x 64 model) and holds K, V of one in float64 for its
    check (128 MiB): refused before the ranks start where the machine has too little, named
    by its flags; let through where it has room."""
    argv = ["bench", "--mode", "prefill-cached", "--cached", "16384", "--new", "16384"]
    monkeypatch.setattr("tokenring.cli.bench_inference.mem_available_bytes", lambda: 1 << 30)
    line = _usage_error(argv, capsys)
    assert "--cached 16384" in line and "--new 16384" in line and "4 ranks" in line, line
    assert "MemAvailable is 1 GiB" in line, line
    per_rank = float(line.split("needs about ")[1].split(" GiB")[0]) * 2**30
    seq = 16384 + 16384
    assert per_rank >= seq * (8 + 2 * 8) * 64 * 4 + 2 * seq * 8 * 64 * 8, line
    monkeypatch.setattr("tokenring.cli.bench_inference.mem_available_bytes", lambda: 64 << 30)
    with pytest.raises(Started):
        main(argv)
