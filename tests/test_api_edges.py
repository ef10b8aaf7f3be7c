"""Edge cases of the public entry points found by probing odd keyword values: each keyword
takes effect or is rejected with a ValueError naming it, on every rank, never a hang.

Legend: B batch, S global seq, H heads, D head dim, P world size.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import tokenring
from oracle import full_attention, make_inputs
from tokenring.tinylm import TinyCausalLM, TinyLMConfig, generate, generate_reference


def _one_rank_bad_call(bad: str) -> dict[str, Any]:
    """Rank 1 makes a bad call (``bad``: "return_lse" = 1, or "q" = None, say a rank with no
    tokens), rank 0 a valid one; then both make a valid call, checked against the oracle."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    q, k, v, _ = make_inputs(seed=3, batch=1, seq_global=8, heads_q=2, heads_kv=1, head_dim=4)
    s = 8 // world_size
    mine = [x[:, rank * s : (rank + 1) * s] for x in (q, k, v)]
    args: list[Any] = list(mine)
    options: dict[str, Any] = {}
    if rank == 1 and bad == "q":
        args[0] = None
    if bad == "return_lse":
        options["return_lse"] = 1 if rank == 1 else False
    try:
        tokenring.sequence_parallel_attn(*args, strategy="ring", **options)
        error = None
    except ValueError as exc:
        error = str(exc)
    out = tokenring.sequence_parallel_attn(*mine, causal=True)  # the ranks are still in step
    ref, _ = full_attention(q, k, v, causal=True, scale=4**-0.5)
    torch.testing.assert_close(out, ref[:, rank * s : (rank + 1) * s], atol=1e-12, rtol=0)
    return {"error": error}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("return_lse", "return_lse must be a bool; got 1"),
        ("q", "q must be a torch.Tensor; got NoneType"),
    ],
)
def test_a_bad_call_on_one_rank_raises_on_every_rank(bad: str, message: str) -> None:
    """return_lse and q were checked before the ranks' agreement: the rank with the bad value
    raised alone and the others waited for it until the group's timeout."""
    results = tokenring.launch(_one_rank_bad_call, bad, world_size=2, timeout_s=120)
    assert results[1]["error"] == message
    assert results[0]["error"] is not None
    assert "rank 1" in results[0]["error"] and message.split(";")[0] in results[0]["error"]


@pytest.mark.parametrize("scale", [True, False])
def test_softmax_scale_bool_is_rejected(single_rank_group: None, scale: bool) -> None:
    """softmax_scale=True ran with scale 1.0 (a bool is an int): a bool is not a scale."""
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    with pytest.raises(
        ValueError, match=f"softmax_scale must be a finite number > 0 or None; got {scale}"
    ):
        tokenring.sequence_parallel_attn(q, q, q, softmax_scale=scale)


def test_module_rejects_unknown_option_at_build(single_rank_group: None) -> None:
    """A misspelt option (casual=True) was kept and failed with a TypeError at the first
    forward, deep in the call; it is refused when the module is built, naming it (still a
    TypeError)."""
    with pytest.raises(TypeError, match="casual"):
        tokenring.SequenceParallelAttention(strategy="ring", casual=True)
    module = tokenring.SequenceParallelAttention(strategy="ring", kernel="reference", seq_len=8)
    q, k, v, _ = make_inputs(seed=1, batch=1, seq_global=8, heads_q=2, heads_kv=1, head_dim=4)
    ref, _ = full_attention(q, k, v, causal=False, scale=4**-0.5)
    torch.testing.assert_close(module(q, k, v), ref, atol=1e-12, rtol=0)


def _generate_with(case: str) -> dict[str, Any]:
    """tinylm.generate where rank 1's prompts or max_new_tokens differ from rank 0's; then a
    call where they agree, checked against generate_reference (one process, no cache)."""
    rank = dist.get_rank()
    model = TinyCausalLM(TinyLMConfig(), seed=0, dtype=torch.float64)
    prompts, count = [[1, 2, 3, 4, 5]], 3
    if case == "prompts" and rank == 1:
        prompts = [[9, 8, 7, 6, 5]]
    if case == "max_new_tokens" and rank == 1:
        count = 4
    try:
        got = generate(model, prompts, count, strategy="pass_kv").tokens
        error = None
    except ValueError as exc:
        got, error = None, str(exc)
    same = generate(model, [[1, 2, 3]], 2, strategy="pass_kv").tokens
    assert same == generate_reference(model, [[1, 2, 3]], 2)
    return {"error": error, "tokens": got, "reference": generate_reference(model, prompts, count)}


@pytest.mark.parametrize("case", ["prompts", "max_new_tokens"])
def test_generate_ranks_that_differ_raise_on_every_rank(case: str) -> None:
    """Other prompts on one rank gave it the tokens of rank 0's prompt (a silent wrong
    answer); another max_new_tokens left the rank with fewer steps waiting for the other's
    until the timeout. Both raise on every rank, naming the difference."""
    results = tokenring.launch(_generate_with, case, world_size=2, timeout_s=120)
    for result in results:
        assert result["error"] is not None, result
        assert "ranks disagree on this generate call" in result["error"]
        assert case in result["error"]


@pytest.mark.parametrize(
    ("prompts", "count", "message"),
    [
        ([[1, True]], 2, "prompt tokens must be ints in \\[0, 96\\); got \\[True\\]"),
        ([[1, 2.0]], 2, "prompt tokens must be ints in \\[0, 96\\); got \\[2.0\\]"),
        ([[1, 2]], True, "max_new_tokens must be an int >= 1; got True"),
        ([[1, 2]], 2.5, "max_new_tokens must be an int >= 1; got 2.5"),
        ([[1, 2]], 0, "max_new_tokens must be >= 1; got 0"),
    ],
)
def test_generate_rejects_what_is_not_an_int(
    single_rank_group: None, prompts: Any, count: Any, message: str
) -> None:
    """A float token failed deep in the model (an index of float type); max_new_tokens=True
    ran one step, 2.5 failed in range()."""
    model = TinyCausalLM(TinyLMConfig(), seed=0, dtype=torch.float64)
    with pytest.raises(ValueError, match=message):
        generate(model, prompts, count, strategy="pass_kv")
    with pytest.raises(ValueError, match=message):
        generate_reference(model, prompts, count)


@pytest.mark.parametrize("timeout", [True, "x", np.float32(5.0), -1.0, float("inf")])
def test_get_communicator_timeout_must_be_a_number(single_rank_group: None, timeout: Any) -> None:
    """timeout_s=True set a timeout of 1 s; "x" and a numpy float32 failed with a TypeError
    from a comparison or timedelta."""
    with pytest.raises(ValueError, match="timeout_s must be a finite number > 0; got"):
        tokenring.get_communicator(timeout_s=timeout)


@pytest.mark.parametrize("timeout", [True, "x", 0, float("nan")])
def test_a_communicator_timeout_must_be_a_number(single_rank_group: None, timeout: Any) -> None:
    """Communicator(timeout_s=True) built a communicator with a 1 s limit."""
    with pytest.raises(ValueError, match="timeout_s must be a finite number > 0; got"):
        tokenring.Communicator(timeout_s=timeout)


def test_get_communicator_sets_a_communicators_timeout(single_rank_group: None) -> None:
    """timeout_s with a Communicator was ignored: "from now on" holds for it too."""
    comm = tokenring.get_communicator()
    before = comm.timeout
    try:
        assert tokenring.get_communicator(comm, timeout_s=7).timeout.total_seconds() == 7
        assert comm.timeout.total_seconds() == 7
    finally:
        comm.timeout = before


def test_resolve_strategy_auto_names_bad_arguments(single_rank_group: None) -> None:
    """q of 3 dims failed with 'not enough values to unpack', q=None with an AttributeError;
    each is a ValueError naming the argument."""
    q = torch.randn(1, 8, 2, 4, dtype=torch.bfloat16)
    comm = tokenring.get_communicator()
    call = dict(causal=True, layout="contiguous", hardware="h200-nvswitch")
    for bad, message in (
        (dict(q=q[0], k=q, comm=comm), "q must have 4 dims"),
        (dict(q=None, k=q, comm=comm), "q must be a torch.Tensor; got NoneType"),
    ):
        with pytest.raises(ValueError, match=message):
            tokenring.resolve_strategy("auto", **bad, **call)
    pick = tokenring.resolve_strategy("auto", q=q, k=q, comm=comm, **call)
    assert isinstance(pick, tokenring.Strategy)


def test_resolve_strategy_refuses_hardware_with_a_fixed_strategy(single_rank_group: None) -> None:
    """A fixed strategy returned itself and dropped hardware (even a name that is no preset),
    where sequence_parallel_attn, cached_attn and resolve_cached_strategy refuse it."""
    q = torch.randn(1, 8, 2, 4)
    call = dict(q=q, k=q, causal=True, layout="contiguous", comm=tokenring.get_communicator())
    for hardware in ("h200-nvswitch", "no-such-preset"):
        with pytest.raises(
            ValueError,
            match=f"hardware is only used with strategy='auto'; got hardware='{hardware}' with "
            "strategy='ring'",
        ):
            tokenring.resolve_strategy("ring", hardware=hardware, **call)
    assert tokenring.resolve_strategy("ring", **call) is tokenring.Strategy.RING


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("rope_base", 0.0, "rope_base must be a finite number > 0; got 0.0"),
        ("rope_base", -1.0, "rope_base must be a finite number > 0; got -1.0"),
        ("rope_base", float("nan"), "rope_base must be a finite number > 0; got nan"),
        ("heads_q", 4.0, "heads_q must be an int >= 1; got 4.0"),
        ("vocab_size", True, "vocab_size must be an int >= 1; got True"),
        ("head_dim", 16.0, "head_dim must be even and >= 2 for RoPE; got 16.0"),
    ],
)
def test_tiny_config_rejects_what_it_cannot_build(field: str, value: Any, message: str) -> None:
    """rope_base 0, -1 or nan made every angle inf or nan (the model's logits nan, the
    tokens meaningless but equal in generate and generate_reference); a float size failed in
    torch.randn or was kept."""
    with pytest.raises(ValueError, match=message.replace("(", "\\(").replace(")", "\\)")):
        TinyLMConfig(**{field: value})


def test_softmax_scale_that_requires_grad_is_rejected(single_rank_group: None) -> None:
    """A 0-d scale tensor that requires grad got no gradient (None after backward) while the
    call ran: refused, naming it. A plain 0-d tensor still works, as the oracle says."""
    q, k, v, _ = make_inputs(seed=5, batch=1, seq_global=4, heads_q=2, heads_kv=2, head_dim=8)
    scale = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match=r"softmax_scale must be a number.*requires grad"):
        tokenring.sequence_parallel_attn(q.requires_grad_(), k, v, softmax_scale=scale)
    out = tokenring.sequence_parallel_attn(q, k, v, softmax_scale=scale.detach())
    ref, _ = full_attention(q, k, v, causal=False, scale=0.3)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
