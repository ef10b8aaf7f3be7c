"""Ranks agree before they communicate: a rank's bad input, a differing option, a frozen or a
dead rank end as a clear error on every rank within seconds, never as a wrong number or a wait
for the process group's timeout (Note [Rank agreement] in tokenring.api, Note [Message header]
in tokenring.runtime.comm).

Each case runs on real gloo ranks; every rank writes what happened to it (its error, its
output's distance from the float64 oracle, how long it took) to a file, so the test sees every
rank, also when the launcher ends the job because one rank died.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring
from oracle import full_attention, sharded_positions
from tokenring.core.sketch import replicated_rtol, sketch
from tokenring.launch import LaunchError

S, H, D = 64, 4, 16
FROZEN_WAIT_S = 1.5  # the timeout of the ranks that wait for a frozen one


def _case(case: str, out_dir: str) -> None:
    """One rank of ``case``; writes ``{rank}.json`` with ok/err or error and elapsed_s."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # The library's timeout (3 s) is far below the process group's (60 s, see the launch).
    comm = tokenring.Communicator(None, timeout_s=3)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, S, H, D, dtype=torch.float64) for _ in range(3))
    ref, _ = full_attention(q, k, v, causal=True, scale=D**-0.5)
    rows = sharded_positions("zigzag", rank, world, S)
    q_r, k_r, v_r = (x[:, rows] for x in (q, k, v))
    options: dict = {"causal": True, "layout": "zigzag", "group": comm}
    if case == "splits":  # an option that changes the schedule, on one rank only
        options["last_block_splits"] = 4 if rank == 1 else 2
    elif case == "last pair":  # lending changes the schedule: one rank asking for it
        options["last_pair"] = "lend" if rank == 1 else None
    elif case == "splits unchecked":
        options.update(last_block_splits=4 if rank == 1 else 2, check_ranks=False)
    elif case == "bad input":  # a different invalid input on ranks 1, 2 and 3; rank 0 is fine
        if rank == 1:
            k_r, v_r = k_r[:, :, :3], v_r[:, :, :3]  # heads_kv 3 does not divide heads_q 4
        elif rank == 2:
            q_r, k_r, v_r = (x[:, :-1] for x in (q_r, k_r, v_r))  # odd zigzag length
        elif rank == 3:
            options["seq_len"] = S + 8  # a seq_len whose share is not this rank's length
    elif case == "frozen" and rank == 2:
        _frozen_until_the_others_gave_up(out_dir, [0, 1, 3])  # they give up after 1.5 s
    elif case == "frozen":  # the ranks that wait for it: a shorter timeout, to wait less;
        # rank 2 keeps 3 s, so that it learning at once stays apart from its own timeout
        comm.timeout = timedelta(seconds=FROZEN_WAIT_S)
    elif case == "dead" and rank == 2:
        os._exit(0)  # died before the call
    start = time.monotonic()
    result: dict = {"rank": rank}
    try:
        out = tokenring.token_ring_attn(q_r, k_r, v_r, **options)
        result.update(ok=True, err=(out - ref[:, rows]).abs().max().item())
    except Exception as exc:
        result.update(ok=False, type=type(exc).__name__, error=str(exc))
    result["elapsed_s"] = time.monotonic() - start
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))


def _frozen_until_the_others_gave_up(out_dir: str, others: list[int]) -> None:
    """Sleep until every rank of ``others`` has written its result (it gave up: 3 s) and then
    0.5 s more, as it leaves for the launch's end (before: a fixed 8 s sleep, most of it
    waited out after they had given up); 60 s at most."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(Path(out_dir, f"{r}.json").exists() for r in others):
            time.sleep(0.5)
            return
        time.sleep(0.05)


def _cases(cases: list[str], out_dir: str) -> None:
    """Several cases one after the other in the same ranks (each on a fresh communicator)."""
    for case in cases:
        Path(out_dir, case).mkdir(exist_ok=True)
        _case(case, str(Path(out_dir, case)))


def _results(out_dir: Path) -> dict[int, dict]:
    return {int(p.stem): json.loads(p.read_text()) for p in out_dir.glob("*.json")}


def _run(case: str, tmp_path: Path, *, allow_launch_error: bool = False) -> dict[int, dict]:
    try:
        tokenring.launch(_case, case, str(tmp_path), world_size=4, timeout_s=90, pg_timeout_s=60)
    except LaunchError:
        if not allow_launch_error:
            raise
    return _results(tmp_path)


RAISING_CASES = ["splits", "last pair", "bad input"]
CACHE_CASES = ["step", "attn", "strategy"]


def _raising_cases(out_dir: str) -> None:
    _cases(RAISING_CASES, out_dir)
    _cache_cases(CACHE_CASES, str(Path(out_dir, "cache")))
    _repeated_calls(str(Path(out_dir, "repeated")))


@pytest.fixture(scope="module")
def raising_cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, Any]]:
    """The cases that end in a ValueError on every rank (and leave the ranks running) share
    one launch: the attention calls', then the cached path's (under "cache/"), then the
    repeated calls of :func:`_repeated_calls` (under "repeated")."""
    out_dir = tmp_path_factory.mktemp("raising")
    Path(out_dir, "cache").mkdir()
    Path(out_dir, "repeated").mkdir()
    tokenring.launch(_raising_cases, str(out_dir), world_size=4, timeout_s=120, pg_timeout_s=60)
    found: dict[str, dict[int, Any]] = {case: _results(out_dir / case) for case in RAISING_CASES}
    found |= {f"cache/{case}": _results(out_dir / "cache" / case) for case in CACHE_CASES}
    found["repeated"] = _results(out_dir / "repeated")
    return found


def test_an_option_on_one_rank_fails_on_every_rank_naming_it(raising_cases: dict) -> None:
    results = raising_cases["splits"]
    assert sorted(results) == [0, 1, 2, 3]
    for r in results.values():
        assert not r["ok"] and r["type"] == "ValueError"
        assert (
            "ranks disagree on this attention call: last_block_splits: rank 0 has 2, rank 1 has 4"
            in r["error"]
        )
        assert r["elapsed_s"] < 2.5  # the agreement, not a timeout (3 s)
    for r in raising_cases["last pair"].values():
        assert not r["ok"] and r["type"] == "ValueError"
        assert (
            "ranks disagree on this attention call: last_pair: rank 0 has None, rank 1 has"
            in (r["error"])
        )


def test_unchecked_mismatch_is_never_a_wrong_number(tmp_path: Path) -> None:
    """With check_ranks=False the message header is the last line of defence: ranks whose
    messages differ fail (a shorter message raises, a longer one makes gloo abort the
    receiving process), the rest are right; nobody returns a wrong number."""
    results = _run("splits unchecked", tmp_path, allow_launch_error=True)
    assert len(results) < 4 or not all(r["ok"] for r in results.values())
    for r in results.values():
        if r["ok"]:
            assert r["err"] < 1e-10, r


def _short_message(case: str, shared_memory: bool = False) -> str:
    """Rank 0 sends a message that differs from what rank 1 posted a receive for."""
    from tokenring.core.schedule import Payload, Transfer

    comm = tokenring.Communicator(None, timeout_s=10, shared_memory=shared_memory)
    if case == "other layout":  # over sockets the sender's last frame is left unmatched: its
        comm.timeout = timedelta(seconds=1)  # send times out (built with 10 s, as ranks arrive)
    assert comm.path(torch.device("cpu")) == ("gloo-shm" if shared_memory else "gloo")
    expected = Transfer(
        payload=Payload.Q, src=0, dst=1, owner=0, rows=(0, 8), step=0, after_segments=0
    )
    sent = expected
    if case == "shorter":
        sent = Transfer(
            payload=Payload.Q, src=0, dst=1, owner=0, rows=(0, 4), step=0, after_segments=0
        )
    elif case == "other transfer":  # same size, another step
        sent = Transfer(
            payload=Payload.Q, src=0, dst=1, owner=0, rows=(0, 8), step=1, after_segments=0
        )
    # "framed": two fields over APART_MIN_BYTES, each a frame of its own (Note [Message
    # frames]); "other layout": the same bytes in three frames
    framed = case in ("same, framed", "other layout")
    width = 2048 if framed else 4
    data = torch.arange(16 * width, dtype=torch.float32).view(1, 8, 2, width)
    fields = [((1, 8, 2, width), torch.float32)]
    tensors = [data[:, : sent.num_rows]]
    if framed:
        data = torch.stack([data, -data])
        fields, tensors = fields * 2, list(data)
    if case == "other layout":
        tensors = [data[0, :, :4], data[0, :, 4:], data[1]]
    if comm.rank == 0:
        comm.exchange([(sent, tensors)], [], device=torch.device("cpu"))
        try:
            comm.wait_sends()
        except RuntimeError as exc:
            return str(exc)
        return "sent"
    pending = comm.exchange([], [(expected, fields)], device=torch.device("cpu"))
    try:
        got = torch.stack(pending[expected].wait())
    except RuntimeError as exc:
        return str(exc)
    if not framed:
        got = got[0]
    return "equal" if torch.equal(got, data) else "DIFFERENT DATA"


def _short_messages(cases: list[str], shared_memory: bool = False) -> list[str]:
    return [_short_message(case, shared_memory) for case in cases]


def test_a_receive_checks_the_bytes_that_arrived() -> None:
    """One launch; the shorter message last (the receiver leaves its tail unread)."""
    expected = {
        "same": "equal",
        "other transfer": "rank 0 sent a different transfer of the same size",
        "shorter": (
            "rank 1: receive of 'q' rows (0, 8) of owner 0 from rank 0 at step 0: the message "
            "carries 128 payload bytes, this rank expected 256"
        ),
    }
    _, messages = tokenring.launch(_short_messages, list(expected), world_size=2, timeout_s=60)
    for (case, want), got in zip(expected.items(), messages, strict=True):
        assert want in got, (case, got)


FRAME_CASES = {
    "same, framed": "equal",
    "other layout": "the message's fields have other sizes than this rank expected",
}


@pytest.fixture(scope="module")
def waiting_launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Future[Any]]:
    """The launches that mostly wait, all at once: the frozen rank's (its peers wait out
    1.5 s, it sleeps until they gave up) and the frames' over each transport (over sockets a
    send waits out its timeout). Each test reads its own launch's outcome."""
    tmp = tmp_path_factory.mktemp("frozen")
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures: dict[str, Future[Any]] = {"frozen": pool.submit(_run, "frozen", tmp)}
        for shared_memory in (False, True):
            futures[f"frames shared_memory={shared_memory}"] = pool.submit(
                tokenring.launch, _short_messages, list(FRAME_CASES), shared_memory,
                world_size=2, timeout_s=60,
            )  # fmt: skip
    return futures


@pytest.mark.parametrize("shared_memory", [False, True], ids=["sockets", "shared memory"])
def test_a_receive_checks_the_sizes_of_its_frames(
    shared_memory: bool, waiting_launches: dict[str, Future[Any]]
) -> None:
    """A message whose big fields travel as frames of their own (Note [Message frames] in
    tokenring.runtime.comm) arrives whole; the same bytes in other frames raise, from the
    header frame, before the receiver waits for the rest. Over sockets the sender's frame that
    nobody receives fails its send within the timeout; through shared memory only the header
    travels over gloo, so the send completes. One launch; the mismatch last."""
    sender, messages = waiting_launches[f"frames shared_memory={shared_memory}"].result()
    for (case, want), got in zip(FRAME_CASES.items(), messages, strict=True):
        assert want in got, (case, got)
    assert sender[0] == "sent"
    if shared_memory:
        assert sender[1] == "sent"
    else:
        assert "send of 'q' rows (0, 8) of owner 0 to rank 1 at step 0 failed" in sender[1]


def test_bad_input_on_some_ranks_fails_everywhere_within_seconds(raising_cases: dict) -> None:
    results = raising_cases["bad input"]
    reasons = {
        1: "heads_kv must divide heads_q; got heads_q=4, heads_kv=3",
        2: "q.shape[1] (seq_local) must be even for layout 'zigzag'",
        3: "q.shape[1] must be 18 on rank 3: its share of seq_len=72",
    }
    assert sorted(results) == [0, 1, 2, 3]
    for rank, r in results.items():
        assert not r["ok"] and r["type"] == "ValueError", r
        assert r["elapsed_s"] < 2.5
        if rank in reasons:  # the rank's own error, as on one rank
            assert reasons[rank] in r["error"]
        else:  # the others name every failing rank and its reason
            for other, why in reasons.items():
                assert f"rank {other} cannot run this attention call: {why}" in r["error"]


def test_a_frozen_rank_is_named_within_the_library_timeout(
    waiting_launches: dict[str, Future[Any]],
) -> None:
    results = waiting_launches["frozen"].result()
    for rank in (0, 1, 3):
        r = results[rank]
        assert not r["ok"] and "rank(s) [2] did not arrive within 1.5 s" in r["error"], r
        assert 1.0 < r["elapsed_s"] < 4.5  # the library's 1.5 s, not the group's 60 s
    # When rank 2 wakes up, the others have given up and exited: it learns so at once.
    assert not results[2]["ok"] and "gone" in results[2]["error"], results[2]
    assert results[2]["elapsed_s"] < 2.5


def _deferred(shared_memory: bool) -> dict[str, str]:
    """Deferred checks (Note [Deferred agreement]) whose ranks agree or differ, completed by a
    failing block (``settled_on_error``), by the next collective, or left pending at close."""
    rank = dist.get_rank()
    outcomes = {}
    for differ, end in itertools.product((False, True), ("error", "barrier", "close")):
        comm = tokenring.Communicator(None, timeout_s=10, shared_memory=shared_memory)
        signature = {"option": int(differ and rank == 1)}
        comm.agreed(lambda sig=signature: (None, sig), what="test call", deferred=True)
        try:
            if end == "error":
                with comm.settled_on_error():
                    raise KeyError("local failure")
            elif end == "barrier":
                comm.barrier(label="after the call")
            else:
                comm.close()
            outcome = "ok"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        outcomes[f"{'differ' if differ else 'agree'} {end}"] = outcome
        dist.barrier()  # the ranks close their communicators together
        comm.close()
    return outcomes


@pytest.mark.parametrize("shared_memory", [False, True], ids=["sockets", "shared_memory"])
def test_a_deferred_check_raises_the_disagreement_first(shared_memory: bool) -> None:
    """A deferred check completes at the next collective or when the call fails: a
    disagreement is what every rank raises, a local error when the ranks agree."""
    disagree = "ValueError: ranks disagree on this test call: option: rank 0 has 0, rank 1 has 1"
    for outcomes in tokenring.launch(_deferred, shared_memory, world_size=2, timeout_s=120):
        assert outcomes["agree error"] == "KeyError: 'local failure'", outcomes
        assert outcomes["differ error"] == disagree, outcomes
        assert outcomes["agree barrier"] == "ok" and outcomes["differ barrier"] == disagree
        assert outcomes["agree close"] == outcomes["differ close"] == "ok", outcomes


def test_a_dead_rank_is_named_at_once(tmp_path: Path) -> None:
    results = _run("dead", tmp_path, allow_launch_error=True)
    assert sorted(results) == [0, 1, 3]
    for r in results.values():
        assert not r["ok"] and "rank 2 is gone (it exited or crashed)" in r["error"], r
        assert r["elapsed_s"] < 2.5


def _cache_cases(cases: list[str], out_dir: str) -> None:
    for case in cases:
        Path(out_dir, case).mkdir(exist_ok=True)
        _cache_case(case, str(Path(out_dir, case)))


def _cache_case(case: str, out_dir: str) -> None:
    """The cached (inference) path agrees the same way: begin_step and cached_attn."""
    from tokenring.inference import cached_attn

    rank = dist.get_rank()
    comm = tokenring.Communicator(None, timeout_s=3)
    cache = tokenring.DistributedKVCache(
        num_layers=1, batch=1, heads_kv=2, head_dim=8, block_size=4, group=comm
    )
    start = time.monotonic()
    result: dict = {"rank": rank}
    try:
        new = [8]
        if case == "step" and rank == 1:
            new = [6]
        elif case == "step" and rank == 2:
            new = [-1]
        step = cache.begin_step(new)
        n = step.num_rows(rank)
        q = torch.randn(n, 4, 8)
        kv = torch.randn(n, 2, 8)
        strategy = "pass_kv" if case == "strategy" and rank == 1 else "pass_q"
        if case == "attn" and rank == 2:
            kv = kv[:, :1]  # wrong heads_kv on rank 2
        cached_attn(q, kv, kv, cache=cache, layer=0, strategy=strategy)
        result.update(ok=True)
    except Exception as exc:
        result.update(ok=False, type=type(exc).__name__, error=str(exc))
    result["elapsed_s"] = time.monotonic() - start
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))


def test_cached_path_agrees_before_it_communicates(raising_cases: dict) -> None:
    expectations = (
        (
            "step",
            {2: "new must be 1 ints >= 0 (new tokens per sequence); got (-1,)"},
            "rank 2 cannot run this cache step: new must be 1 ints >= 0",
        ),
        (
            "attn",
            {2: "k must have shape (rows=2, heads_kv=2, head_dim=8)"},
            "rank 2 cannot run this cached attention call: k must have shape (rows=2, heads_kv=2",
        ),
        (
            "strategy",
            {},
            "ranks disagree on this cached attention call: strategy: rank 0 has pass_q, rank 1 "
            "has pass_kv",
        ),
    )
    assert [case for case, _, _ in expectations] == CACHE_CASES
    for case, own, others in expectations:
        results = raising_cases[f"cache/{case}"]
        assert sorted(results) == [0, 1, 2, 3]
        for rank, r in results.items():
            assert not r["ok"] and r["type"] == "ValueError", (case, r)
            assert r["elapsed_s"] < 2.5
            assert own.get(rank, others) in r["error"], (case, r)


def test_module_wrapper_takes_auto(single_rank_group: None) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 8, dtype=torch.bfloat16) for _ in range(3))
    module = tokenring.SequenceParallelAttention(
        strategy="auto", causal=True, hardware="h100-nvswitch"
    )
    assert "strategy=auto" in repr(module)
    ref, _ = full_attention(q, k, v, causal=True, scale=8**-0.5)
    plain = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), is_causal=True
    ).transpose(1, 2)
    plain_err = (plain.double() - ref).abs().max().item()
    err = (module(q, k, v).double() - ref).abs().max().item()
    assert err <= 2 * plain_err + 2**-8


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"last_block_splits": 2.0}, "last_block_splits must be an int >= 1; got 2.0"),
        ({"causal": 1}, "causal must be a bool; got 1"),
        ({"check_ranks": "yes"}, "check_ranks must be a bool; got 'yes'"),
        ({"hardware": "h100-nvswitch"}, "hardware is only used with strategy='auto'"),
        ({"seq_len": True}, "seq_len must be an int >= 0; got True"),
        ({"last_pair": "lend"}, "last_pair is TokenRing's .*strategy='ring'"),
        ({"last_pair": "return"}, "last_pair is TokenRing's .*strategy='ring'"),
        ({"strategy": "token_ring", "last_pair": "borrow"}, "last_pair must be None or one of"),
        ({"strategy": "token_ring", "last_pair": 1}, "last_pair must be None or one of .*got 1"),
        ({"strategy": "token_ring", "last_pair": "auto"}, "last_pair='auto' needs hardware="),
        (
            {"strategy": "token_ring", "hardware": "h100-nvswitch"},
            "hardware is only used with strategy='auto' or last_pair='auto'",
        ),
    ],
)
def test_options_of_the_wrong_type_are_rejected(
    single_rank_group: None, kwargs: dict, match: str
) -> None:
    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    with pytest.raises(ValueError, match=match):
        tokenring.sequence_parallel_attn(q, k, v, **{"strategy": "ring", **kwargs})


def _repeated_calls(out_dir: str) -> None:
    """Calls on one communicator: the same call twice, then softmax_scale different on rank 3
    only (same schedule and message sizes: unchecked, a wrong number), then the same again.
    Writes each call's outcome and the frame sizes its agreement exchanged."""
    from tokenring.runtime.comm import AGREE_FRAME_NUM_BYTES

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = tokenring.Communicator(None, timeout_s=3)
    frames: list[int] = []
    exchange = comm._post_gather  # every exchange of bytes, posted now or waited for at once

    def recorded(data: bytes, *, what: str, frame_num_bytes: int = AGREE_FRAME_NUM_BYTES):
        frames.append(frame_num_bytes)
        return exchange(data, what=what, frame_num_bytes=frame_num_bytes)

    comm._post_gather = recorded  # type: ignore[method-assign]
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, S, H, D, dtype=torch.float64) for _ in range(3))
    rows = sharded_positions("zigzag", rank, world, S)
    calls = []
    for index, scale in enumerate([0.25, 0.25, 0.5 if rank == 3 else 0.25, 0.25]):
        frames.clear()
        comm.counter.reset()
        ref, _ = full_attention(q, k, v, causal=True, scale=scale)
        result: dict = {"frames": None}
        start = time.monotonic()
        try:
            out = tokenring.ring_attn(
                *(x[:, rows] for x in (q, k, v)),
                causal=True,
                layout="zigzag",
                group=comm,
                softmax_scale=scale,
            )
            result.update(ok=True, err=(out - ref[:, rows]).abs().max().item())
        except Exception as exc:
            result.update(ok=False, type=type(exc).__name__, error=str(exc))
        result.update(frames=list(frames), elapsed_s=time.monotonic() - start, call=index)
        result.update(messages=comm.counter.sent_messages + comm.counter.recv_messages)
        calls.append(result)
    Path(out_dir, f"{rank}.json").write_text(json.dumps(calls))


def test_repeated_calls_agree_by_digest_and_still_name_a_differing_option(
    raising_cases: dict,
) -> None:
    """Note [Agreement by digest] in tokenring.runtime.comm: a call whose ranks agree exchanges only
    the digest frames; an option that differs on one rank (one that would give a wrong
    number unchecked) still fails on every rank naming it, and the next call runs."""
    from tokenring.runtime.comm import AGREE_FRAME_NUM_BYTES, DIGEST_FRAME_NUM_BYTES

    results = raising_cases["repeated"]  # on a communicator of its own, after those cases
    assert sorted(results) == [0, 1, 2, 3]
    for calls in results.values():
        for index in (0, 1, 3):
            assert calls[index]["ok"] and calls[index]["err"] < 1e-10, calls[index]
            assert calls[index]["frames"] == [DIGEST_FRAME_NUM_BYTES], calls[index]
        bad = calls[2]
        assert not bad["ok"] and bad["type"] == "ValueError", bad
        assert "ranks disagree on this attention call: softmax_scale: rank 0 has" in bad["error"]
        assert "rank 3 has" in bad["error"]
        assert bad["frames"] == [DIGEST_FRAME_NUM_BYTES, AGREE_FRAME_NUM_BYTES], bad
        # the check completes before the call's first transfer (Note [Deferred agreement])
        assert bad["messages"] == 0 < calls[0]["messages"], bad
        assert bad["elapsed_s"] < 2.5  # the agreement, not a timeout (3 s)


def _sketched(cases: list[tuple[float, float, float]], shared_memory: bool) -> list[str]:
    """One check per case: a signature of three sketched fields (Note [Agreement by digest])
    whose values rank 1 moves by the case's amounts, beside a plain field; what each raised.
    Then a signature of more sketches than a frame carries, on every rank and on rank 1
    alone."""
    rank = dist.get_rank()
    comm = tokenring.Communicator(None, timeout_s=20, shared_memory=shared_memory)
    base = torch.arange(1.0, 65.0, dtype=torch.float64).view(4, 16)
    outcomes = []
    for case in [*cases, None, "rank 1"]:
        names = "abcde" if case is None or (case == "rank 1" and rank == 1) else "abc"
        shifts = (0.0,) * 5 if case is None or isinstance(case, str) else case
        signature: dict[str, Any] = {"plain": 1}
        for i, (name, shift) in enumerate(zip(names, shifts, strict=False)):
            x = base * (i + 1) + (shift if rank == 1 else 0.0)
            signature[f"field {name}"] = sketch(x, rtol=replicated_rtol(x.dtype))
        try:
            comm.agreed(lambda sig=signature: (None, sig), what="test call")
            outcomes.append("ok")
        except (ValueError, TypeError) as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")
    comm.close()
    return outcomes


@pytest.mark.parametrize("shared_memory", [False, True], ids=["sockets", "shared_memory"])
def test_a_check_compares_several_sketched_fields_and_names_each_that_differs(
    shared_memory: bool,
) -> None:
    """Up to MAX_SKETCHES sketched fields ride in one check (a Flux model call's timestep,
    guidance and pooled projections beside its text): each is compared on its own, within
    rounding, and the error names exactly those that differ, on every rank."""
    from tokenring.runtime.comm import MAX_SKETCHES

    cases = [(0.0, 0.0, 0.0), (1e-13, 0.0, 0.0), (0.0, 0.5, 0.0), (2.0, 0.0, 0.5)]
    assert MAX_SKETCHES == 4  # the last signature (5 sketches) is one too many
    results = tokenring.launch(_sketched, cases, shared_memory, world_size=2, timeout_s=120)
    assert results[1][:-1] == results[0][:-1], results
    ok, rounding, middle, outer, too_many, on_rank_1 = results[0]
    assert ok == "ok" and rounding == "ok", results[0]  # rounding-sized differences agree
    assert middle.startswith("ValueError: ranks disagree on this test call: field b: rank 1")
    assert "field a" not in middle and "field c" not in middle, middle
    assert outer.startswith("ValueError: ranks disagree on this test call: field a: rank 1")
    assert "; field c: rank 1 differs" in outer and "field b" not in outer, outer
    assert too_many == "TypeError: a signature holds 4 Sketches at most; got 5", too_many
    # rank 1's alone: it raises its own, its peer learns it in the check (it waited before)
    assert results[1][-1] == too_many, results[1]
    assert on_rank_1 == f"ValueError: rank 1 cannot run this test call: {too_many[11:]}"
