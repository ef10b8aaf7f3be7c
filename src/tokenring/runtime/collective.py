"""Runs the collective strategies (``tokenring.strategies.collective``) on one rank.

Note [Collectives point to point]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Both strategies send exactly the transfers of their schedules, each pass a ``PassRunner``
that ``execute`` drives (Note [Collective rank program] in tokenring.runtime.program): Ulysses
posts q or q_grad and K/V of each peer's heads, then out, or dq and dK/dV, of each peer's
rows; all-gather K/V one round at a time (Note [All-gather K/V rounds]). So every message is
P2P, receives first (Note [Collective routing]), header-checked, counted and bounded by the
timeout. The backward's reduce-scatter of dK/dV is each owner's block sent home and summed
there: a real reduce-scatter's volume (gloo's is an all-reduce).

Legend: B batch, S global seq (P * s), s local seq, Hq query heads, Hkv key/value heads, D head
dim, P world size, nq / nkv heads of one Ulysses rank.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from tokenring.core.layout import Layout, Sharding, global_positions
from tokenring.core.masks import MaskSpec
from tokenring.core.merge import merge_into
from tokenring.core.schedule import Pass, Payload, Piece, Strategy, Transfer
from tokenring.runtime.comm import Communicator, Message
from tokenring.runtime.kernels import BlockKernel, PositionMask, accumulation_dtype
from tokenring.runtime.program import Op
from tokenring.runtime.ring import SchedulePass, kv_message, kv_rows, rows_heads
from tokenring.strategies.collective import Rows, _build, parse_collective, ulysses_heads

__all__ = ["collective_pass"]


# -- the runners ---------------------------------------------------------------------------


class _Collective(SchedulePass):
    """What the collectives' runners share beyond a ``SchedulePass``: ``masking``
    (Note [Collectives with masks]), P, s and the accumulation dtype."""

    def __init__(self, *args: Any, masking: _Masking | None, **options: Any) -> None:
        """As ``SchedulePass``, with ``masking``."""
        self.masking = masking
        super().__init__(*args, **options)

    def setup(self) -> None:
        self.p, self.s = self.comm.world_size, self.q.shape[1]
        self.acc = accumulation_dtype(self.q.dtype)
        self.row_delta = torch.empty(0)

    def take(
        self, op: Op, payload: Payload, own: Sequence[torch.Tensor]
    ) -> list[list[torch.Tensor] | None]:
        """Every rank's ``payload`` received in ``op`` by rank (ours: ``own``; None: none)."""
        parts: list[list[torch.Tensor] | None] = [None] * self.p
        parts[self.rank] = list(own)
        for tr in op.transfers:
            if tr.payload is payload:
                tensors = self.poster.pending.pop(tr).wait()
                parts[tr.src] = list(kv_rows(*tensors)) if payload is Payload.KV else tensors
        return parts


# -- Ulysses -------------------------------------------------------------------------------


def _heads(x: torch.Tensor, heads: Rows | None) -> torch.Tensor:
    """The heads ``heads`` of a (B, s, H, D) or (B, H, s) tensor."""
    assert heads is not None, "a Ulysses message carries a head share"
    return rows_heads(x, None, slice(*heads))


def _joined(*by_source: list[list[torch.Tensor] | None]) -> list[list[torch.Tensor]]:
    """Each source's tensors of several payloads, one list per source."""
    joined = []
    for parts in zip(*by_source, strict=True):
        assert all(part is not None for part in parts), "every rank sends to a rank with heads"
        joined.append([x for part in parts if part is not None for x in part])
    return joined


# What a Ulysses pass sends back, as a slice of its ``back``: forward out and lse; backward dq,
# then dk and dv.
_RETURNED = {Payload.OUT: slice(None), Payload.DQ: slice(0, 1), Payload.DKV: slice(1, None)}


class _Ulysses(_Collective):
    """What both Ulysses passes share: head shares, row order, local kv head map; the
    all-to-all of the queries' side and K/V there, and of the results back."""

    def setup(self) -> None:
        super().setup()
        sched, masking, device, p, s = self.sched, self.masking, self.q.device, self.p, self.s
        hq, heads_kv = self.q.shape[2], self.k.shape[2]
        self.shares = ulysses_heads(world_size=p, heads_q=hq, heads_kv=heads_kv)
        self.mine = mine = self.shares[self.rank]
        self.to_global: torch.Tensor | None = None  # gathered row of each global position
        self.to_layout: torch.Tensor | None = None  # global position of each gathered row
        visible: PositionMask | None = None  # (S, S) mask over the gathered rows
        if masking is not None:  # rows stay in rank order; the mask says who sees whom
            visible = masking.block(masking.all_positions, masking.all_positions)
        elif sched.causal and sched.layout is not Layout.CONTIGUOUS and p > 1:
            positions_of = functools.partial(global_positions, world_size=p, seq_local=s)
            rows = [positions_of(rank=j, layout=sched.layout) for j in range(p)]
            self.to_layout = torch.cat(rows).to(device)  # (S,)
            self.to_global = torch.argsort(self.to_layout)
        local = [(h // (hq // heads_kv)) - mine.kv[0] for h in range(*mine.q)]
        self.kv_map: torch.Tensor | None = None  # local kv head of each local q head
        if mine.num_q > 0:  # None: the kernel's own GQA maps q head i to kv head i // per
            per = mine.num_q // mine.num_kv
            if mine.num_q % mine.num_kv or local != [i // per for i in range(mine.num_q)]:
                self.kv_map = torch.tensor(local, dtype=torch.long, device=device)
        self.backward = sched.pass_ is Pass.BACKWARD
        # the kernel's keywords, the same in both passes
        causal = sched.causal and visible is None
        self.options: dict[str, Any] = {"causal": causal, "scale": self.scale, "mask": visible}
        # the queries' side then k, v of my heads, every rank's rows in global order: forward
        # q (B, S, nq, D); backward q, dout (B, S, nq, D), lse, delta (B, nq, S); k, v (B, S,
        # nkv, D)
        self.gathered: list[torch.Tensor] = []
        self.back: list[torch.Tensor] = []  # what returns (_RETURNED), in layout order

    def global_order(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return x if self.to_global is None else x.index_select(dim, self.to_global)

    def layout_order(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return x if self.to_layout is None else x.index_select(dim, self.to_layout)

    def expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, nkv, D) -> the kv head of every local q head where the kernel needs it."""
        return x if self.kv_map is None else x.index_select(2, self.kv_map)

    def reduce_kv(self, dx: torch.Tensor) -> torch.Tensor:
        """Gradient of :meth:`expand_kv`: (B, S, nq or nkv, D) -> (B, S, nkv, D) in ``acc``."""
        if self.kv_map is None:
            return dx.to(self.acc)
        shape = (dx.shape[0], dx.shape[1], self.mine.num_kv, dx.shape[3])
        return torch.zeros(shape, dtype=self.acc, device=dx.device).index_add_(
            2, self.kv_map, dx.to(self.acc)
        )

    def kv_heads(self, heads: Rows | None) -> list[torch.Tensor]:
        return [_heads(self.k, heads), _heads(self.v, heads)]

    def query_side(self, heads: Rows | None) -> list[torch.Tensor]:
        """The heads ``heads`` of q (backward: of q, dout, lse and delta)."""
        if not self.backward:
            return [_heads(self.q, heads)]
        return [_heads(x, heads) for x in (self.q, self.dout, self.lse, self.row_delta)]

    def rows_of(self, j: int) -> Rows:
        return (j * self.s, (j + 1) * self.s)

    def provide(self, tr: Transfer) -> Sequence[torch.Tensor] | Message:
        if tr.payload is Payload.KV:  # the k, v heads they use
            return kv_message(*self.kv_heads(tr.heads))
        if tr.payload in (Payload.Q, Payload.Q_GRAD):  # my rows of the destination's heads
            return self.query_side(tr.heads)
        rows = self.rows_of(tr.dst)  # their rows of my heads
        return [rows_heads(x, rows, slice(None)) for x in self.back[_RETURNED[tr.payload]]]

    def arrive(self, op: Op) -> None:
        if self.mine.num_q == 0:
            return
        payload = Payload.Q_GRAD if self.backward else Payload.Q
        queries = self.take(op, payload, self.query_side(self.mine.q))
        kvs = self.take(op, Payload.KV, self.kv_heads(self.mine.kv))
        parts = _joined(queries, kvs)
        del queries, kvs
        for i in range(len(parts[0])):  # each field joined over the sequence, global order
            pieces = [part[i] for part in parts]
            dim = 1 if pieces[0].dim() == 4 else 2
            self.gathered.append(self.global_order(torch.cat(pieces, dim=dim), dim))
            del pieces
        parts.clear()

    def came_back(self, op: Op) -> list[list[torch.Tensor]]:
        """RETURNS: what each rank with heads sent back, its fields in ``_RETURNED`` order."""
        own = [rows_heads(x, self.rows_of(self.rank), slice(None)) for x in self.back]  # views
        self.back = []  # sent
        payloads = (Payload.DQ, Payload.DKV) if self.backward else (Payload.OUT,)
        came = [self.take(op, payload, own[_RETURNED[payload]]) for payload in payloads]
        del own
        senders = [j for j, share in enumerate(self.shares) if share.num_q]  # ranks with heads
        return _joined(*([parts[j] for j in senders] for parts in came))


class _UlyssesForward(_Ulysses):
    """One rank's Ulysses forward (Note [Collective rank program] in runtime.program)."""

    def setup(self) -> None:
        super().setup()
        self.out = self.lse = torch.empty(0)  # (B, s, Hq, D), (B, Hq, s), from RETURNS

    def compute(self, op: Op) -> None:
        qg, kg, vg = self.gathered  # (B, S, nq, D), (B, S, nkv, D) x 2
        self.gathered = []
        done = self.timer.span(0, "attn")
        kv = (self.expand_kv(kg), self.expand_kv(vg))
        out_g, lse_g = self.kernel.forward(qg, *kv, **self.options)  # (B, S, nq, D), (B, nq, S)
        done()
        del qg, kg, vg, kv
        self.back = [self.layout_order(out_g, 1), self.layout_order(lse_g, 2)]

    def returns(self, op: Op) -> None:
        parts = self.came_back(op)
        self.out = torch.cat([part[0] for part in parts], dim=2)  # (B, s, Hq, D): head order
        self.lse = torch.cat([part[1] for part in parts], dim=1).contiguous()  # (B, Hq, s)


class _UlyssesBackward(_Ulysses):
    """One rank's Ulysses backward: gathers its heads again, like the forward."""

    def setup(self) -> None:
        super().setup()
        self.dq = self.dk = self.dv = torch.empty(0)  # (B, s, H, D), from RETURNS

    def compute(self, op: Op) -> None:
        qg, dout_g, lse_g, delta_g, kg, vg = self.gathered
        self.gathered = []
        done = self.timer.span(0, "attn_bwd")
        kv = (self.expand_kv(kg), self.expand_kv(vg))
        dq_g, dk_x, dv_x = self.kernel.backward(dout_g, qg, *kv, lse_g, delta_g, **self.options)
        done()
        del qg, kg, vg, kv, dout_g, lse_g, delta_g
        self.back.append(self.layout_order(dq_g))
        del dq_g
        self.back.append(self.layout_order(self.reduce_kv(dk_x)))  # (B, S, nkv, D)
        self.back.append(self.layout_order(self.reduce_kv(dv_x)))
        del dk_x, dv_x

    def returns(self, op: Op) -> None:
        parts = self.came_back(op)  # dq, dk, dv of each rank with heads
        self.dk = torch.zeros(self.k.shape, dtype=self.acc, device=self.k.device)  # (B, s, Hkv, D)
        self.dv = torch.zeros_like(self.dk)
        shares = [share for share in self.shares if share.num_q]
        for share, (_, dk, dv) in zip(shares, parts, strict=True):
            _heads(self.dk, share.kv).add_(dk)  # a kv head used by several ranks sums here
            _heads(self.dv, share.kv).add_(dv)
        self.dq = torch.cat([part[0] for part in parts], dim=2)  # (B, s, Hq, D)


# -- all-gather K/V ------------------------------------------------------------------------


class _AllGather(_Collective):
    """What both passes of all-gather K/V share: the block of the round being computed."""

    def setup(self) -> None:
        super().setup()
        last: dict[int, int] = {}  # the last segment of each round with any, by K/V owner
        for index, segment in enumerate(self.sched.steps[self.rank][0].segments):
            last[segment.pieces[0].kv_rows[0] // self.s] = index
        self.last = last
        # (B, s, Hkv, D) x 2: the round's block (round 0: the own one); None between rounds
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = (self.k, self.v)

    def provide(self, tr: Transfer) -> Sequence[torch.Tensor] | Message:
        return kv_message(self.k, self.v)  # KV: this rank's block, to r - k

    def arrive(self, op: Op) -> None:
        """ARRIVE: the K/V of round k (from r + k), kept while the round has segments."""
        (tr,) = op.transfers
        kv = kv_rows(*self.poster.pending.pop(tr).wait())  # (B, s, Hkv, D) x 2
        self.kv = kv if tr.owner in self.last else None  # None: nothing to compute (causal)

    def piece(self, op: Op) -> tuple[Piece, Rows, Rows, dict[str, Any]]:
        """Segment ``op.index``'s piece, q rows, kv rows in the round's block and the kernel's
        keywords (causal, scale, mask)."""
        (piece,) = self.sched.steps[self.rank][0].segments[op.index].pieces
        offset = piece.kv_rows[0] // self.s * self.s
        kv_rows = (piece.kv_rows[0] - offset, piece.kv_rows[1] - offset)
        mask = None
        if self.masking is not None:
            mask = self.masking.rows(self.rank, piece.q_rows, piece.kv_rows)
        options = {"causal": piece.causal and mask is None, "scale": self.scale, "mask": mask}
        return piece, piece.q_rows, kv_rows, options


class _AllGatherForward(_AllGather):
    """One rank's all-gather K/V forward: each piece merged into out and lse at once."""

    def setup(self) -> None:
        super().setup()
        q, acc = self.q, self.acc
        self.out = torch.zeros(q.shape, dtype=acc, device=q.device)  # (B, s, Hq, D)
        self.lse = torch.full(
            (q.shape[0], q.shape[2], self.s), float("-inf"), dtype=acc, device=q.device
        )  # (B, Hq, s)

    def compute(self, op: Op) -> None:
        assert self.kv is not None, "the round's block has arrived"
        piece, (a, e), (c, f), options = self.piece(op)
        done = self.timer.span(0, "attn")
        part = self.kernel.forward(
            self.q[:, a:e], self.kv[0][:, c:f], self.kv[1][:, c:f], **options
        )
        merge_into(self.out, self.lse, piece.q_rows, *part)
        del part
        done()
        if self.last[piece.kv_rows[0] // self.s] == op.index:  # the round's last segment
            self.kv = None


class _AllGatherBackward(_AllGather):
    """One rank's all-gather K/V backward: round k's dK/dV partial goes back to r + k."""

    def setup(self) -> None:
        super().setup()
        q, k, acc = self.q, self.k, self.acc
        self.dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # (B, s, Hq, D)
        self.dk = torch.zeros(k.shape, dtype=acc, device=k.device)  # (B, s, Hkv, D)
        self.dv = torch.zeros_like(self.dk)
        self.grads: list[torch.Tensor] | None = [self.dk, self.dv]  # the round's dK/dV
        self.outbox: dict[Transfer, Message] = {}  # each round's dK/dV partial, to return
        sends = self.sched.sends(self.rank, 0)
        self.dkv_to = {tr.dst: tr for tr in sends if tr.payload is Payload.DKV}

    def provide(self, tr: Transfer) -> Sequence[torch.Tensor] | Message:
        return self.outbox.pop(tr) if tr.payload is Payload.DKV else super().provide(tr)

    def arrive(self, op: Op) -> None:
        """ARRIVE: round k's K/V, and the message its dK/dV partial returns in."""
        super().arrive(op)
        (tr,) = op.transfers
        message, grads = self.comm.message([(tuple(self.k.shape), self.acc)] * 2, self.k.device)
        self.outbox[self.dkv_to[tr.owner]] = message
        self.grads = grads if self.kv is not None else None

    def compute(self, op: Op) -> None:
        assert self.kv is not None and self.grads is not None, "the round's block has arrived"
        piece, (a, e), (c, f), options = self.piece(op)
        done = self.timer.span(0, "attn_bwd")
        grads = (self.dq[:, a:e], self.grads[0][:, c:f], self.grads[1][:, c:f])
        q_side = (self.dout[:, a:e], self.q[:, a:e])
        kv = (self.kv[0][:, c:f], self.kv[1][:, c:f])
        stats = (self.lse[:, :, a:e], self.row_delta[:, :, a:e])
        out = self.out[:, a:e]  # this rank's own queries
        self.kernel.backward_into(grads, *q_side, *kv, *stats, out=out, **options)
        del grads, q_side, kv, stats, out
        done()
        if self.last[piece.kv_rows[0] // self.s] == op.index:  # the partial waits in the outbox
            self.kv = self.grads = None

    def returns(self, op: Op) -> None:
        """RETURNS: this rank's own rows of dK/dV as computed by r - k, added."""
        (tr,) = op.transfers
        dk_home, dv_home = self.poster.pending.pop(tr).wait()
        self.dk += dk_home
        self.dv += dv_home
        del dk_home, dv_home


_RUNNERS: dict[Strategy, tuple[type[_Collective], type[_Collective]]] = {
    Strategy.ULYSSES: (_UlyssesForward, _UlyssesBackward),
    Strategy.ALLGATHER_KV: (_AllGatherForward, _AllGatherBackward),
}  # forward, backward


# -- entry point (joined by residuals, Note [Residuals] in tokenring.runtime.op: none) --------


def collective_pass(
    strategy_name: Strategy | str,
    pass_: Pass,
    inputs: tuple[torch.Tensor, ...],
    *,
    causal: bool,
    scale: float,
    layout: Layout | str,
    comm: Communicator,
    kernel: BlockKernel,
    sharding: Sharding | None = None,
    mask: MaskSpec | None = None,
) -> tuple[torch.Tensor, ...]:
    """One pass of Ulysses or all-gather K/V attention on this rank's program, without
    autograd; the inputs are validated by the caller (``tokenring.api``).

    Args:
        strategy_name: ``"ulysses"`` (Note [Ulysses]) or ``"allgather_kv"``
            (Note [All-gather K/V]).
        inputs: forward q ``(B, s, Hq, D)``, k, v ``(B, s, Hkv, D)``: this rank's shards;
            backward dout ``(B, s, Hq, D)`` and the forward's q, k, v, out and lse (the
            backward gathers them again: no residuals).
        causal, scale, layout: the causal flag (global positions), softmax scale and layout.
        comm, kernel: the group's communicator (it counts every message) and block kernel.
        sharding, mask: with padding, documents or a window: q, k, v are the padded buffers
            of ``sharding`` (Note [Collectives with masks]); the same in both passes.

    Returns:
        Forward out ``(B, s, Hq, D)`` in q's dtype and lse ``(B, Hq, s)`` in the
        accumulation dtype; backward dq ``(B, s, Hq, D)``, dk and dv ``(B, s, Hkv, D)``, in
        q's dtype.

    Raises:
        ValueError: an unknown ``strategy_name`` or layout.
        RuntimeError: a collective failed or outlasted ``comm.timeout`` (names this rank).
    """
    strategy = parse_collective(strategy_name)
    inputs = tuple(x.contiguous() for x in inputs)
    q, k = inputs[:2] if pass_ is Pass.FORWARD else inputs[1:3]
    masking = None
    if sharding is not None and mask is not None and (sharding.padded or not mask.plain):
        masking = _Masking(sharding, mask, comm.world_size, q.device)
    key = (Layout.parse(layout), causal, comm.world_size, q.shape[1], q.shape[2], k.shape[2])
    sched = _build(strategy, pass_, *key)
    runner: Any = _RUNNERS[strategy][pass_ is Pass.BACKWARD](
        sched, comm, kernel, inputs, scale=scale, masking=masking
    )
    runner.run()
    if pass_ is Pass.FORWARD:
        return runner.out.to(q.dtype), runner.lse
    return runner.dq.to(q.dtype), runner.dk.to(q.dtype), runner.dv.to(q.dtype)


class _Masking:
    """Explicit masks for the collectives from the padded positions of every rank.

    Note [Collectives with masks]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    With padding, documents or a window the collectives keep their plain schedules for the
    padded ``seq_local`` (their blocks stay supersets of what is visible); each kernel call
    gets its rows' global positions as a ``PositionMask`` (padding sees nothing and is seen by
    nothing), whose empty tiles the kernel skips. The bytes moved are as without a mask.
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
