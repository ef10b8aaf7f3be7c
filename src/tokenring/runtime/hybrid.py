"""Runs the hybrid strategy (``tokenring.strategies.hybrid``) on one rank: the inner
all-to-alls on the inner group, the outer ring's steps by a ring runner on the outer group.

Legend: B batch, s local seq (s_i: inner rank i's), L_o outer shard (the sum of its inner
ranks' s_i), Hq / Hkv heads, D head dim, P_in inner ranks, nq = Hq / P_in, nkv = Hkv / P_in,
n the outer strategy's steps.

Note [Hybrid runner]
~~~~~~~~~~~~~~~~~~~~
The hybrid's program (Note [Hybrid rank program] in tokenring.runtime.program) names its
transfers by global rank g = o * P_in + i; each travels on one of two groups, under that
group's name for it::

    steps      transfers                  group and communicator   posted and waited for as
    0, n + 1   the inner all-to-alls      inner                    inner ranks i -> j
    1 .. n     the outer ring's, lifted   outer                    the outer schedule's o -> o'

The runner, also the poster and communicator ``execute`` sees, posts and waits for each
transfer on its group. Steps 1 .. n go to a ring runner of the outer schedule, renamed to its
steps and transfers, so the outer ring runs exactly as on its own; steps 0 and n + 1 are the
all-to-alls, the same in both passes::

    op            step 0: sequence -> heads             step n + 1: heads -> sequence
    POST          to j: my s_i rows of j's heads        to j: j's s_j rows of my heads
    ARRIVE 0 /    rows of inner rank j <- from j:       heads of inner rank j <- from j:
      RETURNS n+1 (B, L_o, nq|nkv, D), then the ring    (B, s_i, Hq|Hkv, D), lse (B, Hq, s_i)
                  runner starts on them (padded)

    pass      step 0 sends    the ring runner takes                     step n + 1 sends
    forward   q, k, v         q, k, v                                   out, lse
    backward  dout            dout; q, k, v, out, lse of the forward    dq, dk, dv
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from tokenring.core.schedule import AttentionShape, Pass, Payload, Transfer
from tokenring.runtime.comm import Communicator, Message
from tokenring.runtime.executor import PassRunner, execute
from tokenring.runtime.kernels import BlockKernel, lse_channel_width, widen
from tokenring.runtime.program import Op, program_of
from tokenring.runtime.ring import (
    _Backward,
    _Forward,
    kv_message,
    kv_rows,
    message_fields,
    rows_heads,
)
from tokenring.runtime.slots import Provide, SlotPoster
from tokenring.strategies.hybrid import HybridSchedule, inner_slices, outer_transfers

__all__ = ["HybridPlan", "hybrid_attention"]


@dataclass(frozen=True, kw_only=True, slots=True)
class HybridPlan:
    """One rank's validated hybrid call (``tokenring.hybrid_attn``): what both passes run."""

    schedules: tuple[HybridSchedule, HybridSchedule]
    """Forward and backward."""
    inner: Communicator
    outer: Communicator
    kernel: BlockKernel
    scale: float
    heads: tuple[int, int]
    """Hq, Hkv."""


def hybrid_attention(
    plan: HybridPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """out ``(B, s, Hq, D)`` and lse ``(B, Hq, s)`` of a planned call on this rank's q
    ``(B, s, Hq, D)`` and k, v ``(B, s, Hkv, D)``; differentiable in q, k and v, through out and
    lse (Note [Gradient of lse] in tokenring.runtime.op)."""
    return _HybridAttention.apply(q, k, v, plan)


class _HybridAttention(torch.autograd.Function):
    """Both passes run the hybrid's rank program; the backward gets the forward ring's
    padded q, k, v, out and lse."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: HybridPlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        runner = _HybridPass(plan, plan.schedules[0], {Payload.Q: [q], Payload.KV: [k, v]})
        execute(program_of(runner.sched, runner.rank), runner)
        out, lse = runner.result
        ctx.plan, ctx.out_like = plan, (out.shape, out.dtype, out.device)
        ctx.save_for_backward(*runner.saved)
        ctx.set_materialize_grads(False)  # a loss without lse: dlse None, not zeros
        return out, lse

    @staticmethod
    def backward(
        ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        if dout is None:  # the loss uses lse alone
            shape, dtype, device = ctx.out_like
            dout = torch.zeros(shape, dtype=dtype, device=device)
        head_dim = dout.shape[3]
        if dlse is not None:  # lse's channel travels with its heads (Note [Gradient of lse])
            channel = dlse.transpose(1, 2).unsqueeze(-1).to(dout.dtype)  # (B, s, Hq, 1)
            dout = widen(dout, lse_channel_width(dout), channel)  # (B, s, Hq, D + e)
        runner = _HybridPass(ctx.plan, ctx.plan.schedules[1], {Payload.Q: [dout]})
        runner.saved = ctx.saved_tensors
        execute(program_of(runner.sched, runner.rank), runner)
        dq, dk, dv = (x[..., :head_dim].contiguous() for x in runner.result)
        return dq, dk, dv, None


class _HybridPass(PassRunner):
    """One rank's hybrid pass (Note [Hybrid runner])."""

    ring: _Forward | _Backward

    def __init__(
        self, plan: HybridPlan, sched: HybridSchedule, outbox: dict[Payload, list[torch.Tensor]]
    ) -> None:
        assert sched.outer is not None and sched.outer.sharding is not None
        self.plan, self.sched, self.outbox = plan, sched, outbox
        self.p_in, self.last = sched.inner, sched.num_steps - 1
        self.me = plan.inner.rank
        self.rank = plan.outer.rank * self.p_in + self.me
        sharding = sched.outer.sharding
        self.rows = inner_slices(sharding.local_len(plan.outer.rank), self.p_in)
        x = outbox[Payload.Q][0]  # (B, s, Hq, D)
        self.padding = sharding.padding(plan.outer.rank, x.device)  # the L_o rows in s_pad
        shape = AttentionShape.of(x, x)  # every all-to-all transfer names its heads
        fields = functools.partial(message_fields, shape)
        self.inner_poster = SlotPoster(plan.inner, fields, x.device)
        self.ring_setup = (sched.outer, plan.outer, plan.kernel)
        hq, hkv = plan.heads
        self.names = outer_transfers(sched, self.rank, heads_q=hq, heads_kv=hkv)
        for t in (0, self.last):  # the all-to-alls' transfers as the inner group names them
            for tr in (*sched.sends(self.rank, t), *sched.recvs(self.rank, t)):
                self.names[tr] = replace(
                    tr, src=tr.src % self.p_in, dst=tr.dst % self.p_in, owner=tr.owner % self.p_in
                )
        self.comm = self.poster = self  # each transfer posted and waited for on its group
        self.saved: tuple[torch.Tensor, ...] = ()
        self.result: list[torch.Tensor] = []

    # -- steps 0 and n + 1: the all-to-alls ---------------------------------------------------

    def view(self, x: torch.Tensor, j: int, step: int, *, sending: bool) -> torch.Tensor:
        """Inner rank j's heads (sending at step 0, receiving at n + 1) or rows of ``x``."""
        if (step == 0) == sending:
            heads = x.shape[2 if x.dim() == 4 else 1] // self.p_in
            return rows_heads(x, None, slice(j * heads, (j + 1) * heads))
        return rows_heads(x, self.rows[j], slice(None))

    def provide(self, tr: Transfer) -> Sequence[torch.Tensor] | Message:
        """An all-to-all's send to inner rank ``tr.dst`` (``tr`` as the inner group names it)."""
        parts = [self.view(x, tr.dst, tr.step, sending=True) for x in self.outbox[tr.payload]]
        return kv_message(*parts) if tr.payload is Payload.KV else parts

    def gather(self, op: Op) -> list[torch.Tensor]:
        """ARRIVE 0 or RETURNS n + 1: every inner rank's part of the outbox, in place."""
        if self.p_in == 1:
            return [x for xs in self.outbox.values() for x in xs]
        step, me = op.step, self.me
        gathered: dict[Payload, list[torch.Tensor]] = {}
        for payload, xs in self.outbox.items():
            gathered[payload] = []
            for x in xs:
                shape = list(x.shape)
                rows, heads = (1, 2) if x.dim() == 4 else (2, 1)
                shape[rows] = self.rows[me][1] - self.rows[me][0] if step else self.rows[-1][1]
                shape[heads] = shape[heads] * self.p_in if step else shape[heads] // self.p_in
                target = x.new_empty(shape)
                own = self.view(x, me, step, sending=True)
                self.view(target, me, step, sending=False).copy_(own)
                gathered[payload].append(target)
        for tr in op.transfers:
            name = self.names[tr]
            got = self.inner_poster.pending.pop(name).wait()
            parts = kv_rows(*got) if tr.payload is Payload.KV else got
            for target, part in zip(gathered[tr.payload], parts, strict=True):
                self.view(target, name.src, step, sending=False).copy_(part)
        return [x for xs in gathered.values() for x in xs]

    # -- the poster and communicator ``execute`` sees -----------------------------------------

    def split(self, transfers: Sequence[Transfer]) -> tuple[list[Transfer], list[Transfer]]:
        """``transfers`` as the inner and the outer group name them."""
        inner = [self.names[tr] for tr in transfers if tr.step in (0, self.last)]
        outer = [self.names[tr] for tr in transfers if tr.step not in (0, self.last)]
        return inner, outer

    def post(self, transfers: Sequence[Transfer], provide: Provide) -> None:
        inner, outer = self.split(transfers)
        if inner:
            self.inner_poster.post(inner, provide)
        if outer:
            self.ring.poster.post(outer, self.ring.provide)

    def wait_sent(self, transfers: Sequence[Transfer]) -> None:
        inner, outer = self.split(transfers)
        self.plan.inner.wait_sent(inner)
        self.plan.outer.wait_sent(outer)

    def abandon(self, exc: BaseException) -> None:
        self.plan.inner.abandon(exc)
        self.plan.outer.abandon(exc)

    def wait_sends(self) -> None:
        self.plan.inner.wait_sends()
        self.plan.outer.wait_sends()

    # -- the ops ------------------------------------------------------------------------------

    def outer_op(self, op: Op) -> Op:
        """A ring step's op in the outer schedule's step and transfers."""
        transfers = tuple(self.names[tr] for tr in op.transfers)
        return replace(op, step=op.step - 1, transfers=transfers)

    def start_ring(self, gathered: list[torch.Tensor]) -> None:
        """ARRIVE 0: the ring runner of this pass, on the gathered rows padded to s_pad."""
        padded = tuple(self.padding.pad(x).contiguous() for x in gathered)  # (B, s_pad, h, D)
        if self.sched.pass_ is Pass.BACKWARD:  # dout; q, k, v, out, lse of the forward
            q, k, v, out, lse = self.saved
            width = padded[0].shape[3]
            if width > q.shape[3]:  # dout carries lse's gradient (Note [Gradient of lse])
                q, k, out, v = (*(widen(x, width, 0.0) for x in (q, k, out)), widen(v, width, 1.0))
            saved = (q, k, v, out, lse)
            self.ring = _Backward(*self.ring_setup, padded + saved, scale=self.plan.scale)
        else:
            self.saved = padded
            self.ring = _Forward(*self.ring_setup, self.saved, scale=self.plan.scale)

    def finish_ring(self) -> dict[Payload, list[torch.Tensor]]:
        """STEP n + 1: what the ring made, to go back (the forward keeps out and lse)."""
        ring, unpad, dtype = self.ring, self.padding.unpad, self.saved[0].dtype
        if isinstance(ring, _Backward):
            dq, dk, dv = ring.dq_acc.to(dtype), ring.dk.to(dtype), ring.dv.to(dtype)
            return {Payload.DQ: [unpad(dq)], Payload.KV: [unpad(dk), unpad(dv)]}
        out, lse = ring.out_acc.to(dtype), ring.lse_acc
        self.saved += (out, lse)
        return {Payload.OUT: [unpad(out), unpad(lse, 2)]}

    def begin(self, op: Op) -> None:
        if op.step == self.last:  # the ring is done: what it made goes back
            self.outbox = self.finish_ring()
            self.ring.timer.flush()
            del self.ring
        elif op.step > 0:
            self.ring.begin(self.outer_op(op))

    def arrive(self, op: Op) -> None:
        if op.step == 0:
            self.start_ring(self.gather(op))
        else:
            self.ring.arrive(self.outer_op(op))

    def returns(self, op: Op) -> None:
        if op.step == self.last:
            self.result = self.gather(op)
        else:
            self.ring.returns(self.outer_op(op))

    def delta(self, op: Op) -> None:
        self.ring.delta(self.outer_op(op))

    def compute(self, op: Op) -> None:
        self.ring.compute(self.outer_op(op))

    def pass_on(self, op: Op) -> None:
        self.ring.pass_on(self.outer_op(op))

    def home(self, op: Op) -> None:
        self.ring.home(self.outer_op(op))
