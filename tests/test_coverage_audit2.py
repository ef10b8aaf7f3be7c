"""Audit of statements the rest of the suite never ran (second part): each reached here and
checked against an independent oracle or the documented error.

- The simulator's islands (``Hardware.devices_per_node`` / ``inter``) in the vectorised
  engine: islands of one device each price exactly as a machine wired by ``inter`` alone, one
  island of every rank exactly as no islands (both engines); Ring's forward over two islands
  with free compute is (P - 1) x (inter latency + K/V bytes / inter link), by hand; on the
  h100-ib-islands preset the vectorised engine within the range its Note states of the event
  engine, the busiest resource and bytes exactly.
- transformers: a model whose forward takes position_ids through ``**kwargs`` (a wrapper
  model) is checked with what its kwargs hold (before: the entry was read, never run by a
  test; given none it said "takes no position_ids ... cannot be split"); labels that are bad
  on one rank (the labels loss raised on that rank alone, the others waited out the
  communicator's timeout); the hf helpers' errors on one rank reach every rank at once.
- ``MaskSpec.classify`` and ``trim`` of pairs that see nothing (empty runs, other
  documents: the schedule builder classifies only trimmed runs) against visibility pair by pair.

Legend: B batch, S global seq, P world size.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring
from tokenring.core.schedule import AttentionShape
from tokenring.model.costmodel import PRESETS, Hardware, Interconnect
from tokenring.model.simulate import simulate_pass

GQA = AttentionShape(batch=1, heads_q=8, heads_kv=2, head_dim=64, dtype="bfloat16")
INTRA = Interconnect(
    topology="switch", link_bandwidth_bytes_per_s=2e9, port_bandwidth_bytes_per_s=3e9,
    latency_s=2e-6,
)  # fmt: skip
INTER = Interconnect(
    topology="switch", link_bandwidth_bytes_per_s=1e8, port_bandwidth_bytes_per_s=1.5e8,
    latency_s=9e-6,
)  # fmt: skip


def _machine(net: Interconnect, **islands: Any) -> Hardware:
    return Hardware(
        name="islands-test", interconnect=net, forward_flops_per_s=1e12,
        backward_flops_per_s=0.8e12, memory_bandwidth_bytes_per_s=1e11, **islands,
    )  # fmt: skip


def _priced(result: Any) -> tuple[Any, ...]:
    """What a pass prices; a NIC named as the port it stands for."""
    name = result.busiest_resource.replace("nic_", "port_")
    return (result.call_s, result.step_s, result.exposed_s, name, result.busiest_bytes,
            result.busiest_s, result.travel_bytes, result.return_bytes)  # fmt: skip


@pytest.mark.parametrize("mode", ["event", "vectorised"])
def test_islands_of_one_device_or_of_all_price_as_no_islands(mode: str) -> None:
    """P = 6. devices_per_node=1: every flow runs between islands, so the machine is ``inter``
    alone; devices_per_node=6: none does, so it is ``interconnect`` alone. Exactly equal."""
    for strategy, pass_, (layout, causal) in itertools.product(
        ("token_ring", "ring"), ("forward", "backward"), (("zigzag", True), ("contiguous", False))
    ):
        kw: dict[str, Any] = dict(layout=layout, causal=causal, world_size=6, seq_local=256)
        kw |= dict(shape=GQA, mode=mode)
        case = (strategy, pass_, layout)
        alone = simulate_pass(strategy, pass_, hardware=_machine(INTER), **kw)
        apart = simulate_pass(
            strategy, pass_, hardware=_machine(INTRA, devices_per_node=1, inter=INTER), **kw
        )
        assert _priced(apart) == _priced(alone), case
        inside = simulate_pass(strategy, pass_, hardware=_machine(INTRA), **kw)
        together = simulate_pass(
            strategy, pass_, hardware=_machine(INTRA, devices_per_node=6, inter=INTER), **kw
        )
        assert _priced(together) == _priced(inside), case


@pytest.mark.parametrize("mode", ["event", "vectorised"])
def test_ring_forward_over_two_islands_by_hand(mode: str) -> None:
    """P = 4 as 2 islands of 2, MHA, non-causal contiguous, compute and memory free: each of
    Ring's 3 sends moves K and V (b = 2 s H D e bytes) to r - 1, and the pairs (2, 1) and
    (0, 3) cross islands, so every step is latency_inter + b / link_inter; the busiest
    resource is link 0->3 with 3 b bytes."""
    mha = AttentionShape(batch=1, heads_q=4, heads_kv=4, head_dim=64, dtype="bfloat16")
    s, lat, link = 256, 5e-6, 1e9
    hw = Hardware(
        name="two-islands",
        interconnect=Interconnect(topology="mesh", link_bandwidth_bytes_per_s=4e9, latency_s=1e-6),
        devices_per_node=2,
        inter=Interconnect(
            topology="switch", link_bandwidth_bytes_per_s=link, port_bandwidth_bytes_per_s=link,
            latency_s=lat,
        ),
        forward_flops_per_s=1e20, backward_flops_per_s=1e20, memory_bandwidth_bytes_per_s=1e20,
    )  # fmt: skip
    got = simulate_pass(
        "ring", "forward", layout="contiguous", causal=False, world_size=4, seq_local=s,
        shape=mha, hardware=hw, mode=mode,
    )  # fmt: skip
    b = 2 * s * 4 * 64 * 2
    assert got.call_s == pytest.approx(3 * (lat + b / link), rel=1e-9)
    assert got.step_s[:3] == pytest.approx([lat + b / link] * 3, rel=1e-9)
    assert (got.busiest_resource, got.busiest_bytes) == ("link0->3", 3 * b)


def test_vectorised_engine_on_islands_agrees_with_the_event_engine() -> None:
    """h100-ib-islands, P = 16 (2 islands), 32/8 GQA: Ring within 2% of the event engine
    (the oracle), TokenRing within the 0.85-1.16x its Note states, and both the same busiest
    resource and bytes, and the same travel and return bytes."""
    hw = PRESETS["h100-ib-islands"]
    shape = AttentionShape(batch=1, heads_q=32, heads_kv=8, head_dim=128, dtype="bfloat16")
    for strategy, pass_, (layout, causal) in itertools.product(
        ("token_ring", "ring"), ("forward", "backward"), (("contiguous", False), ("zigzag", True))
    ):
        kw: dict[str, Any] = dict(layout=layout, causal=causal, world_size=16, seq_local=1024)
        event, vec = (
            simulate_pass(strategy, pass_, shape=shape, hardware=hw, mode=mode, **kw)
            for mode in ("event", "vectorised")
        )
        case = (strategy, pass_, layout)
        low, high = (0.98, 1.02) if strategy == "ring" else (0.85, 1.16)
        assert low <= vec.call_s / event.call_s <= high, (case, vec.call_s / event.call_s)
        assert vec.busiest_resource == event.busiest_resource, case
        assert vec.busiest_s == pytest.approx(event.busiest_s, rel=1e-9), case
        assert (vec.travel_bytes, vec.return_bytes) == (event.travel_bytes, event.return_bytes)


# -- transformers ---------------------------------------------------------------------------------

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'tokenring-attention[hf]')"
)
from tokenring import hf  # noqa: E402


def _wrapped_bert() -> tuple[Any, Any]:
    """BERT (which hands attention no position_ids) with SDPA, and the same weights with
    tokenring attention inside a PreTrainedModel whose forward takes ``**kwargs`` only."""
    import test_hf_architectures as arch

    oracle, bert = arch._models("bert", torch.float64, encoder=True)

    class Wrapper(transformers.PreTrainedModel):  # type: ignore[misc]
        config_class = type(bert.config)

        def __init__(self, inner: Any) -> None:
            super().__init__(inner.config)
            self.inner = inner

        def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
            return self.inner(input_ids=input_ids, **kwargs)

    return oracle, Wrapper(bert).double().eval()


def _raised(call: Callable[[], object]) -> tuple[str, float]:
    start = time.perf_counter()
    try:
        call()
        message = "no error"
    except (ValueError, NotImplementedError) as exc:
        message = f"{type(exc).__name__}: {exc}"
    return message, time.perf_counter() - start


def rank_hf() -> dict[str, Any]:
    """Inside a rank: the wrapped BERT given position_ids in its kwargs, none, and off by one
    on rank 1; calls bad on rank 1 only (each: its message and seconds)."""
    import test_hf_architectures as arch

    rank = dist.get_rank()
    _, model = _wrapped_bert()
    sp = hf.SequenceParallel(layout="contiguous")
    ids = arch._input_ids()  # (B, S)
    batch = hf.shard_batch(sp, ids)
    out: dict[str, Any] = {}
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                       sequence_parallel=sp).logits  # fmt: skip
        out["gathered"] = hf.gather_sequence(sp, logits)
        out["none"] = _raised(lambda: model(input_ids=batch.input_ids, sequence_parallel=sp))
        off = batch.position_ids + rank
        out["off"] = _raised(
            lambda: model(input_ids=batch.input_ids, position_ids=off, sequence_parallel=sp)
        )
    hf.register()
    _, llama = arch._models("llama", torch.float64)
    bad = rank == 1
    calls: dict[str, Callable[[], object]] = {
        "labels 1-D": lambda: llama(
            input_ids=batch.input_ids, position_ids=batch.position_ids,
            labels=ids[0] if bad else ids, sequence_parallel=sp,
        ),
        "labels batch": lambda: llama(
            input_ids=batch.input_ids, position_ids=batch.position_ids,
            labels=ids.repeat(2, 1) if bad else ids, sequence_parallel=sp,
        ),
        "seq_dim": lambda: hf.gather_sequence(sp, batch.input_ids, seq_dim="1" if bad else 1),
        "logits": lambda: hf.causal_lm_loss(sp, "logits" if bad else logits, batch.input_ids),
        "parameters": lambda: hf.all_reduce_gradients(sp, [torch.zeros(2), 3] if bad else []),
        "batch": lambda: hf.broadcast_batch(sp, "ids" if bad else {"ids": ids}),
    }  # fmt: skip
    with torch.no_grad():
        for what, call in calls.items():
            out[what] = _raised(call)
    return out


# what each rank's error names: (rank 1's, the others')
ONE_BAD_RANK = {
    "labels 1-D": ("labels must have shape (batch=2, seq); got (16,)", "rank 1 cannot run"),
    "labels batch": ("labels must have shape (batch=2, seq); got (4, 16)", "rank 1 cannot run"),
    "seq_dim": ("seq_dim must be an int; got '1'", "rank 1 cannot run"),
    "logits": ("logits must be a tensor; got str", "rank 1 cannot run"),
    "parameters": ("parameters must be tensors; got parameters[1]=3", "rank 1 cannot run"),
    "batch": ("rank 1: batch must be a mapping of names to tensors; got str",) * 2,
}


def test_hf_positions_through_kwargs_and_errors_of_one_rank() -> None:
    """2 ranks. A model forward taking position_ids through ``**kwargs``: given shard_batch's,
    its logits are BERT's own SDPA in one process within 1e-10; given none, every rank says it
    was given none (it said the forward takes none and the model cannot be split); off by one
    on rank 1, every rank names the offsets. Labels of a wrong shape on rank 1 only: rank 1
    raised, rank 0 waited out the communicator's timeout (300 s) in the labels' length
    exchange; now both raise at once. The other helpers' one-rank errors likewise."""
    import test_hf_architectures as arch

    per_rank = tokenring.launch(rank_hf, world_size=2, timeout_s=240)
    oracle, _ = _wrapped_bert()
    with torch.no_grad():
        want = oracle(arch._input_ids()).logits  # (B, S, V)
    for rank, got in enumerate(per_rank):
        err = float((got["gathered"] - want).abs().max())
        assert err <= 1e-10, f"rank {rank}: logits off one process by {err}"
        message, _ = got["none"]
        assert "Wrapper.forward was given no position_ids on rank(s) [0, 1]" in message, message
        message, _ = got["off"]
        assert "offsets of the rows, by rank: {0: [0], 1: [1]}" in message, message
        for what, names in ONE_BAD_RANK.items():
            message, seconds = got[what]
            want_part = names[0] if rank == 1 else names[1]
            assert message.startswith("ValueError") and want_part in message, (rank, message)
            assert names[0] in message, (rank, what, message)
            assert seconds < 5, f"rank {rank} {what}: raised after {seconds:.1f} s"


# -- mask classes ---------------------------------------------------------------------------------


def test_mask_classify_and_trim_match_brute_force() -> None:
    """``MaskSpec.classify`` and ``trim`` on every pair of short runs (empty ones, other
    documents and pairs no query reaches included: their branches never ran, the schedule
    builder only classifies trimmed runs) against visibility written out pair by pair."""
    from tokenring.core.layout import Run
    from tokenring.core.masks import MaskKind, MaskSpec

    runs = [(start, length) for start in range(0, 7, 2) for length in range(4)]
    for causal, window, (qa, ql), (ka, kl), kv_doc in itertools.product(
        (True, False), ((-1, -1), (2, 0), (1, 3), (0, 0)), runs, runs, (0, 1)
    ):
        mask = MaskSpec(causal=causal, window=window)
        left, right = window[0], 0 if causal else window[1]

        pairs = [(i, j) for i in range(qa, qa + ql) for j in range(ka, ka + kl)]
        vis = [
            (i, j)
            for i, j in pairs
            if kv_doc == 0 and (left < 0 or i - j <= left) and (right < 0 or j - i <= right)
        ]
        q_run, kv_run = Run(10, ql, qa, 0), Run(20, kl, ka, kv_doc)
        case = (causal, window, (qa, ql), (ka, kl), kv_doc)
        if not vis:
            assert mask.trim(q_run, kv_run) is None, case
            assert mask.classify(q_run, kv_run) is MaskKind.EMPTY, case
            continue
        qs, ks = sorted({i for i, _ in vis}), sorted({j for _, j in vis})
        want_trim = (
            Run(10 + qs[0] - qa, qs[-1] - qs[0] + 1, qs[0], 0),
            Run(20 + ks[0] - ka, ks[-1] - ks[0] + 1, ks[0], kv_doc),
        )
        assert mask.trim(q_run, kv_run) == want_trim, case
        if len(vis) == len(pairs):
            want = MaskKind.FULL
        elif (qa, ql) == (ka, kl) and set(vis) == {(i, j) for i, j in pairs if j <= i}:
            want = MaskKind.CAUSAL
        else:
            want = MaskKind.MASKED
        assert mask.classify(q_run, kv_run) is want, case
