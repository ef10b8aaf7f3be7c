"""Runs the collective strategies (``tokenring.strategies.collective``) on one rank.

:func:`collective_forward` and :func:`collective_backward` are joined by residuals; the public
API runs them after validation and wires them into autograd.

Note [Collectives point to point]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Both strategies send exactly the transfers of their own schedules
(``build_collective_schedule``): Ulysses through a ``SlotPoster`` (slot 0: q or q_grad and
K/V of each peer's heads; slot 1, after its kernel: out, or dq and dK/dV, of each peer's
rows), all-gather K/V one ``Communicator.exchange`` per round (its send to r - k and its
receive from r + k together, Note [All-gather K/V rounds]). So every message is a
point-to-point message posted receives first (both directions of a pair at once on gloo,
where ``all_to_all_single`` lets them take turns: Note [Collective routing]), laid out as
``tokenring.runtime.ring.message_fields`` says (K/V in Note [K/V message layout]), with a
header the receiver checks, counted by the communicator per flow and peer, and bounded by
its timeout; a receive that does not arrive names its payload, owner, rows and peer. The
backward's reduce-scatter of dK/dV is each owner's block sent home and summed there: P - 1
blocks out per rank, the volume of a real reduce-scatter (gloo's ``reduce_scatter_tensor``
is an all-reduce and a local chunk, pytorch PR 118911). The algorithms: Note [Ulysses], Note
[All-gather K/V] and Note [All-gather K/V rounds] in ``tokenring.strategies.collective``.

Legend: B batch, S global seq (P * s), s local seq, Hq query heads, Hkv key/value heads, D head
dim, P world size, nq / nkv heads of one Ulysses rank.
"""

from __future__ import annotations

import enum
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from tokenring.core.layout import Layout, Sharding, global_positions
from tokenring.core.masks import MaskSpec
from tokenring.core.merge import merge_into
from tokenring.core.schedule import AttentionShape, Pass, Payload, Schedule, Segment, Transfer
from tokenring.runtime.comm import Communicator, Event, FieldSpec, Message, PendingRecv
from tokenring.runtime.kernels import BlockKernel, PositionMask, accumulation_dtype
from tokenring.runtime.ring import kv_message, kv_rows, message_fields
from tokenring.runtime.slots import SlotPoster
from tokenring.strategies.collective import (
    CollectiveStrategy,
    HeadShare,
    Rows,
    _build,
    ulysses_heads,
)
from tokenring.strategies.collective import _shift as _shift_rows

__all__ = ["collective_backward", "collective_forward", "residual_fields"]


# -- messages ------------------------------------------------------------------------------


def _poster(sched: Schedule, comm: Communicator, q: torch.Tensor, k: torch.Tensor) -> SlotPoster:
    """The schedule's messages of this rank, posted slot by slot through the communicator
    (Note [Collectives point to point])."""
    shape = AttentionShape.of(q, k)
    return SlotPoster(sched.transfers, comm, functools.partial(message_fields, shape), q.device)


def _by_source(
    poster: SlotPoster, payload: Payload, own: Sequence[torch.Tensor], rank: int, p: int
) -> list[list[torch.Tensor] | None]:
    """Every rank's message of ``payload`` to this rank, in rank order (this rank's: ``own``;
    None: a rank that sends none, having no heads for it)."""
    parts: list[list[torch.Tensor] | None] = [None] * p
    parts[rank] = list(own)
    for rec in poster.take(payload):
        tensors = rec.wait()
        if payload is Payload.KV:
            tensors = list(kv_rows(tensors[0]))
        parts[rec.transfer.src] = tensors
    return parts


def _timed(comm: Communicator, label: str) -> Callable[[], None]:
    start = time.perf_counter()

    def done() -> None:
        if comm.timeline is not None:
            comm.timeline.events.append(Event("compute", label, 0, start, time.perf_counter()))

    return done


# -- Ulysses -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _UlyssesPlan:
    """What one rank needs to run Ulysses: head shares, row order, local kv head map."""

    shares: tuple[HeadShare, ...]
    to_global: torch.Tensor | None  # gathered row index of each global position; None: as is
    to_layout: torch.Tensor | None  # global position of each gathered row
    kv_map: torch.Tensor | None  # local kv head of each local q head; None: kernel's own GQA
    visible: PositionMask | None = None  # (S, S) mask over the gathered rows, as positions

    @staticmethod
    def make(
        comm: Communicator,
        layout: Layout,
        causal: bool,
        shape_q: torch.Size,
        heads_kv: int,
        device: torch.device,
        masking: _Masking | None = None,
    ) -> _UlyssesPlan:
        p, s, hq = comm.world_size, shape_q[1], shape_q[2]
        shares = ulysses_heads(world_size=p, heads_q=hq, heads_kv=heads_kv)
        to_global = to_layout = None
        visible = None
        if masking is not None:  # rows stay in rank order; the mask says who sees whom
            visible = masking.block(masking.all_positions, masking.all_positions)
        elif causal and layout is not Layout.CONTIGUOUS and p > 1:
            positions = torch.cat(
                [
                    global_positions(rank=j, world_size=p, seq_local=s, layout=layout)
                    for j in range(p)
                ]
            ).to(device)  # (S,) global position of each gathered row
            to_layout = positions
            to_global = torch.argsort(positions)
        mine = shares[comm.rank]
        groups = hq // heads_kv
        local = [(h // groups) - mine.kv[0] for h in range(*mine.q)]
        kv_map = None
        if mine.num_q > 0:
            per = mine.num_q // mine.num_kv
            native = mine.num_q % mine.num_kv == 0 and local == [
                i // per for i in range(mine.num_q)
            ]
            if not native:
                kv_map = torch.tensor(local, dtype=torch.long, device=device)
        return _UlyssesPlan(shares, to_global, to_layout, kv_map, visible)

    def global_order(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return x if self.to_global is None else x.index_select(dim, self.to_global)

    def layout_order(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return x if self.to_layout is None else x.index_select(dim, self.to_layout)

    def expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, nkv, D) -> the kv head of every local q head where the kernel needs it."""
        return x if self.kv_map is None else x.index_select(2, self.kv_map)

    def reduce_kv(self, dx: torch.Tensor, num_kv: int, acc: torch.dtype) -> torch.Tensor:
        """Gradient of :meth:`expand_kv`: (B, S, nq or nkv, D) -> (B, S, nkv, D) in ``acc``."""
        if self.kv_map is None:
            return dx.to(acc)
        shape = (dx.shape[0], dx.shape[1], num_kv, dx.shape[3])
        return torch.zeros(shape, dtype=acc, device=dx.device).index_add_(
            2, self.kv_map, dx.to(acc)
        )


def _rows(heads: Rows | None) -> Rows:
    assert heads is not None, "a Ulysses message carries a head share"
    return heads


def _heads(x: torch.Tensor, heads: Rows | None) -> torch.Tensor:
    """The heads ``heads`` of a (B, s, H, D) tensor."""
    start, stop = _rows(heads)
    return x[:, :, start:stop]


def _ulysses_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: _UlyssesPlan,
    sched: Schedule,
    comm: Communicator,
    kernel: BlockKernel,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Returns out (B, s, Hq, D), lse (B, Hq, s) and the tensors the backward keeps."""
    s = q.shape[1]
    p, rank = comm.world_size, comm.rank
    mine = plan.shares[rank]
    nq = mine.num_q
    poster = _poster(sched, comm, q, k)
    back: list[torch.Tensor] = []  # out and lse (B, ., nq, .) in layout order, once computed

    def provide(tr: Transfer) -> Sequence[torch.Tensor] | Message:
        if tr.payload is Payload.Q:  # my rows of the destination's heads
            return [_heads(q, tr.heads)]
        if tr.payload is Payload.KV:  # the k, v heads they use
            return kv_message(_heads(k, tr.heads), _heads(v, tr.heads))
        rows = slice(tr.dst * s, (tr.dst + 1) * s)  # OUT: the destination's rows of my heads
        return [back[0][:, rows], back[1][:, :, rows]]

    poster.post(0, 0, provide)
    if nq > 0:
        qs = _by_source(poster, Payload.Q, [_heads(q, mine.q)], rank, p)
        kvs = _by_source(poster, Payload.KV, [_heads(k, mine.kv), _heads(v, mine.kv)], rank, p)
        qg, kg, vg = _gathered(_joined(qs, kvs), plan, 3)  # (B, S, nq, D), (B, S, nkv, D) x 2
        del qs, kvs
        done = _timed(comm, "attn")
        out_g, lse_g = kernel.forward(
            qg,
            plan.expand_kv(kg),
            plan.expand_kv(vg),
            causal=causal and plan.visible is None,
            scale=scale,
            mask=plan.visible,
        )  # (B, S, nq, D), (B, nq, S)
        done()
        del qg, kg, vg
        back += [plan.layout_order(out_g, 1), plan.layout_order(lse_g, 2)]
        del out_g, lse_g
    # this rank's rows of its heads stay here: views of ``back`` until joined below
    rows = slice(rank * s, (rank + 1) * s)
    own = [back[0][:, rows], back[1][:, :, rows]] if back else []
    poster.post(0, 1, provide)
    back.clear()  # packed
    parts = _by_source(poster, Payload.OUT, own, rank, p)
    del own
    outs, lses = [], []
    for j, share in enumerate(plan.shares):
        part = parts[j]
        if share.num_q > 0:
            assert part is not None, f"rank {j} sent no out"
            outs.append(part[0])
            lses.append(part[1])
    del parts
    comm.wait_sends()
    out = torch.cat(outs, dim=2)  # (B, s, Hq, D): shares in head order
    lse = torch.cat(lses, dim=1).contiguous()  # (B, Hq, s)
    return out, lse, []


def _joined(*by_source: list[list[torch.Tensor] | None]) -> list[list[torch.Tensor]]:
    """Each source's tensors of several payloads, one list per source: every rank sends
    them to a rank with heads."""
    joined = []
    for parts in zip(*by_source, strict=True):
        assert all(part is not None for part in parts), "every rank sends to a rank with heads"
        joined.append([x for part in parts if part is not None for x in part])
    return joined


def _gathered(parts: list[list[torch.Tensor]], plan: _UlyssesPlan, num: int) -> list[torch.Tensor]:
    """The first ``num`` fields of every rank's part, each joined over the sequence in global
    order (B, S, ...): the received buffer is let go as soon as the last one is built."""
    joined = []
    for i in range(num):
        pieces = [part[i] for part in parts]
        joined.append(plan.global_order(torch.cat(pieces, dim=1)))
        del pieces
    parts.clear()
    return joined


def _ulysses_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: _UlyssesPlan,
    sched: Schedule,
    comm: Communicator,
    kernel: BlockKernel,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gathers q, dout, lse, delta of its head share and the K/V they use again, like the
    forward, instead of keeping them (Note [Ulysses])."""
    b, s, _, d = dout.shape
    heads_kv = k.shape[2]
    p, rank = comm.world_size, comm.rank
    acc = lse.dtype
    mine = plan.shares[rank]
    nq, nkv = mine.num_q, mine.num_kv
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()  # (B, Hq, s)
    poster = _poster(sched, comm, q, k)
    back: list[torch.Tensor] = []  # dq, dk, dv (B, S, ., D) in layout order, once computed

    def q_grad(heads: Rows | None) -> list[torch.Tensor]:  # Payload.Q_GRAD of these heads
        h = slice(*_rows(heads))
        return [q[:, :, h], dout[:, :, h], lse[:, h], delta[:, h]]

    def provide(tr: Transfer) -> Sequence[torch.Tensor] | Message:
        if tr.payload is Payload.Q_GRAD:  # q, dout, lse, delta of the destination's heads
            return q_grad(tr.heads)
        if tr.payload is Payload.KV:
            return kv_message(_heads(k, tr.heads), _heads(v, tr.heads))
        rows = slice(tr.dst * s, (tr.dst + 1) * s)  # the destination's rows of my heads
        if tr.payload is Payload.DQ:
            return [back[0][:, rows]]
        return [back[1][:, rows], back[2][:, rows]]  # DKV, in the accumulation dtype

    poster.post(0, 0, provide)
    if nq > 0:
        grads = _by_source(poster, Payload.Q_GRAD, q_grad(mine.q), rank, p)
        kvs = _by_source(poster, Payload.KV, [_heads(k, mine.kv), _heads(v, mine.kv)], rank, p)
        parts = _joined(grads, kvs)  # q, dout, lse, delta, k, v of each source
        del grads, kvs
        lse_g, delta_g = (
            plan.global_order(torch.cat([part[i] for part in parts], dim=2), 2) for i in (2, 3)
        )  # (B, nq, S) x 2
        rows4 = [[part[0], part[1], part[4], part[5]] for part in parts]
        del parts
        qg, dout_g, kg, vg = _gathered(rows4, plan, 4)  # (B, S, nq, D) x 2, (B, S, nkv, D) x 2
        done = _timed(comm, "attn_bwd")
        dq_g, dk_x, dv_x = kernel.backward(
            dout_g,
            qg,
            plan.expand_kv(kg),
            plan.expand_kv(vg),
            lse_g,
            delta_g,
            causal=causal and plan.visible is None,
            scale=scale,
            mask=plan.visible,
        )
        done()
        del qg, kg, vg, dout_g, lse_g, delta_g
        back.append(plan.layout_order(dq_g))
        del dq_g
        back.append(plan.layout_order(plan.reduce_kv(dk_x, nkv, acc)))  # (B, S, nkv, D)
        back.append(plan.layout_order(plan.reduce_kv(dv_x, nkv, acc)))
        del dk_x, dv_x
    rows = slice(rank * s, (rank + 1) * s)
    own = [x[:, rows] for x in back]  # this rank's rows of its heads (views of ``back``)
    poster.post(0, 1, provide)
    back.clear()  # packed
    dqs = _by_source(poster, Payload.DQ, own[:1], rank, p)
    dkvs = _by_source(poster, Payload.DKV, own[1:], rank, p)
    del own
    dk = torch.zeros((b, s, heads_kv, d), dtype=acc, device=dout.device)
    dv = torch.zeros_like(dk)
    dq_parts = []
    for sh, dq_part, dkv_part in zip(plan.shares, dqs, dkvs, strict=True):
        if sh.num_q == 0:
            continue
        assert dq_part is not None and dkv_part is not None, "a rank with heads returns them"
        dq_parts.append(dq_part[0])
        _heads(dk, sh.kv).add_(dkv_part[0])  # a kv head used by several ranks sums here
        _heads(dv, sh.kv).add_(dkv_part[1])
    del dqs, dkvs
    comm.wait_sends()
    dq = torch.cat(dq_parts, dim=2)  # (B, s, Hq, D)
    return dq, dk, dv


# -- all-gather K/V ------------------------------------------------------------------------


def _round_transfers(sched: Schedule, rank: int) -> dict[tuple[Payload, int], Transfer]:
    """This rank's transfers by (payload, peer): what it sends to the peer and receives from it
    (all-gather K/V: a rank sends to and receives from different peers in each round)."""
    found = {(tr.payload, tr.dst): tr for tr in sched.sends(rank, 0)}
    found.update({(tr.payload, -1 - tr.src): tr for tr in sched.recvs(rank, 0)})
    return found


def _shift(
    comm: Communicator,
    shape: AttentionShape,
    transfers: dict[tuple[Payload, int], Transfer],
    payload: Payload,
    dst: int,
    src: int,
    message: Message,
) -> PendingRecv:
    """One round of all-gather K/V: ``message`` to ``dst`` and the same payload from ``src``,
    posted together (receive first) in one exchange (Note [All-gather K/V rounds])."""
    send, recv = transfers[(payload, dst)], transfers[(payload, -1 - src)]
    fields = message_fields(shape, recv)
    return comm.exchange([(send, message)], [(recv, fields)], device=message.buffer.device)[recv]


def _rounds(sched: Schedule, rank: int) -> list[list[Segment]]:
    """The schedule's segments of ``rank`` by round (round k: kv rows of owner rank + k)."""
    p, s = sched.world_size, sched.seq_local
    rounds: list[list[Segment]] = [[] for _ in range(p)]
    for segment in sched.steps[rank][0].segments:
        (piece,) = segment.pieces
        rounds[(piece.kv_rows[0] // s - rank) % p].append(segment)
    return rounds


def _allgather_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sched: Schedule,
    comm: Communicator,
    kernel: BlockKernel,
    *,
    scale: float,
    masking: _Masking | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns out (B, s, Hq, D) and lse (B, Hq, s); Note [All-gather K/V rounds]."""
    b, s, hq, d = q.shape
    p, rank = comm.world_size, comm.rank
    acc = accumulation_dtype(q.dtype)
    shape = AttentionShape.of(q, k)
    rounds = _rounds(sched, rank)
    transfers = _round_transfers(sched, rank)
    out_acc = torch.zeros((b, s, hq, d), dtype=acc, device=q.device)
    lse_acc = torch.full((b, hq, s), float("-inf"), dtype=acc, device=q.device)
    gathers: dict[int, PendingRecv] = {}  # two rounds in flight
    computed = 0

    def post(round_: int) -> None:
        src, dst = (rank + round_) % p, (rank - round_) % p
        assert transfers[(Payload.KV, dst)].after_segments == computed, "posted as scheduled"
        gathers[round_] = _shift(comm, shape, transfers, Payload.KV, dst, src, kv_message(k, v))

    for round_, segments in enumerate(rounds):
        if round_ + 1 < p:
            post(round_ + 1)
        # (B, s, Hkv, D) x 2: the own block, or the round's arrived one
        kv = (k, v) if round_ == 0 else kv_rows(gathers.pop(round_).wait()[0])
        offset = (rank + round_) % p * s
        for segment in segments:
            (piece,) = segment.pieces
            (a, e), (c, f) = piece.q_rows, _shift_rows(piece.kv_rows, -offset)
            done = _timed(comm, "attn")
            mask = None if masking is None else masking.rows(rank, (a, e), piece.kv_rows)
            part = kernel.forward(
                q[:, a:e],
                kv[0][:, c:f],
                kv[1][:, c:f],
                causal=piece.causal and mask is None,
                scale=scale,
                mask=mask,
            )
            merge_into(out_acc, lse_acc, piece.q_rows, *part)
            del part
            done()
            computed += 1
        del kv
        comm.release_sends()
    comm.wait_sends()
    return out_acc.to(q.dtype), lse_acc


def _allgather_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sched: Schedule,
    comm: Communicator,
    kernel: BlockKernel,
    *,
    scale: float,
    masking: _Masking | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gathers the K/V again round by round and returns each round's dK/dV partial to its
    owner before the next round (Note [All-gather K/V rounds])."""
    p, rank = comm.world_size, comm.rank
    acc = lse.dtype
    shape = AttentionShape.of(q, k)
    rounds = _rounds(sched, rank)
    transfers = _round_transfers(sched, rank)
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()  # (B, Hq, s)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # (B, s, Hq, D)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)  # (B, s, Hkv, D)
    dv = torch.zeros_like(dk)
    computed = 0

    def post_gather(round_: int) -> PendingRecv:
        src, dst = (rank + round_) % p, (rank - round_) % p
        assert transfers[(Payload.KV, dst)].after_segments == computed, "posted as scheduled"
        return _shift(comm, shape, transfers, Payload.KV, dst, src, kv_message(k, v))

    gather = post_gather(1) if p > 1 else None  # flies while the own block is computed
    for round_, segments in enumerate(rounds):
        message = None
        if round_ == 0:
            kv, grads = (k, v), [dk, dv]
        else:
            assert gather is not None
            kv = kv_rows(gather.wait()[0])  # (B, s, Hkv, D) x 2
            gather = None
            # the round's dK/dV partial, accumulated in the message that returns it
            message, grads = comm.message([(tuple(k.shape), acc)] * 2, k.device)
        offset = (rank + round_) % p * q.shape[1]
        for segment in segments:
            (piece,) = segment.pieces
            (a, e), (c, f) = piece.q_rows, _shift_rows(piece.kv_rows, -offset)
            done = _timed(comm, "attn_bwd")
            mask = None if masking is None else masking.rows(rank, (a, e), piece.kv_rows)
            kernel.backward_into(
                (dq[:, a:e], grads[0][:, c:f], grads[1][:, c:f]),
                dout[:, a:e],
                q[:, a:e],
                kv[0][:, c:f],
                kv[1][:, c:f],
                lse[:, :, a:e],
                delta[:, :, a:e],
                causal=piece.causal and mask is None,
                scale=scale,
                mask=mask,
                out=out[:, a:e],  # this rank's own queries
            )
            done()
            computed += 1
        del kv, grads
        if message is None:
            continue
        owner = (rank + round_) % p
        assert transfers[(Payload.DKV, owner)].after_segments == computed, "returned as scheduled"
        back = _shift(comm, shape, transfers, Payload.DKV, owner, (rank - round_) % p, message)
        del message
        if round_ + 1 < p:  # the K/V buffer is free: the next round flies with the return
            gather = post_gather(round_ + 1)
        dk_home, dv_home = back.wait()  # this rank's own rows, as computed by rank - round
        dk += dk_home
        dv += dv_home
        del back, dk_home, dv_home
        comm.release_sends()
    comm.wait_sends()
    return dq, dk, dv


# -- entry points --------------------------------------------------------------------------
# Forward and backward are separate calls joined by *residuals*, the tensors the backward keeps
# beyond q, out and lse (see tokenring.runtime.op): the public API wires them into autograd
# through a
# custom operator, which must know their shapes before it runs (residual_fields).


def residual_fields(
    strategy_name: CollectiveStrategy | enum.Enum | str,
    *,
    batch: int,
    seq_local: int,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    world_size: int,
    rank: int,
) -> list[FieldSpec]:
    """Shapes and dtypes of the residuals :func:`collective_forward` returns on ``rank``.

    None: both backwards gather again what they need (Note [Ulysses], Note [All-gather K/V
    rounds]).

    Raises:
        ValueError: an unknown ``strategy_name``; Hkv not dividing Hq (Ulysses).
    """
    strategy = CollectiveStrategy.parse(strategy_name)
    if strategy is CollectiveStrategy.ALLGATHER_KV:
        return []
    ulysses_heads(world_size=world_size, heads_q=heads_q, heads_kv=heads_kv)  # validates
    return []


def _masking(
    sharding: Sharding | None, mask: MaskSpec | None, world_size: int, device: torch.device
) -> _Masking | None:
    if sharding is not None and mask is not None and (sharding.padded or not mask.plain):
        return _Masking(sharding, mask, world_size, device)
    return None


def collective_forward(
    strategy_name: CollectiveStrategy | enum.Enum | str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    layout: Layout | str,
    comm: Communicator,
    kernel: BlockKernel,
    sharding: Sharding | None = None,
    mask: MaskSpec | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Ulysses or all-gather K/V attention over this rank's shard, without autograd.

    The caller has validated the inputs (``tokenring.api``): same dtype and device, Hkv
    dividing Hq, a seq_local the layout can split, the same arguments on every rank.

    Args:
        strategy_name: ``"ulysses"`` (Note [Ulysses]) or ``"allgather_kv"``
            (Note [All-gather K/V]).
        q: ``(B, s, Hq, D)`` this rank's queries.
        k, v: ``(B, s, Hkv, D)``.
        causal: causal mask over global positions.
        scale: softmax scale.
        layout: how the sequence is sharded.
        comm: the communicator of the group; collectives run on ``comm.group`` and every
            message is counted in ``comm.counter``.
        kernel: the block kernel.
        sharding, mask: with padding, documents or a window (not ``mask.plain``): q, k, v are
            the padded buffers of ``sharding`` and every kernel call gets the explicit mask
            of its rows' positions (Note [Collectives with masks]).

    Returns:
        out ``(B, s, Hq, D)`` in q's dtype, lse ``(B, Hq, s)`` in the accumulation dtype
        (float32; float64 for float64 inputs), and the residuals for
        :func:`collective_backward`, contiguous, shaped as :func:`residual_fields` says.

    Raises:
        ValueError: an unknown ``strategy_name`` or layout.
        RuntimeError: a collective failed or outlasted ``comm.timeout`` (names this rank).
    """
    strategy = CollectiveStrategy.parse(strategy_name)
    layout = Layout.parse(layout)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    masking = _masking(sharding, mask, comm.world_size, q.device)
    # one step (the collectives' schedules have one): a named range in profiler traces
    with record_function(f"tokenring.{strategy.value}.forward.step0"):
        key = (layout, causal, comm.world_size, q.shape[1], q.shape[2], k.shape[2])
        sched = _build(strategy, Pass.FORWARD, *key)
        if strategy is CollectiveStrategy.ULYSSES:
            plan = _UlyssesPlan.make(comm, layout, causal, q.shape, k.shape[2], q.device, masking)
            return _ulysses_forward(q, k, v, plan, sched, comm, kernel, causal=causal, scale=scale)
        out, lse = _allgather_forward(q, k, v, sched, comm, kernel, scale=scale, masking=masking)
        return out, lse, []


def collective_backward(
    strategy_name: CollectiveStrategy | enum.Enum | str,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    residuals: Sequence[torch.Tensor],
    *,
    dtype: torch.dtype,
    causal: bool,
    scale: float,
    layout: Layout | str,
    comm: Communicator,
    kernel: BlockKernel,
    sharding: Sharding | None = None,
    mask: MaskSpec | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of :func:`collective_forward` from its residuals.

    Args:
        dout: ``(B, s, Hq, D)`` gradient of out.
        q, k, v, out, lse: the forward's inputs (padded like them) and outputs; both
            strategies read all five (they gather again; Note [Ulysses], Note [All-gather K/V
            rounds]).
        residuals: what :func:`collective_forward` returned with them.
        dtype: the dtype of q, k and v.
        causal, scale, layout, comm, kernel, sharding, mask: as given to the forward.

    Returns:
        dq ``(B, s, Hq, D)``, dk and dv ``(B, s, Hkv, D)``, in ``dtype``.
    """
    strategy = CollectiveStrategy.parse(strategy_name)
    layout = Layout.parse(layout)
    dout = dout.contiguous()
    masking = _masking(sharding, mask, comm.world_size, dout.device)
    key = (layout, causal, comm.world_size, q.shape[1], q.shape[2], k.shape[2])
    sched = _build(strategy, Pass.BACKWARD, *key)
    with record_function(f"tokenring.{strategy.value}.backward.step0"):
        if strategy is CollectiveStrategy.ULYSSES:
            assert not residuals, "Ulysses keeps no residuals"
            plan = _UlyssesPlan.make(
                comm, layout, causal, dout.shape, k.shape[2], dout.device, masking
            )
            dq, dk, dv = _ulysses_backward(
                dout,
                q.contiguous(),
                k.contiguous(),
                v.contiguous(),
                out.contiguous(),
                lse.contiguous(),
                plan,
                sched,
                comm,
                kernel,
                causal=causal,
                scale=scale,
            )
        else:
            assert not residuals, "all-gather K/V keeps no residuals"
            dq, dk, dv = _allgather_backward(
                dout,
                q.contiguous(),
                k.contiguous(),
                v.contiguous(),
                out,
                lse,
                sched,
                comm,
                kernel,
                scale=scale,
                masking=masking,
            )
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


class _Masking:
    """Explicit masks for the collectives from the padded positions of every rank.

    Note [Collectives with masks]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    With padding, documents or a window the collectives keep their plain schedules, built for
    the padded ``seq_local``: their blocks stay supersets of what is visible, because padding
    and documents keep the order of the layout's chunks and windows and documents only remove
    pairs. Each kernel call gets the mask of its rows' global positions as positions
    (``tokenring.runtime.kernels.PositionMask``; padding rows see nothing and are seen by nothing),
    which the kernel cuts into tiles, skipping the tiles nobody sees. They move the same
    bytes as without a mask. The ring strategies skip whole blocks nobody sees (Note [Mask
    classes] in tokenring.core.masks).
    """

    def __init__(
        self, sharding: Sharding, spec: MaskSpec, world_size: int, device: torch.device
    ) -> None:
        self.spec = spec
        self.seq_local = sharding.seq_local
        self.positions = [sharding.padded_positions(r).to(device) for r in range(world_size)]
        self.all_positions = torch.cat(self.positions)  # (P*s,) rows in rank order

    def block(self, q_positions: torch.Tensor, kv_positions: torch.Tensor) -> PositionMask:
        return PositionMask(self.spec, q_positions.cpu(), kv_positions.cpu())  # (sq, sk)

    def rows(self, rank: int, q_rows: Rows, kv_rows: Rows) -> PositionMask:
        """Mask of ``rank``'s q rows against rows ``kv_rows`` of the gathered sequence."""
        q_pos = self.positions[rank][q_rows[0] : q_rows[1]]
        return self.block(q_pos, self.all_positions[kv_rows[0] : kv_rows[1]])

    def gathered(self, rank: int, q_rows: Rows, index: torch.Tensor) -> PositionMask:
        """Mask of ``rank``'s q rows against the gathered rows ``index``."""
        q_pos = self.positions[rank][q_rows[0] : q_rows[1]]
        return self.block(q_pos, self.all_positions.index_select(0, index))
