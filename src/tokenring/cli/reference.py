"""Float64 attention of one rank's rows, in tiles: what the benches check their results with.

Every rank of ``tokenring bench`` checks its own rows against full attention in float64
(Note [Per-rank reference]); ``--mode decode`` and ``--mode prefill-cached`` check their new
tokens' rows with the same passes (causal, no gradients). Memory is bounded by the inputs, K and
V in float64 and one score tile, never (rows, S) scores.

Legend: B batch, S global seq, n the rank's rows, T rows of a tile, Hq / Hkv heads, G = Hq / Hkv,
D head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["TILE_BYTES", "per_rank_reference", "tile_bytes"]

TILE_BYTES = 32 << 20
"""Size of one float64 score tile of the reference (Note [Per-rank reference])."""


def _tile_rows(batch: int, heads_q: int, num_keys: int) -> int:
    """Query rows per tile so that one (B, Hq, rows, keys) float64 tile is ~TILE_BYTES."""
    return max(1, TILE_BYTES // max(1, batch * heads_q * num_keys * 8))


def tile_bytes(batch: int, heads_q: int, num_keys: int) -> int:
    """Bytes of one float64 score tile over ``num_keys`` keys: about TILE_BYTES, more where one
    row of every head is more."""
    return _tile_rows(batch, heads_q, num_keys) * batch * heads_q * num_keys * 8


def _runs(positions: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal ranges [start, stop) of consecutive global positions in ``positions``."""
    runs: list[tuple[int, int]] = []
    for pos in sorted(positions.tolist()):
        if runs and runs[-1][1] == pos:
            runs[-1] = (runs[-1][0], pos + 1)
        else:
            runs.append((pos, pos + 1))
    return runs


def per_rank_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor | None,
    positions: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    grads: bool,
) -> list[torch.Tensor]:
    """Full attention in float64 for the rows at ``positions`` only: [out, dq, dk, dv] of
    those rows in local order, or [out] without ``grads``.

    Note [Per-rank reference]
    ~~~~~~~~~~~~~~~~~~~~~~~~~
    Every rank checks its own s of the S rows, so it needs neither full attention's global
    results nor float64 copies of every input. Scores are made in tiles of at most
    ``TILE_BYTES`` (query rows x keys), never (S, S)::

        out (and dq) of my rows   query tiles of my rows   x keys up to the tile's last row
        lse, delta of all rows    every query tile         x keys up to the tile's last row
        dk, dv of my rows         every query tile         x my keys

    (non-causal: every key). dk and dv of a key sum over every query that sees it, with that
    query's lse and delta = rowsum(dout * out): hence the pass over all rows (only with
    gradients; it also gives my rows' out and dq). Memory: the global inputs, K and V in
    float64, lse and delta of all rows, the rank's results and a tile. GQA: the G query
    heads of a K/V head are folded into the tile's rows, so K/V are never repeated.

    Args:
        q, dout: ``(B, S, Hq, D)``; k, v: ``(B, S, Hkv, D)``: the global tensors (dout may
            be None without ``grads``).
        positions: int64 ``(n,)``: global positions of the rank's rows, in local order.

    Returns:
        out, dq ``(B, n, Hq, D)``, dk, dv ``(B, n, Hkv, D)``, float64.

    Raises:
        ValueError: ``grads`` without ``dout``.
    """
    if grads and dout is None:
        raise ValueError("dout is needed for the gradients (grads=True); got None")
    k64, v64 = (x.double().permute(0, 2, 1, 3) for x in (k, v))  # (B, Hkv, S, D)
    ref = _Reference(q=q, k=k64, v=v64, dout=dout, causal=causal, scale=scale)
    out, dq, lse_all, delta_all = ref.my_rows(positions, grads=grads)
    if not grads:
        return [out]
    return [out, dq, *ref.my_keys(positions, lse_all, delta_all)]


def _visible(query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    return key_pos.view(1, -1) <= query_pos.view(-1, 1)  # (T, K)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Reference:
    """The global inputs of :func:`per_rank_reference` and its passes over them in tiles;
    a tile of T rows is (B, Hkv, G * T, .) with the G query heads of a K/V head folded in."""

    q: torch.Tensor  # (B, S, Hq, D)
    k: torch.Tensor  # (B, Hkv, S, D) float64
    v: torch.Tensor  # (B, Hkv, S, D) float64
    dout: torch.Tensor | None  # (B, S, Hq, D); None: no gradients
    causal: bool
    scale: float

    def fold(self, x: torch.Tensor, a: int, e: int) -> torch.Tensor:
        """Global rows [a, e) of (B, S, Hq, D) as (B, Hkv, G * T, D) float64 (may be a view
        of float64 inputs: never written in place)."""
        by_kv_head = x[:, a:e].double().unflatten(2, (self.k.shape[1], -1))  # (B, T, Hkv, G, D)
        return by_kv_head.permute(0, 2, 3, 1, 4).flatten(2, 3)

    def unfold(self, y: torch.Tensor, t: int) -> torch.Tensor:
        """(B, Hkv, G * T, D) -> (B, T, Hq, D)."""
        return y.unflatten(2, (-1, t)).permute(0, 3, 1, 2, 4).flatten(2, 3)

    def attend(self, a: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """probs (B, Hkv, G*T, K), out (B, Hkv, G*T, D), lse (B, Hkv, G*T) of rows [a, e)."""
        keys = e if self.causal else self.q.shape[1]
        scores = (self.fold(self.q, a, e) * self.scale) @ self.k[:, :, :keys].transpose(-1, -2)
        if self.causal:  # only the keys [a, e) can be ahead of a row of the tile
            diagonal = scores.unflatten(2, (-1, e - a))[..., a:e]
            diagonal.masked_fill_(~_visible(torch.arange(a, e), torch.arange(a, e)), -math.inf)
        lse = torch.logsumexp(scores, dim=-1)
        probs = scores.sub_(lse.unsqueeze(-1)).exp_()
        return probs, probs @ self.v[:, :, :keys], lse, keys

    def my_rows(
        self, positions: torch.Tensor, *, grads: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """out, dq ``(B, n, Hq, D)`` of the rows at ``positions``; with ``grads`` also lse and
        delta ``(B, Hkv, G, S)`` of every row (without: empty)."""
        b, seq, hq, d = self.q.shape
        hkv = self.k.shape[1]
        n = positions.numel()
        local = torch.full((seq,), -1, dtype=torch.long)  # global position -> local row
        local[positions] = torch.arange(n)
        out = torch.zeros(b, n, hq, d, dtype=torch.float64)
        dq = torch.zeros_like(out)
        tile = _tile_rows(b, hq, seq)
        runs = [(0, seq)] if grads else _runs(positions)  # grads: every row's lse and delta
        spans = [(a, min(e, a + tile)) for lo, e in runs for a in range(lo, e, tile)]
        lse_all = torch.empty(b, hkv, hq // hkv, seq if grads else 0, dtype=torch.float64)
        delta_all = torch.empty_like(lse_all)
        for a, e in spans:
            t = e - a
            probs, out_t, lse, keys = self.attend(a, e)
            rows = torch.nonzero(local[a:e] >= 0).flatten()
            if rows.numel():
                out[:, local[a:e][rows]] = self.unfold(out_t, t)[:, rows]
            if not grads:
                continue
            assert self.dout is not None, "per_rank_reference checked it"
            do = self.fold(self.dout, a, e)
            delta = (do * out_t).sum(-1)  # (B, Hkv, G*T)
            lse_all[..., a:e] = lse.unflatten(2, (-1, t))
            delta_all[..., a:e] = delta.unflatten(2, (-1, t))
            if rows.numel():
                dp = do @ self.v[:, :, :keys].transpose(-1, -2)
                ds = probs.mul_(dp.sub_(delta.unsqueeze(-1)))
                dq_t = self.unfold(ds @ self.k[:, :, :keys] * self.scale, t)  # (B, T, Hq, D)
                dq[:, local[a:e][rows]] = dq_t[:, rows]
        return out, dq, lse_all, delta_all

    def my_keys(
        self, positions: torch.Tensor, lse_all: torch.Tensor, delta_all: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """dk, dv ``(B, n, Hkv, D)`` of the keys at ``positions``: every query tile that can
        see them, with its rows' lse and delta from :meth:`my_rows`."""
        b, seq, hq, _ = self.q.shape
        n = positions.numel()
        k_mine, v_mine = self.k[:, :, positions], self.v[:, :, positions]  # (B, Hkv, n, D)
        dk, dv = torch.zeros_like(k_mine), torch.zeros_like(v_mine)
        first = int(positions.min()) if self.causal and n else 0  # no earlier query sees my keys
        last = int(positions.max()) if n else 0
        tile = _tile_rows(b, hq, max(n, 1))
        assert self.dout is not None, "per_rank_reference checked it"
        for a in range(first, seq if n else 0, tile):
            e = min(seq, a + tile)
            qt, do = self.fold(self.q, a, e), self.fold(self.dout, a, e)
            scores = (qt * self.scale) @ k_mine.transpose(-1, -2)  # (B, Hkv, G*T, n)
            if self.causal and last > a:  # some of my keys are ahead of some rows of the tile
                mask = ~_visible(torch.arange(a, e), positions)
                scores.unflatten(2, (-1, e - a)).masked_fill_(mask, -math.inf)
            lse = lse_all[..., a:e].flatten(2, 3).unsqueeze(-1)  # (B, Hkv, G*T, 1)
            probs = scores.sub_(lse).exp_()
            dv += probs.transpose(-1, -2) @ do
            delta = delta_all[..., a:e].flatten(2, 3).unsqueeze(-1)
            ds = probs.mul_((do @ v_mine.transpose(-1, -2)).sub_(delta))
            dk += ds.transpose(-1, -2) @ qt * self.scale
        return dk.transpose(1, 2), dv.transpose(1, 2)
