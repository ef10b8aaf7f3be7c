"""Audit of tokenring.diffusers on 3 gloo ranks (a world size that is not a power of two).

One launch. Inside the ranks: diffusers' Flux (a tiny float64 config; fused projections too)
and Chroma (built on Flux's ``FluxAttention``) with ``FluxSequenceParallelProcessor``, text
replicated (odd T) and sharded; ``joint_attn`` with every one-group strategy, and in float16
with a small softmax_scale; and the calls the ranks must refuse together: image tokens not
divisible by the world size, replicated cross-attention K/V that differ between ranks, and
ranks whose attention calls differ in local length. This process runs the same models in one
process with diffusers' own processor, and float64 attention over the whole sequence.

Tolerances: outputs in float64 within 1e-10. Parameter gradients within rtol 1e-6: diffusers'
``apply_rotary_emb`` rotates in float32 even for float64 inputs, so the gradient of every
rotated key is rounded to float32 once per rank (partial sums) where one process rounds it
once (1.7e-8 off on 3 ranks, 1e-15 on 2). float16: the tolerance rule of tests/oracle.py.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import tokenring

pytest.importorskip(
    "diffusers", reason="diffusers is not installed (pip install 'tokenring-attention[diffusers]')"
)
from diffusers import ChromaTransformer2DModel, FluxTransformer2DModel

from tokenring import diffusers as tr_diffusers

WORLD_SIZE = 3
IMAGE = 24  # image tokens: divisible by 3
FLUX = {
    "patch_size": 1,
    "in_channels": 4,
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    "joint_attention_dim": 8,
    "axes_dims_rope": (2, 2, 4),
}
CHROMA = {"approximator_num_channels": 8, "approximator_hidden_dim": 16, "approximator_layers": 1}
# (name, model, text placement, T, fused projections, strategy)
FLUX_CASES = [
    ("flux replicated T=5", "flux", "replicated", 5, False, "token_ring"),
    ("flux replicated T=1 fused", "flux", "replicated", 1, True, "ring"),
    ("flux sharded T=6", "flux", "sharded", 6, False, "bidir_ring"),
    ("chroma replicated T=5", "chroma", "replicated", 5, False, "allgather_kv"),
]
STRATEGIES = ["token_ring", "ring", "bidir_ring", "bidir_token_ring", "ulysses", "allgather_kv"]


def build_model(kind: str, fused: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "flux":
        model: Any = FluxTransformer2DModel(**FLUX, pooled_projection_dim=8)
    else:
        model = ChromaTransformer2DModel(**FLUX, **CHROMA)
    with torch.no_grad():  # break symmetric inits (zeros, ones) so every path is exercised
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model = model.double()
    if fused:
        model.fuse_qkv_projections()
    return model


def model_inputs(kind: str, num_text: int, num_image: int = IMAGE) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    f64 = torch.float64
    inputs = {
        "hidden_states": torch.randn(2, num_image, 4, generator=gen, dtype=f64),  # (B, S, 4)
        "encoder_hidden_states": torch.randn(2, num_text, 8, generator=gen, dtype=f64),
        "timestep": torch.rand(2, generator=gen, dtype=f64),
        "img_ids": torch.randn(num_image, 3, generator=gen, dtype=f64),  # distinct positions
        "txt_ids": torch.randn(num_text, 3, generator=gen, dtype=f64),
        "weight": torch.randn(2, num_image, 4, generator=gen, dtype=f64),  # loss weights
    }
    if kind == "flux":
        inputs["pooled_projections"] = torch.randn(2, 8, generator=gen, dtype=f64)
    return inputs


def rows(n: int, rank: int, world_size: int) -> slice:
    """Rank's rows of n split contiguously into near-equal parts, the longer first (written
    apart from tokenring.shard)."""
    sizes = [n // world_size + (1 if r < n % world_size else 0) for r in range(world_size)]
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # fused projections leave the unfused weights in the model, unused
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def flux_forward(
    comm: tokenring.Communicator, kind: str, text: str, num_text: int, fused: bool, strategy: str
) -> dict[str, Any]:
    """This rank's shard through the model with tokenring's processor; the gathered output and
    the parameter gradients summed over the ranks."""
    rank, world_size = comm.rank, comm.world_size
    model = build_model(kind, fused)
    processor = tr_diffusers.FluxSequenceParallelProcessor(group=comm, text=text, strategy=strategy)
    model.set_attn_processor(processor)
    inputs = model_inputs(kind, num_text)
    weight = inputs.pop("weight")
    img = rows(IMAGE, rank, world_size)
    txt = slice(None) if text == "replicated" else rows(num_text, rank, world_size)
    inputs |= {
        "hidden_states": inputs["hidden_states"][:, img],
        "img_ids": inputs["img_ids"][img],
        "encoder_hidden_states": inputs["encoder_hidden_states"][:, txt],
        "txt_ids": inputs["txt_ids"][txt],
    }
    out = model(**inputs, joint_attention_kwargs={"text_seq_len": num_text}).sample  # (B, s, 4)
    (out * weight[:, img]).sum().backward()
    grads = grads_of(model)
    for g in grads.values():
        comm.all_reduce(g, label="test gradients").wait()
    output = torch.cat(comm.all_gather(out.detach().contiguous(), label="test output"), dim=1)
    return {"output": output, "grads": grads}


def joint_inputs(num_text: int, num_image: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Global (B, T + S, H, D), text rows first; K/V with half the heads (GQA)."""
    gen = torch.Generator().manual_seed(3)
    n = num_text + num_image
    shapes = ((2, n, 4, 8), (2, n, 2, 8), (2, n, 2, 8), (2, n, 4, 8))
    return tuple(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes)


def joint_rows(text: str, num_text: int, num_image: int, rank: int, world_size: int) -> list[int]:
    img = rows(num_image, rank, world_size)
    image_rows = list(range(num_text + img.start, num_text + img.stop))
    if text == "replicated":
        return [*range(num_text), *image_rows]
    txt = rows(num_text, rank, world_size)
    return [*range(txt.start, txt.stop), *image_rows]


def joint_strategies(comm: tokenring.Communicator) -> dict[str, Any]:
    """joint_attn with every one-group strategy, text replicated (T = 5) and sharded (T = 6):
    each rank's rows, its output and its q/k/v gradients scattered into global tensors and
    summed over the ranks (replicated text: only rank 0 back-propagates the text rows' output,
    the loss counting it once)."""
    rank, world_size = comm.rank, comm.world_size
    result: dict[str, Any] = {}
    for text, num_text in (("replicated", 5), ("sharded", 6)):
        q, k, v, dout = joint_inputs(num_text, 12, torch.float64)
        local = joint_rows(text, num_text, 12, rank, world_size)
        local_text = num_text if text == "replicated" else len(local) - 4
        for strategy in STRATEGIES:
            ql, kl, vl = (x[:, local].clone().requires_grad_() for x in (q, k, v))
            out = tr_diffusers.joint_attn(
                ql, kl, vl, num_text=local_text, text=text, group=comm, strategy=strategy
            )
            grad_out = dout[:, local].clone()
            if text == "replicated" and rank != 0:
                grad_out[:, :num_text] = 0
            out.backward(grad_out)
            got = {"out": out.detach()}
            for name, x, like in (("dq", ql, q), ("dk", kl, k), ("dv", vl, v)):
                full = torch.zeros_like(like)
                assert x.grad is not None
                full[:, local] += x.grad
                comm.all_reduce(full, label="test joint gradient").wait()
                got[name] = full
            result[f"{text} {strategy}"] = {"rows": local, **got}
    return result


def float16_small_scale(comm: tokenring.Communicator) -> dict[str, Any]:
    """Replicated text in float16 with softmax_scale 1e-5: the text keys' bias -log(3) / 1e-5
    overflowed float16 (inf), so the text got no weight (0.36 off on 2 ranks, without an
    error); and a scale so small that no split of the bias fits raises on every rank."""
    local = joint_rows("replicated", 5, 12, comm.rank, comm.world_size)
    q, k, v, _ = joint_inputs(5, 12, torch.float16)
    out = tr_diffusers.joint_attn(
        *(x[:, local] for x in (q, k, v)),
        num_text=5,
        text="replicated",
        softmax_scale=1e-5,
        group=comm,
    )
    with pytest.raises(ValueError) as info:
        tr_diffusers.joint_attn(
            *(x[:, local] for x in (q, k, v)),
            num_text=5,
            text="replicated",
            softmax_scale=1e-12,
            group=comm,
        )
    return {"rows": local, "out": out, "too small": str(info.value)}


def refused_together(comm: tokenring.Communicator) -> dict[str, str]:
    """Calls the ranks must refuse together, each rank's message by case."""
    rank, world_size = comm.rank, comm.world_size
    messages: dict[str, str] = {}

    def refused(name: str, call: Any) -> None:
        with pytest.raises(ValueError) as info:
            call()
        messages[name] = str(info.value)

    # 13 image tokens on 3 ranks: 5 + 5 + 4 (replicated text) or 2+5, 2+4, 1+4 (sharded)
    for text, num_text in (("replicated", 5), ("sharded", 5)):
        q, k, v, _ = joint_inputs(num_text, 13, torch.float64)
        local = joint_rows(text, num_text, 13, rank, world_size)
        local_text = num_text if text == "replicated" else rows(num_text, rank, world_size)
        t = num_text if text == "replicated" else local_text.stop - local_text.start
        call = functools.partial(tr_diffusers.joint_attn, num_text=t, text=text, group=comm)
        refused(f"joint {text}, S=13", functools.partial(call, *(x[:, local] for x in (q, k, v))))
    # the Flux processor on 25 image tokens: 9 + 8 + 8
    model = build_model("flux", False)
    model.set_attn_processor(tr_diffusers.FluxSequenceParallelProcessor(group=comm))
    inputs = model_inputs("flux", 5, num_image=25)
    del inputs["weight"]
    img = rows(25, rank, world_size)
    inputs |= {"hidden_states": inputs["hidden_states"][:, img], "img_ids": inputs["img_ids"][img]}
    refused("flux, S=25", lambda: model(**inputs, joint_attention_kwargs={"text_seq_len": 5}))
    # cross_attn with kv="replicated" where each rank passed its own part of the K/V: each
    # rank attended to its part alone, without an error
    q, k, v, _ = joint_inputs(0, 9, torch.float64)
    part = rows(8, rank, world_size)  # 3, 3, 2 keys
    refused(
        "cross replicated, own parts",
        lambda: tr_diffusers.cross_attn(q, k[:, part], v[:, part], kv="replicated", group=comm),
    )
    # ranks of different local lengths without seq_len: the message listed a cu_seqlens
    # digest ([2, crc]) the caller never passed, first, beside seq_local
    n = 4 if rank == 0 else 3
    refused(
        "attention, lengths differ",
        lambda: tokenring.sequence_parallel_attn(q[:, :n], k[:, :n], v[:, :n], group=comm),
    )
    return messages


def replicated_values(comm: tokenring.Communicator) -> dict[str, Any]:
    """Inputs documented as the same on every rank given other values on one rank, at equal
    lengths (the ranks agreed on shapes alone, and each attended to its own text: numbers
    that match no attention); and values that differ by rounding alone, which still run."""
    rank, world_size = comm.rank, comm.world_size
    result: dict[str, Any] = {}

    def refused(name: str, call: Any) -> None:
        with pytest.raises(ValueError) as info:
            call()
        result[name] = str(info.value)

    q, k, v, _ = joint_inputs(5, 12, torch.float64)
    local = joint_rows("replicated", 5, 12, rank, world_size)
    ql, kl, vl = (x[:, local].clone() for x in (q, k, v))
    call = functools.partial(tr_diffusers.joint_attn, num_text=5, text="replicated", group=comm)
    other = [x.clone() for x in (ql, kl, vl)]
    if rank == 1:  # its own prompt: other text rows of the same length
        gen = torch.Generator().manual_seed(9)
        for x in other:
            x[:, :5] = torch.randn(x[:, :5].shape, generator=gen, dtype=x.dtype)
    refused("joint, own text", lambda: call(*other))
    tiny = [x.clone() for x in (ql, kl, vl)]
    if rank == 2:  # one text value 1e-9 off: far above float64 rounding
        tiny[1][0, 3, 1, 2] += 1e-9
    refused("joint, 1e-9 off", lambda: call(*tiny))
    ulp = [x.clone() for x in (ql, kl, vl)]
    if rank == 1:  # one ulp: what rounding leaves between the ranks' replicated outputs
        ulp[0][1, 2, 3, 4] = torch.nextafter(ulp[0][1, 2, 3, 4], torch.tensor(9.0).double())
    result["joint, one ulp"] = {"rows": local, "out": call(*ulp)}
    # cross-attention: every rank's own K/V of the same length
    kv = [x[:, :7].clone() for x in (k, v)]
    if rank == 2:
        kv[1] = kv[1].flip(1)  # the same rows, permuted
    refused("cross, own K/V", lambda: tr_diffusers.cross_attn(q, *kv, kv="replicated", group=comm))
    # the Flux processor: rank 1 given another prompt of the same length
    model = build_model("flux", False)
    model.set_attn_processor(tr_diffusers.FluxSequenceParallelProcessor(group=comm))
    inputs = model_inputs("flux", 6)
    del inputs["weight"]
    img = rows(IMAGE, rank, world_size)
    inputs |= {"hidden_states": inputs["hidden_states"][:, img], "img_ids": inputs["img_ids"][img]}
    prompt = inputs["encoder_hidden_states"]
    if rank == 1:
        prompt = torch.randn(prompt.shape, generator=torch.Generator().manual_seed(5)).double()
    own = inputs | {"encoder_hidden_states": prompt}
    refused("flux, own prompt", lambda: model(**own, joint_attention_kwargs={"text_seq_len": 6}))
    # the default replicated mode given each rank's shard of the text, no text_seq_len, in a
    # model without single-stream blocks (nothing else checks T there)
    model = FluxTransformer2DModel(**(FLUX | {"num_single_layers": 0}), pooled_projection_dim=8)
    model.double().set_attn_processor(tr_diffusers.FluxSequenceParallelProcessor(group=comm))
    txt = rows(6, rank, world_size)
    shard = inputs | {
        "encoder_hidden_states": inputs["encoder_hidden_states"][:, txt],
        "txt_ids": inputs["txt_ids"][txt],
    }
    refused("flux, text shards", lambda: model(**shard))
    return result


def run_ranks() -> dict[str, Any]:
    comm = tokenring.get_communicator()
    result: dict[str, Any] = {"flux": {}}
    for name, kind, text, num_text, fused, strategy in FLUX_CASES:
        result["flux"][name] = flux_forward(comm, kind, text, num_text, fused, strategy)
    result["joint"] = joint_strategies(comm)
    result["float16"] = float16_small_scale(comm)
    result["refused"] = refused_together(comm)
    result["values"] = replicated_values(comm)
    return result


def one_process(kind: str, num_text: int, fused: bool) -> dict[str, Any]:
    model = build_model(kind, fused)
    inputs = model_inputs(kind, num_text)
    weight = inputs.pop("weight")
    out = model(**inputs).sample
    (out * weight).sum().backward()
    return {"output": out.detach(), "grads": grads_of(model)}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    """(B, n, H, D) attention in q's dtype, K/V heads repeated (GQA)."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), **kw)
    return out.transpose(1, 2)


def check_joint(got: dict[str, Any]) -> None:
    for text, num_text in (("replicated", 5), ("sharded", 6)):
        q, k, v, dout = (x.requires_grad_() for x in joint_inputs(num_text, 12, torch.float64))
        want = attention(q, k, v)
        want.backward(dout.detach())
        for strategy in STRATEGIES:
            case = got[f"{text} {strategy}"]
            torch.testing.assert_close(
                case["out"], want.detach()[:, case["rows"]], rtol=0, atol=1e-10, msg=text
            )
            for name, x in (("dq", q), ("dk", k), ("dv", v)):
                torch.testing.assert_close(
                    case[name], x.grad, rtol=0, atol=1e-10, msg=f"{text} {strategy} {name}"
                )


def test_diffusers_on_three_ranks() -> None:
    per_rank = tokenring.launch(run_ranks, world_size=WORLD_SIZE, timeout_s=240)
    got = per_rank[0]
    for name, kind, _, num_text, fused, _ in FLUX_CASES:
        want = one_process(kind, num_text, fused)
        mine = got["flux"][name]
        torch.testing.assert_close(mine["output"], want["output"], rtol=0, atol=1e-10, msg=name)
        assert mine["grads"].keys() == want["grads"].keys(), name
        for param, g in want["grads"].items():
            torch.testing.assert_close(
                mine["grads"][param], g, rtol=1e-6, atol=1e-6, msg=f"{name}: {param}"
            )
    check_joint(got["joint"])
    # float16, softmax_scale 1e-5: the tolerance rule against float64 attention
    q, k, v, _ = joint_inputs(5, 12, torch.float16)
    exact = attention(q.double(), k.double(), v.double(), scale=1e-5)
    plain_error = (attention(q, k, v, scale=1e-5).double() - exact).abs().max().item()
    for rank, res in enumerate(per_rank):
        small = res["float16"]
        error = (small["out"].double() - exact[:, small["rows"]]).abs().max().item()
        assert error <= 2 * plain_error + 2**-10, f"rank {rank}: {error} vs plain {plain_error}"
        assert "softmax_scale=1e-12 is too small for replicated text" in small["too small"]
        refused = res["refused"]
        field = "rows t + s (the same on every rank"
        for case in ("joint replicated, S=13", "joint sharded, S=13"):
            assert "ranks disagree on this joint attention call" in refused[case], refused[case]
            assert f"{field}: S, and sharded T, split evenly): rank 0 has" in refused[case]
        assert "ranks disagree on this Flux attention layer" in refused["flux, S=25"]
        assert "rank 0 has 14, rank 1 has 13" in refused["flux, S=25"], refused["flux, S=25"]
        cross = refused["cross replicated, own parts"]
        assert "Skv (replicated: every rank's K/V): rank 0 has 3, rank 2 has 2" in cross, cross
        lengths = refused["attention, lengths differ"]
        assert "seq_local: rank 0 has 4, rank 1 has 3" in lengths, lengths
        assert "cu_seqlens" not in lengths, lengths
        check_replicated_values(res["values"])


def check_replicated_values(got: dict[str, Any]) -> None:
    """One rank's messages and output of replicated_values."""
    text = "text rows of q, k, v (replicated: the same on every rank; a rank given its own "
    for case, other in (("joint, own text", 1), ("joint, 1e-9 off", 2)):
        message = got[case]
        assert f"ranks disagree on this joint attention call: {text}" in message, message
        assert f"rank {other} differs from rank 0" in message, message
        assert "text='sharded'" in message, message
    cross = got["cross, own K/V"]
    assert "ranks disagree on this cross-attention call: k/v (replicated: the same" in cross
    assert "rank 2 differs from rank 0" in cross and "kv='sharded'" in cross, cross
    for case in ("flux, own prompt", "flux, text shards"):
        message = got[case]
        assert "ranks disagree on this Flux attention layer: text: encoder_hidden_states" in message
        assert "differs from rank 0" in message and "text='sharded'" in message, message
    # one ulp on rank 1 (rounding) runs: rank 1's text row within float64 rounding of exact
    q, k, v, _ = joint_inputs(5, 12, torch.float64)
    want = attention(q, k, v)
    case = got["joint, one ulp"]
    torch.testing.assert_close(case["out"], want[:, case["rows"]], rtol=0, atol=1e-10)


def test_sketch_of_values() -> None:
    """Note [Replicated values agreed by sketch]: the same values give the same sketch (any
    strides, any threads); rounding stays within the tolerance; other values do not."""
    from tokenring.core.sketch import replicated_rtol, sketch

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 40, 3, 16, generator=gen)
    rtol = replicated_rtol(x.dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the pytest process runs on one thread (conftest.py)
        base = sketch(x, rtol=rtol)
        torch.set_num_threads(1)
        assert sketch(x.transpose(1, 2).contiguous().transpose(1, 2), rtol=rtol) == base
    finally:
        torch.set_num_threads(threads)
    assert base.distance(sketch(x.double().float(), rtol=rtol)) == 0
    ulp = x.clone()
    ulp.view(-1)[::7] = torch.nextafter(ulp.view(-1)[::7], torch.tensor(9.0))  # rounding
    assert 0 < base.distance(sketch(ulp, rtol=rtol)) <= rtol
    for other in (x.flip(1), x[:, torch.randperm(40, generator=gen)], torch.randn_like(x)):
        assert base.distance(sketch(other, rtol=rtol)) > 0.1
    assert rtol == 256 * torch.finfo(torch.float32).eps
    assert replicated_rtol(torch.bfloat16) == replicated_rtol(torch.float16) == 0.25
    nan = x.clone()
    nan[0, 0, 0, 0] = float("nan")
    assert base.distance(sketch(nan, rtol=rtol)) == float("inf")
