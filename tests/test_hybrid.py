"""Hybrid 2-D strategy (Ulysses inside, a ring strategy across) against the float64 oracle.

World size 4 as 2 x 2, 1 x 4 and 4 x 1; positions of each rank are spelled out here from the
layout definition (outer shard in the oracle's positions, consecutive near-equal slices
inside, the longer first), not taken from tokenring.hybrid; also for any length, packed
documents, windows and chunked attention. The registry's schedule
(``build_hybrid_schedule``) is checked for covering every needed (query, key, head) exactly
once, for the inner all-to-alls' bytes against a closed form, and against the bytes the ranks
count.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring
from oracle import (
    covered_pairs,
    make_inputs,
    oracle_with_grads,
    owned_positions,
    sharded_positions,
    tolerance_failures,
    visible_mask,
)
from tokenring.core.schedule import AttentionShape
from tokenring.hybrid import HybridMesh, hybrid_attn, hybrid_mesh, hybrid_positions, hybrid_shard
from tokenring.strategies.hybrid import HybridSpec, build_hybrid_schedule


def _positions(
    layout: str,
    outer_rank: int,
    inner_rank: int,
    outer: int,
    inner: int,
    seq: int,
    cu_seqlens: list[int] | None = None,
) -> list[int]:
    outer_shard = sharded_positions(layout, outer_rank, outer, seq, cu_seqlens)
    n = len(outer_shard)
    sizes = [n // inner + (1 if i < n % inner else 0) for i in range(inner)]
    start = sum(sizes[:inner_rank])
    return outer_shard[start : start + sizes[inner_rank]]


DOC_CASES = [  # (seq_len, cu_seqlens, window (left, right), attention_chunk_size)
    (23, [0, 5, 11, 23], (-1, -1), None),
    (26, [0, 9, 26], (3, 1), 4),
]


def _check_documents(outer: int, inner: int, strategy: str, causal: bool, layout: str) -> list[str]:
    """Any length, documents, a window and chunks in float64: shards from hybrid_shard (and
    its positions) against the definitions here, the result against the oracle."""
    outer_rank, inner_rank = divmod(dist.get_rank(), inner)
    mesh = hybrid_mesh(outer, inner)
    failures = []
    for seq, docs, (left, right), chunk in DOC_CASES:
        window = (left, 0 if causal else right)
        q, k, v, dout = make_inputs(
            seed=seq, batch=2, seq_global=seq, heads_q=8, heads_kv=4, head_dim=8
        )
        mask = visible_mask(seq, causal=causal, cu_seqlens=docs, window=window, chunk=chunk)
        ref = oracle_with_grads(q, k, v, dout, causal=causal, scale=8**-0.5, mask=mask)
        mine = _positions(layout, outer_rank, inner_rank, outer, inner, seq, docs)
        where = {"outer_rank": outer_rank, "inner_rank": inner_rank, "outer": outer}
        where |= {"inner": inner, "layout": layout}
        got_pos = hybrid_positions(**where, seq_len=seq, cu_seqlens=docs).tolist()
        idx = torch.tensor(mine, dtype=torch.long)
        if got_pos != mine or not torch.equal(hybrid_shard(q, **where, cu_seqlens=docs), q[:, idx]):
            failures.append(f"{seq} {docs}: positions {got_pos} != {mine}")
        local = [x[:, idx].clone().requires_grad_(True) for x in (q, k, v)]
        out, lse = hybrid_attn(
            *local,
            mesh=mesh,
            outer_strategy=strategy,
            causal=causal,
            layout=layout,
            return_lse=True,
            seq_len=seq,
            cu_seqlens=docs,
            window_size=window,
            attention_chunk_size=chunk,
        )
        out.backward(dout[:, idx])
        got = {"out": out.detach(), "lse": lse}
        got |= {"dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
        want = {n: ref[n][:, :, idx] if n == "lse" else ref[n][:, idx] for n in got}
        config = f"{strategy} {layout} causal={causal} S={seq} docs={docs} chunk={chunk}"
        failures += [
            f"{config} {f}"
            for f in tolerance_failures(
                got,
                want,
                dtype=torch.float64,
                inputs=(q, k, v, dout),
                reference=ref,
                causal=causal,
                scale=8**-0.5,
                mask=mask,
            )
        ]
    return failures


def run_hybrid(outer: int, inner: int) -> list[str]:
    rank = dist.get_rank()
    mesh = hybrid_mesh(outer, inner)
    outer_rank, inner_rank = divmod(rank, inner)
    failures = []
    grid = itertools.product(
        ("token_ring", "ring", "bidir_ring", "bidir_token_ring"),
        ((True, "zigzag"), (False, "contiguous")),
        ((8, 8), (8, 4)),
        (torch.float64, torch.bfloat16),
    )
    for strategy, (causal, layout), (hq, hkv), dtype in grid:
        seq = 2 * outer * inner * 3
        q, k, v, dout = make_inputs(
            seed=11, batch=1, seq_global=seq, heads_q=hq, heads_kv=hkv, head_dim=8
        )
        ref = oracle_with_grads(q, k, v, dout, causal=causal, scale=8**-0.5, dtype=dtype)
        mine = _positions(layout, outer_rank, inner_rank, outer, inner, seq)
        got_pos = hybrid_positions(
            outer_rank=outer_rank,
            inner_rank=inner_rank,
            outer=outer,
            inner=inner,
            seq_local=len(mine),
            layout=layout,
        ).tolist()
        if got_pos != mine:
            failures.append(f"positions {got_pos} != {mine}")
        idx = torch.tensor(mine)
        if not torch.equal(
            hybrid_shard(
                q,
                outer_rank=outer_rank,
                inner_rank=inner_rank,
                outer=outer,
                inner=inner,
                layout=layout,
            ),
            q[:, idx],
        ):
            failures.append(f"hybrid_shard does not take positions {mine}")
        local = [x[:, idx].to(dtype).requires_grad_(True) for x in (q, k, v)]
        out, lse = hybrid_attn(
            *local,
            mesh=mesh,
            outer_strategy=strategy,
            causal=causal,
            layout=layout,
            return_lse=True,
        )
        out.backward(dout[:, idx].to(dtype))
        got = {
            "out": out.detach(),
            "lse": lse,
            "dq": local[0].grad,
            "dk": local[1].grad,
            "dv": local[2].grad,
        }
        want = {n: ref[n][:, :, idx] if n == "lse" else ref[n][:, idx] for n in got}
        config = f"{strategy} causal={causal} heads={hq}/{hkv} {dtype}"
        failures += [
            f"{config} {f}"
            for f in tolerance_failures(
                got,
                want,
                dtype=dtype,
                inputs=(q, k, v, dout),
                reference=ref,
                causal=causal,
                scale=8**-0.5,
            )
        ]
    for strategy, (causal, layout) in itertools.product(
        ("token_ring", "ring", "bidir_ring"), ((True, "zigzag"), (False, "contiguous"))
    ):
        failures += _check_documents(outer, inner, strategy, causal, layout)
    return failures


@pytest.mark.parametrize(("outer", "inner"), [(2, 2), (1, 4), (4, 1)])
def test_hybrid_matches_oracle(outer: int, inner: int) -> None:
    per_rank = [found[f"{outer}x{inner}"] for found in _per_rank()]
    failures: list[Any] = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not failures, "\n".join(failures)


# -- the registry's schedule (pure) -----------------------------------------------------------

SPECS = [(2, 2), (1, 4), (4, 1)]  # outer x inner on 4 ranks


@pytest.mark.parametrize(("outer", "inner"), SPECS)
@pytest.mark.parametrize("outer_strategy", ["token_ring", "ring", "bidir_ring"])
@pytest.mark.parametrize(("causal", "layout"), [(True, "zigzag"), (False, "contiguous")])
@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_schedule_computes_every_needed_pair_once(
    outer: int, inner: int, outer_strategy: str, causal: bool, layout: str, pass_: str
) -> None:
    """Rows of the ring steps are rows of the outer shard (inner * s of them), whose positions
    come from the oracle's layout definition; heads from each piece's kv head range."""
    hq, hkv, s = 4, 4, 4
    p, seq = outer * inner, outer * inner * s
    sched = build_hybrid_schedule(
        pass_,
        spec=HybridSpec(inner=inner, outer_strategy=outer_strategy),
        layout=layout,
        causal=causal,
        world_size=p,
        seq_local=s,
        heads_q=hq,
        heads_kv=hkv,
    )
    computed: dict[int, list[tuple[int, int]]] = {h: [] for h in range(hq)}
    for g in range(p):
        for plan in sched.steps[g]:
            qpos = owned_positions(layout, plan.q_owner // inner, outer, seq)
            for piece in plan.pieces:
                assert piece.heads is not None, "every piece names its heads"
                kpos = owned_positions(layout, plan.kv_owners[piece.lane] // inner, outer, seq)
                for i, j in itertools.product(range(*piece.q_rows), range(*piece.kv_rows)):
                    if piece.causal and j - piece.kv_rows[0] > i - piece.q_rows[0]:
                        continue
                    for h in range(*piece.heads):  # kv heads; MHA: the same query heads
                        computed[h].append((qpos[i], kpos[j]))
    want = covered_pairs(layout, causal, p, s)
    for h in range(hq):
        assert sorted(computed[h]) == want, f"head {h}"
    assert sched.num_steps == outer + 2


def _inner_bytes(
    *, forward: bool, s: int, nq: int, nkv: int, dims: AttentionShape
) -> tuple[int, int]:
    """Bytes one rank sends each inner peer in the first and the last all-to-all: forward,
    q of the peer's nq heads and k, v of its nkv heads, then out and lse of my nq heads;
    backward, dout of the peer's heads, then dq, dk, dv of mine (all in the input dtype)."""
    b, d, e, a = dims.batch, dims.head_dim, dims.elem_bytes, dims.acc_bytes
    if forward:
        return b * s * (nq + 2 * nkv) * d * e, b * s * nq * (d * e + a)
    return b * s * nq * d * e, b * s * (nq + 2 * nkv) * d * e


@pytest.mark.parametrize(("outer", "inner"), SPECS)
@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_inner_all_to_all_bytes_match_closed_form(outer: int, inner: int, pass_: str) -> None:
    hq, hkv, s = 8, 4, 6
    dims = AttentionShape(batch=2, heads_q=hq, heads_kv=hkv, head_dim=16, dtype="bfloat16")
    sched = build_hybrid_schedule(
        pass_,
        spec=HybridSpec(inner=inner, outer_strategy="ring"),
        layout="zigzag",
        causal=True,
        world_size=outer * inner,
        seq_local=s,
        heads_q=hq,
        heads_kv=hkv,
    )
    last = sched.num_steps - 1
    first_b, last_b = _inner_bytes(
        forward=pass_ == "forward", s=s, nq=hq // inner, nkv=hkv // inner, dims=dims
    )
    for step, per_pair in ((0, first_b), (last, last_b)):
        got: dict[tuple[int, int], int] = {}
        for tr in sched.transfers:
            if tr.step == step:
                got[(tr.src, tr.dst)] = got.get((tr.src, tr.dst), 0) + tr.num_bytes(dims)
        want = {
            (g, (g // inner) * inner + j): per_pair
            for g in range(outer * inner)
            for j in range(inner)
            if j != g % inner
        }
        assert got == want, step


# -- real ranks ----------------------------------------------------------------------------


def hybrid_traffic() -> dict[str, Any]:
    """Bytes sent per global peer on the inner and the outer group (forward, backward)."""
    mesh = hybrid_mesh(2, 2)
    q = torch.randn(1, 4, 4, 8, requires_grad=True)
    kv = torch.randn(1, 4, 2, 8, requires_grad=True)
    comms = [
        (tokenring.get_communicator(g), dist.get_process_group_ranks(g))
        for g in (mesh.inner, mesh.outer)
    ]

    def sent() -> dict[int, int]:
        per_peer: dict[int, int] = {}
        for comm, ranks in comms:
            for (_, peer), num in comm.counter.sent_bytes.items():
                per_peer[ranks[peer]] = per_peer.get(ranks[peer], 0) + num
            comm.counter.reset()
        return per_peer

    sent()
    out = hybrid_attn(q, kv, kv, mesh=mesh, layout="zigzag", causal=True)
    fwd = sent()
    out.sum().backward()
    bwd = sent()
    uneven = torch.randn(1, 4, 3, 8)
    try:
        hybrid_attn(uneven, uneven, uneven, mesh=mesh)
        refused = "no error"
    except NotImplementedError as exc:
        refused = str(exc)
    # Calls the ranks disagree on must fail on every rank: the inner ranks of an island
    # (ranks 2o and 2o + 1) differ in causal, while each outer group agrees; and uneven
    # shards (S = 10: outer shards of 5, inner slices of 3 and 2) without seq_len.
    rank = dist.get_rank()
    x = torch.randn(1, 10, 4, 8)
    shards = hybrid_shard(
        x, outer_rank=rank // 2, inner_rank=rank % 2, outer=2, inner=2, layout="zigzag"
    )
    disagreements = []
    q_grad = q.detach().requires_grad_(rank != 3)  # rank 3 would build no backward
    for call in (
        lambda: hybrid_attn(q, kv, kv, mesh=mesh, layout="zigzag", causal=rank % 2 == 0),
        lambda: hybrid_attn(shards, shards, shards, mesh=mesh, layout="zigzag", causal=True),
        lambda: hybrid_attn(q_grad, kv.detach(), kv.detach(), mesh=mesh, layout="zigzag"),
        lambda: hybrid_attn(q[0], kv, kv, mesh=mesh),  # a rank's bad input: 3 dims
    ):
        try:
            call()
            disagreements.append("no error")
        except ValueError as exc:
            disagreements.append(str(exc))
    return {"fwd": fwd, "bwd": bwd, "refused": refused, "disagreements": disagreements}


def run_all() -> dict[str, Any]:
    """Every mesh shape of 4 ranks against the oracle, then the traffic check: one launch."""
    found: dict[str, Any] = {
        f"{outer}x{inner}": run_hybrid(outer, inner) for outer, inner in [(2, 2), (1, 4), (4, 1)]
    }
    found["traffic"] = hybrid_traffic()
    return found


@functools.cache
def _per_rank() -> tuple[dict[str, Any], ...]:
    """The one launch of 4 ranks that the real-rank tests read."""
    return tuple(tokenring.launch(run_all, world_size=4, timeout_s=600))


def test_counted_bytes_match_the_schedule_and_the_formula() -> None:
    """2 x 2, s = 4, Hq = 4, Hkv = 2, D = 8, float32: to its inner peer a rank sends the
    closed form of ``_inner_bytes`` per all-to-all; every byte counted on either group
    (mapped to global ranks) is a transfer of the registry's schedule, and vice versa."""
    s, hq, hkv = 4, 4, 2
    dims = AttentionShape(batch=1, heads_q=hq, heads_kv=hkv, head_dim=8, dtype="float32")
    per_rank = [found["traffic"] for found in _per_rank()]
    for rank, traffic in enumerate(per_rank):
        assert "q heads must be divisible by the inner size 2" in traffic["refused"]
        mixed, uneven, grads, bad = traffic["disagreements"]
        assert (
            "disagree on this hybrid attention call: causal: rank 0 has True, rank 1 has False"
            in mixed
        ), mixed
        assert "seq_local: rank 0 has 3, rank 1 has 2" in uneven, uneven
        # (group ranks: island 1's inner ranks 0, 1 are global ranks 2, 3)
        assert "disagree on this hybrid attention call: needs grad: rank 0 has True" in grads
        assert "q must have 4 dims (batch, seq_local, heads, head_dim)" in bad, bad
        for name, pass_ in (("fwd", "forward"), ("bwd", "backward")):
            sched = build_hybrid_schedule(
                pass_,
                spec=HybridSpec(inner=2, outer_strategy="token_ring"),
                layout="zigzag",
                causal=True,
                world_size=4,
                seq_local=s,
                heads_q=hq,
                heads_kv=hkv,
            )
            planned: dict[int, int] = {}
            for tr in sched.transfers:
                if tr.src == rank:
                    planned[tr.dst] = planned.get(tr.dst, 0) + tr.num_bytes(dims)
            assert traffic[name] == planned, (rank, name)
            first, last = _inner_bytes(forward=name == "fwd", s=s, nq=2, nkv=1, dims=dims)
            assert traffic[name][rank ^ 1] == first + last  # the inner peer only gets these


def test_hybrid_refuses_collective_outer_axis(single_rank_group: None) -> None:
    mesh = hybrid_mesh(1, 1)
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(NotImplementedError, match="must be a ring strategy"):
        hybrid_attn(q, q, q, mesh=mesh, outer_strategy="ulysses")
    with pytest.raises(ValueError, match="outer x inner must equal the world size 1"):
        hybrid_mesh(2, 1)
    with pytest.raises(
        ValueError,
        match=r"last_block_splits is read only by the pass-Q outer strategies .* got "
        r"last_block_splits=2 with outer_strategy='ring' \(leave it None\)",
    ):
        hybrid_attn(q, q, q, mesh=mesh, outer_strategy="ring", last_block_splits=2)
    with pytest.raises(ValueError, match="last_block_splits must be >= 1; got 0"):
        hybrid_attn(q, q, q, mesh=mesh, last_block_splits=0)
    with pytest.raises(ValueError, match=r"seq_dim must be an int in \[-4, 4\) for x of shape"):
        hybrid_shard(q, outer_rank=0, inner_rank=0, outer=1, inner=1, layout="zigzag", seq_dim=4)


def _bidir_token_ring_with_one_head_per_inner_rank() -> str:
    q = torch.randn(1, 4, 2, 8)
    try:
        hybrid_attn(q, q, q, mesh=hybrid_mesh(1, 2), outer_strategy="bidir_token_ring")
    except NotImplementedError as exc:
        return str(exc)
    return "no error"


def test_bidir_token_ring_outer_axis_names_the_heads_given_and_the_inner_size() -> None:
    # Before: "needs heads_q >= 2; got heads_q=1" for 2 query heads given (1 per inner rank).
    for message in tokenring.launch(_bidir_token_ring_with_one_head_per_inner_rank, world_size=2):
        assert "needs Hq >= 2 * P_in; got Hq=2 with inner size P_in=2" in message, message


def _mesh_whose_outer_groups_mix_inner_ranks() -> str:
    """Inner groups {0, 1}, {2, 3} but outer groups {0, 3}, {1, 2}: rank 0's outer ring
    partner holds the other half of the heads."""
    rank = dist.get_rank()
    inner = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    outer = [dist.new_group([0, 3]), dist.new_group([1, 2])][rank in (1, 2)]
    mesh = HybridMesh(outer=outer, inner=inner)
    where = {"outer_rank": dist.get_rank(outer), "inner_rank": dist.get_rank(inner)}
    q, k, v, _ = make_inputs(seed=1, batch=1, seq_global=16, heads_q=4, heads_kv=4, head_dim=8)
    ref = oracle_with_grads(q, k, v, torch.zeros_like(q), causal=True, scale=8**-0.5)["out"]
    part = functools.partial(hybrid_shard, **where, outer=2, inner=2, layout="zigzag")
    try:
        out = hybrid_attn(part(q), part(k), part(v), mesh=mesh, causal=True, layout="zigzag")
    except ValueError as exc:
        return str(exc)
    return f"no error; distance from the oracle {float((out - part(ref)).abs().max()):.3g}"


def test_a_mesh_whose_outer_groups_mix_inner_ranks_is_refused() -> None:
    # Before: every rank returned, three of them up to 2.8 away from the oracle.
    for message in tokenring.launch(_mesh_whose_outer_groups_mix_inner_ranks, world_size=4):
        assert "inner rank (one per outer group): rank 0 has" in message, message


def test_bidirectional_tokenring_outer_axis_names_the_callers_head_count() -> None:
    """An island's queries are heads_q / inner heads; bidir_token_ring needs two of them. The
    refusal names the caller's heads_q and inner, not the per-island 1 (which the caller
    never passed)."""
    spec = HybridSpec(inner=2, outer_strategy="bidir_token_ring")
    call = dict(spec=spec, layout="zigzag", causal=True, world_size=4, seq_local=4)
    with pytest.raises(NotImplementedError, match=r"heads_q=2, inner=2") as info:
        build_hybrid_schedule("forward", heads_q=2, heads_kv=2, **call)
    assert "heads_q=1" not in str(info.value)
    assert build_hybrid_schedule("forward", heads_q=4, heads_kv=2, **call).num_steps == 4


def _outer_messages_per_split() -> dict[str, object]:
    """Messages the outer group's communicator counts for one TokenRing hybrid forward with
    ``last_block_splits`` left to the transport or given, its path, and the distance from
    the oracle (2 outer x 1 inner: every message is the outer ring's)."""
    rank = dist.get_rank()
    mesh = hybrid_mesh(2, 1)
    seq = 64
    q, k, v, _ = make_inputs(seed=11, batch=1, seq_global=seq, heads_q=4, heads_kv=2, head_dim=8)
    want = oracle_with_grads(q, k, v, torch.zeros_like(q), causal=True, scale=8**-0.5)["out"]
    idx = torch.tensor(_positions("zigzag", rank, 0, 2, 1, seq), dtype=torch.long)
    outer = tokenring.get_communicator(mesh.outer)
    found: dict[str, object] = {"path": outer.path(q.device)}
    for splits in (None, 1, 2):
        outer.counter.reset()
        out = hybrid_attn(
            *(x[:, idx] for x in (q, k, v)), mesh=mesh, outer_strategy="token_ring",
            causal=True, layout="zigzag", last_block_splits=splits,
        )  # fmt: skip
        found[str(splits)] = outer.counter.sent_messages
        found[f"{splits} error"] = float((out - want[:, idx]).abs().max())
    return found


@pytest.mark.parametrize("shared_memory", ["1", "0"])
def test_the_outer_ring_takes_the_transports_last_block_slices(
    shared_memory: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Note [Last block slices] in tokenring.api holds for ``hybrid_attn``'s outer ring: left
    to the transport, its last block returns whole through shared memory and in two slices
    over sockets (one message more); an int given is used; every result is the oracle's."""
    # read when a communicator is made, so forked ranks take it from the launcher's
    # environment (Note [Rank start] in tokenring.launch): no fresh interpreters
    monkeypatch.setenv("TOKENRING_SHARED_MEMORY", shared_memory)
    for rank, found in enumerate(tokenring.launch(_outer_messages_per_split, world_size=2)):
        assert found["path"] == ("gloo-shm" if shared_memory == "1" else "gloo"), found
        assert found["2"] == found["1"] + 1, (rank, found)
        assert found["None"] == found["1" if shared_memory == "1" else "2"], (rank, found)
        assert max(v for key, v in found.items() if key.endswith("error")) < 1e-10, found


def _hybrid_on(device: str) -> list[str]:
    """2 x 2 on one ``device`` (CUDA: tensors over gloo, staged): each outer strategy, any length
    with documents, a window and chunks, float64 and bfloat16, forward and backward."""
    outer_rank, inner_rank = divmod(dist.get_rank(), 2)
    mesh = hybrid_mesh(2, 2)
    failures = []
    seq, docs, chunk = 26, [0, 9, 26], 4
    for strategy, dtype in itertools.product(
        ("token_ring", "ring", "bidir_ring", "bidir_token_ring"), (torch.float64, torch.bfloat16)
    ):
        q, k, v, dout = make_inputs(
            seed=seq, batch=2, seq_global=seq, heads_q=8, heads_kv=4, head_dim=8
        )
        mask = visible_mask(seq, causal=True, cu_seqlens=docs, window=(3, 0), chunk=chunk)
        ref = oracle_with_grads(q, k, v, dout, causal=True, scale=8**-0.5, mask=mask, dtype=dtype)
        idx = torch.tensor(_positions("zigzag", outer_rank, inner_rank, 2, 2, seq, docs))
        local = [x[:, idx].to(device, dtype).requires_grad_(True) for x in (q, k, v)]
        out, lse = hybrid_attn(
            *local, mesh=mesh, outer_strategy=strategy, causal=True, layout="zigzag",
            return_lse=True, seq_len=seq, cu_seqlens=docs, window_size=(3, 0),
            attention_chunk_size=chunk,
        )  # fmt: skip
        out.backward(dout[:, idx].to(device, dtype))
        got = {"out": out.detach(), "lse": lse, "dq": local[0].grad}
        got = {n: x.cpu() for n, x in (got | {"dk": local[1].grad, "dv": local[2].grad}).items()}
        want = {n: ref[n][:, :, idx] if n == "lse" else ref[n][:, idx] for n in got}
        failures += [
            f"{strategy} {dtype}: {f}"
            for f in tolerance_failures(
                got,
                want,
                dtype=dtype,
                inputs=(q, k, v, dout),
                reference=ref,
                causal=True,
                scale=8**-0.5,
                mask=mask,
            )
        ]
    return failures


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hybrid_on_cuda_matches_oracle() -> None:
    failures = tokenring.launch(_hybrid_on, "cuda", world_size=4, timeout_s=300, pg_timeout_s=120)
    assert not any(failures), failures
