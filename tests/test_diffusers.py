"""diffusers' Flux with tokenring's processor on gloo ranks, against the same model in one process.

One launch per world size; inside the ranks a tiny random ``FluxTransformer2DModel`` (one
double-stream and one single-stream block, from a config) runs on this rank's contiguous image
shard with the text replicated and with the text sharded, through
``tokenring.diffusers.FluxSequenceParallelProcessor``; the ranks send back the gathered output
and the parameter gradients summed over the ranks. This process runs the same weights on the
whole sequence with diffusers' own ``FluxAttnProcessor`` (SDPA). The same launch checks
``joint_attn`` (text replicated, 5 tokens on 2 and 4 ranks; text sharded) and ``cross_attn``
(K/V of another length, replicated and sharded unevenly, one rank's part empty) against plain
SDPA on the whole sequence: outputs and q/k/v gradients.

Tolerances: the Flux model in float32 (its RoPE computes in float32 even for float64 inputs)
within ``torch.testing.assert_close``'s float32 defaults; the functions in float64 within 1e-10.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import tokenring

pytest.importorskip(
    "diffusers", reason="diffusers is not installed (pip install 'tokenring-attention[diffusers]')"
)
from diffusers import FluxTransformer2DModel
from diffusers.models.attention_processor import Attention

from tokenring import diffusers as tr_diffusers

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

BATCH = 2
TEXT = 12  # text tokens: divisible by 2, 3 and 4 for the sharded-text case
FRAMES, HEIGHT, WIDTH = 2, 3, 4  # 24 image tokens
CONFIG = {
    "patch_size": 1,
    "in_channels": 4,
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    "joint_attention_dim": 8,
    "pooled_projection_dim": 8,
    "axes_dims_rope": (2, 2, 4),
}


def build_model() -> FluxTransformer2DModel:
    torch.manual_seed(0)
    model = FluxTransformer2DModel(**CONFIG)
    with torch.no_grad():  # break symmetric inits (zeros, ones) so every path is exercised
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.float()


def make_inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    num_image = FRAMES * HEIGHT * WIDTH
    f, h, w = torch.meshgrid(
        torch.arange(FRAMES), torch.arange(HEIGHT), torch.arange(WIDTH), indexing="ij"
    )
    return {
        "hidden_states": torch.randn(BATCH, num_image, 4, generator=gen),
        "encoder_hidden_states": torch.randn(BATCH, TEXT, 8, generator=gen),
        "pooled_projections": torch.randn(BATCH, 8, generator=gen),
        "timestep": torch.rand(BATCH, generator=gen),
        "img_ids": torch.stack([f, h, w], dim=-1).reshape(num_image, 3).float(),
        "txt_ids": torch.randn(TEXT, 3, generator=gen),  # distinct text positions
        "weight": torch.randn(BATCH, num_image, 4, generator=gen),  # loss = sum(out * weight)
    }


def contiguous_rows(n: int, rank: int, world_size: int) -> slice:
    """Rank's rows of n under a contiguous split into equal parts (written apart from
    tokenring.shard)."""
    assert n % world_size == 0
    per = n // world_size
    return slice(rank * per, (rank + 1) * per)


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        out[name] = p.grad.clone()
    return out


def run_ranks() -> dict[str, Any]:
    """On every rank: Flux with the text replicated and sharded; cross-attention."""
    comm = tokenring.get_communicator()
    rank, world_size = comm.rank, comm.world_size
    inputs = make_inputs()
    img = contiguous_rows(inputs["hidden_states"].shape[1], rank, world_size)
    txt = contiguous_rows(TEXT, rank, world_size)
    result: dict[str, Any] = {}
    for text in ("replicated", "sharded"):
        model = build_model()
        model.set_attn_processor(tr_diffusers.FluxSequenceParallelProcessor(text=text))
        keep = slice(None) if text == "replicated" else txt
        out = model(
            hidden_states=inputs["hidden_states"][:, img],
            encoder_hidden_states=inputs["encoder_hidden_states"][:, keep],
            pooled_projections=inputs["pooled_projections"],
            timestep=inputs["timestep"],
            img_ids=inputs["img_ids"][img],
            txt_ids=inputs["txt_ids"][keep],
            joint_attention_kwargs={"text_seq_len": TEXT},  # sharded: the rows add up to it
        ).sample  # (B, s, 4)
        (out * inputs["weight"][:, img]).sum().backward()
        grads = grads_of(model)
        for g in grads.values():
            comm.all_reduce(g, label="test gradients").wait()
        gathered = comm.all_gather(out.detach().contiguous(), label="test output")
        result[text] = {"output": torch.cat(gathered, dim=1), "grads": grads}
    result["cross"] = run_cross(comm)
    result["joint"] = run_joint(comm)
    result["refused"] = refusals()
    misuses(comm, inputs)
    return result


def misuses(comm: Any, inputs: dict[str, Any]) -> None:
    """A caller's text placement that the ranks' inputs contradict raises on every rank: the
    whole text on each rank under text="sharded" (each text key counted P times, 0.04 off),
    and different num_text under replicated text (the bias on other keys, 0.2 off)."""
    model = build_model()
    model.set_attn_processor(tr_diffusers.FluxSequenceParallelProcessor(text="sharded"))
    img = contiguous_rows(inputs["hidden_states"].shape[1], comm.rank, comm.world_size)
    with pytest.raises(ValueError, match=r"ranks' text rows added up .* got 12"):
        model(
            hidden_states=inputs["hidden_states"][:, img],
            encoder_hidden_states=inputs["encoder_hidden_states"],  # all of it
            pooled_projections=inputs["pooled_projections"],
            timestep=inputs["timestep"],
            img_ids=inputs["img_ids"][img],
            txt_ids=inputs["txt_ids"],
            joint_attention_kwargs={"text_seq_len": TEXT},
        )
    q = torch.randn(BATCH, 9, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="disagree on this joint attention call: num_text"):
        tr_diffusers.joint_attn(q, q, q, num_text=5 - comm.rank % 2, text="replicated", group=comm)


def cross_inputs() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(BATCH, 16, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(BATCH, 7, 2, 8, generator=gen, dtype=torch.float64)  # GQA, Skv = 7
    v = torch.randn(BATCH, 7, 2, 8, generator=gen, dtype=torch.float64)
    dout = torch.randn(BATCH, 16, 4, 8, generator=gen, dtype=torch.float64)
    return q, k, v, dout


JOINT_TEXT, JOINT_IMAGE = 5, 16  # text not divisible by the world size: replicated only


def joint_inputs(num_text: int) -> tuple[torch.Tensor, ...]:
    """Global (B, T + S, H, D) float64, text rows first; K/V with half the heads (GQA)."""
    gen = torch.Generator().manual_seed(3)
    n = num_text + JOINT_IMAGE
    q = torch.randn(BATCH, n, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(BATCH, n, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(BATCH, n, 2, 8, generator=gen, dtype=torch.float64)
    dout = torch.randn(BATCH, n, 4, 8, generator=gen, dtype=torch.float64)
    return q, k, v, dout


def run_joint(comm: tokenring.Communicator) -> dict[str, Any]:
    """joint_attn with the text replicated (5 tokens) and sharded (12 tokens): each rank's
    output rows and q/k/v gradients. Replicated text: only rank 0 back-propagates the text
    rows' output (the loss counts it once), so the text gradients are partial."""
    rank, world_size = comm.rank, comm.world_size
    result = {}
    for text, num_text in (("replicated", JOINT_TEXT), ("sharded", TEXT)):
        q, k, v, dout = joint_inputs(num_text)
        img = contiguous_rows(JOINT_IMAGE, rank, world_size)
        img = slice(num_text + img.start, num_text + img.stop)
        if text == "replicated":
            rows = [*range(num_text), *range(img.start, img.stop)]
            local_text = num_text
        else:
            txt = contiguous_rows(num_text, rank, world_size)
            rows = [*range(txt.start, txt.stop), *range(img.start, img.stop)]
            local_text = txt.stop - txt.start
        ql, kl, vl = (x[:, rows].clone().requires_grad_() for x in (q, k, v))
        out = tr_diffusers.joint_attn(ql, kl, vl, num_text=local_text, text=text, group=comm)
        grad_out = dout[:, rows].clone()
        if text == "replicated" and rank != 0:
            grad_out[:, :local_text] = 0
        out.backward(grad_out)
        assert ql.grad is not None and kl.grad is not None and vl.grad is not None
        result[text] = {
            "rows": rows,
            "num_text": local_text,
            "out": out.detach(),
            "dq": ql.grad,
            "dk": kl.grad,
            "dv": vl.grad,
        }
    return result


def joint_reference(num_text: int) -> dict[str, torch.Tensor]:
    q, k, v, dout = (x.clone().requires_grad_() for x in joint_inputs(num_text))
    kr, vr = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2))
    out = out.transpose(1, 2)
    out.backward(dout.detach())
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def check_joint(per_rank: list[dict[str, Any]]) -> float:
    """Every rank's rows against the reference, float64 within 1e-10; returns the max diff."""
    worst = 0.0
    for text, num_text in (("replicated", JOINT_TEXT), ("sharded", TEXT)):
        want = joint_reference(num_text)
        text_grads = {n: torch.zeros_like(want[n][:, :num_text]) for n in ("dq", "dk", "dv")}
        for rank, res in enumerate(per_rank):
            got = res["joint"][text]
            rows, t = got["rows"], got["num_text"]
            for name in ("out", "dq", "dk", "dv"):
                ref = want[name][:, rows]
                if text == "replicated" and name != "out":  # text rows: partial, summed below
                    text_grads[name] += got[name][:, :t]
                    got_rows, ref = got[name][:, t:], ref[:, t:]
                else:
                    got_rows = got[name]
                torch.testing.assert_close(
                    got_rows, ref, rtol=0, atol=1e-10, msg=f"joint {text} {name} rank {rank}"
                )
                worst = max(worst, (got_rows - ref).abs().max().item())
        if text == "replicated":
            for name in ("dq", "dk", "dv"):
                ref = want[name][:, :num_text]
                torch.testing.assert_close(
                    text_grads[name], ref, rtol=0, atol=1e-10, msg=f"joint text {name}"
                )
                worst = max(worst, (text_grads[name] - ref).abs().max().item())
    return worst


def kv_parts(n: int, world_size: int) -> list[int]:
    """Uneven parts of n (the last rank takes the rest; some may be empty)."""
    base = [max(0, min(n, (r + 1) * 3) - r * 3) for r in range(world_size)]
    base[-1] += n - sum(base)
    return base


def run_cross(comm: tokenring.Communicator) -> dict[str, Any]:
    q, k, v, dout = cross_inputs()
    rank, world_size = comm.rank, comm.world_size
    rows = contiguous_rows(q.shape[1], rank, world_size)
    parts = kv_parts(k.shape[1], world_size)
    start = sum(parts[:rank])
    kv_rows = slice(start, start + parts[rank])
    result = {}
    for kv in ("replicated", "sharded"):
        keep = slice(None) if kv == "replicated" else kv_rows
        ql = q[:, rows].clone().requires_grad_()
        kl, vl = (x[:, keep].clone().requires_grad_() for x in (k, v))
        out = tr_diffusers.cross_attn(ql, kl, vl, kv=kv, group=comm)
        out.backward(dout[:, rows])
        assert ql.grad is not None and kl.grad is not None and vl.grad is not None
        dk, dv = kl.grad.clone(), vl.grad.clone()
        if kv == "replicated":  # partial on each rank: the sum is the gradient
            comm.all_reduce(dk, label="test dk").wait()
            comm.all_reduce(dv, label="test dv").wait()
        result[kv] = {"out": out.detach(), "dq": ql.grad, "dk": dk, "dv": dv, "rows": rows}
        result[kv]["kv_rows"] = keep
    return result


def refusals() -> list[str]:
    """What the processor refuses, with the message it gives."""
    messages = []
    proc = tr_diffusers.FluxSequenceParallelProcessor()
    attn = build_model().single_transformer_blocks[0].attn
    x = torch.randn(1, 4, 16)
    for kwargs, exc in (
        ({"attention_mask": torch.ones(1, 4)}, NotImplementedError),
        ({}, ValueError),  # replicated text in a single-stream block without text_seq_len
    ):
        with pytest.raises(exc) as info:
            proc(attn, x, **kwargs)
        messages.append(str(info.value))
    # another model's attention (SD3's, PixArt's: diffusers' Attention) failed inside with
    # an AttributeError; its projections and norms are not Flux's
    other = Attention(query_dim=16, heads=2, dim_head=8)
    with pytest.raises(NotImplementedError) as info:
        proc(other, x)
    messages.append(str(info.value))
    # replicated text divided its key bias by the scale: ZeroDivisionError before the check
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError) as info:
        tr_diffusers.joint_attn(q, q, q, num_text=2, text="replicated", softmax_scale=0.0)
    messages.append(str(info.value))
    return messages


def reference() -> dict[str, Any]:
    inputs = make_inputs()
    model = build_model()
    out = model(
        hidden_states=inputs["hidden_states"],
        encoder_hidden_states=inputs["encoder_hidden_states"],
        pooled_projections=inputs["pooled_projections"],
        timestep=inputs["timestep"],
        img_ids=inputs["img_ids"],
        txt_ids=inputs["txt_ids"],
    ).sample
    (out * inputs["weight"]).sum().backward()
    return {"output": out.detach(), "grads": grads_of(model)}


def cross_reference() -> dict[str, torch.Tensor]:
    q, k, v, dout = (x.clone().requires_grad_() for x in cross_inputs())
    kr, vr = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2))
    out = out.transpose(1, 2)
    out.backward(dout.detach())
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("world_size", [2, 4])
def test_flux_processor_matches_one_process(world_size: int) -> None:
    per_rank = tokenring.launch(run_ranks, world_size=world_size, timeout_s=240)
    want = reference()
    diffs = {}
    for text in ("replicated", "sharded"):
        got = per_rank[0][text]
        torch.testing.assert_close(got["output"], want["output"], msg=f"output, text={text}")
        for name, g in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, msg=f"grad {name}, text={text}")
        diffs[text] = (got["output"] - want["output"]).abs().max().item()
    joint_diff = check_joint(per_rank)
    print(f"world_size={world_size}: Flux max |output diff| {diffs}, joint_attn {joint_diff:.3g}")
    want_x = cross_reference()
    for rank, res in enumerate(per_rank):
        for kv in ("replicated", "sharded"):
            got_x = res["cross"][kv]
            rows, kv_rows = got_x["rows"], got_x["kv_rows"]
            for name, ref in (("out", want_x["out"]), ("dq", want_x["dq"])):
                torch.testing.assert_close(
                    got_x[name], ref[:, rows], rtol=0, atol=1e-10, msg=f"{name} {kv} r{rank}"
                )
            for name in ("dk", "dv"):
                torch.testing.assert_close(
                    got_x[name],
                    want_x[name][:, kv_rows],
                    rtol=0,
                    atol=1e-10,
                    msg=f"{name} {kv} r{rank}",
                )
        assert "attention_mask" in res["refused"][0]
        assert "text_seq_len" in res["refused"][1]
        assert "runs diffusers' FluxAttention" in res["refused"][2]
        assert res["refused"][2].endswith("got Attention")
        assert "softmax_scale must be a finite number > 0" in res["refused"][3]


def test_unknown_placements_are_named() -> None:
    with pytest.raises(ValueError, match="text must be one of"):
        tr_diffusers.FluxSequenceParallelProcessor(text="broadcast")
    with pytest.raises(ValueError, match="kv must be one of"):
        tr_diffusers.KVPlacement.parse("ring")


def test_processor_options_are_checked_when_it_is_made() -> None:
    """A bad strategy, hardware or group was accepted by the processor and raised only at the
    model's first attention layer, mid-forward on every rank; now it raises when made."""
    make = tr_diffusers.FluxSequenceParallelProcessor
    with pytest.raises(ValueError, match=r"strategy must be one of .*got 'fastest'"):
        make(strategy="fastest")
    with pytest.raises(ValueError, match="strategy 'hybrid' runs on a 2-D mesh"):
        make(strategy="hybrid")
    with pytest.raises(ValueError, match="strategy='auto' needs hardware="):
        make(strategy="auto")
    with pytest.raises(ValueError, match="hardware is only used with strategy='auto'"):
        make(hardware="h100")
    with pytest.raises(ValueError, match="group must be a ProcessGroup"):
        make(group="not a group")
    assert make(strategy="auto", hardware="h100").strategy == "auto"
    assert make(strategy="ring").strategy == "ring"


@pytest.mark.usefixtures("single_rank_group")
def test_cross_attn_checks_what_joint_attn_checks() -> None:
    """softmax_scale and group are checked as sequence_parallel_attn checks them, also with
    replicated K/V (which need no exchange): a bad scale made NaN or another answer."""
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    k = torch.randn(1, 6, 2, 8, dtype=torch.float64)
    for scale in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softmax_scale must be a finite number > 0"):
            tr_diffusers.cross_attn(q, k, k, kv="replicated", softmax_scale=scale)
    with pytest.raises(ValueError, match="group must be a ProcessGroup"):
        tr_diffusers.cross_attn(q, k, k, kv="replicated", group="not a group")
    out = tr_diffusers.cross_attn(q, k, k, kv="replicated", softmax_scale=0.5)
    want = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, k)), scale=0.5)
    assert (out - want.transpose(1, 2)).abs().max().item() < 1e-12


def test_dit_video_example_matches_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    import dit_video

    argv = ["--world-size", "2", "--frames", "2", "--height", "4", "--width", "4"]
    assert dit_video.main(argv) == 0
    assert "MATCHES the single-process run" in capsys.readouterr().out
