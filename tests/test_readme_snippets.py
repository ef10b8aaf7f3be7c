"""The README's ```python blocks, run as a user copies them, against the float64 oracle.

The blocks are read from README.md (so an edit there is tested) and executed on two gloo ranks
of one launch. A block that leaves names for the user to fill in (``q``, ``path``, ``...``)
gets them from a prelude written here; the names the block defines are then checked:

    Use                      ring_attn's out and lse, global_positions       (float64, 1e-10)
    compat, three parts      each shim's out (and lse)                       (float64, 1e-10)
    DistributedKVCache       cached_attn's out over two prompts              (bfloat16)
    hf (transformers)        gathered logits and loss against one process    (float64)
    accelerate loop          the group's loss on rank 0's broadcast batch    (float64)
    generate_tiny.py         tokens equal transformers' generate (2 ranks, not the 4 of its
                             header: the block does not depend on the world size)
    flux_tiny.py             max |diff| against diffusers' own processor     (float32)

Not run here: ``trainer_tiny.py`` (a 2 x 2 mesh needs 4 ranks and a Trainer with DDP: run it
with torchrun as its header says; tests/test_hf_trainer.py checks the same Trainer).

Defect found (README: "Other loss types ... raise"): a head that computes its loss from
``labels=`` in its own code (``BertForMaskedLM``, ``BertForTokenClassification``) returned each
rank's mean over its own shard under ``sequence_parallel=`` (4.1755 and 4.2285 against 4.2020
in one process), with no error; now every rank raises NotImplementedError after the forward
(Note [A loss the model computes itself] in tokenring/hf/attention.py). And ``labels=`` given
to one rank alone left that rank waiting in the labels loss's rank check while the other went
on, until the timeout (30 s here); whether labels were given is now in the forward's rank
check: every rank raises ValueError naming ``labels`` within a second.

Also found: the KV-cache block called ``cached_attn`` without ``hardware=`` while its strategy
"auto" needs one (ValueError); the README's block now passes it.

Legend: B batch, S global seq, s local seq, P world size.
"""

from __future__ import annotations

import importlib.util
import math
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tokenring
from oracle import full_attention, sharded_positions, visible_mask

README = Path(__file__).resolve().parent.parent / "README.md"
P = 2
HAVE_HF = importlib.util.find_spec("transformers") is not None
HAVE_DIFFUSERS = importlib.util.find_spec("diffusers") is not None
if HAVE_HF:  # imported here so that the test session's zygote loads them (conftest.py)
    import transformers  # noqa: F401
if HAVE_DIFFUSERS:
    import diffusers  # noqa: F401


def readme_blocks() -> list[str]:
    """Every ```python block of the README, dedented (one sits in a list item)."""
    text = README.read_text()
    return [textwrap.dedent(b) for b in re.findall(r"^ *```python\n(.*?)^ *```", text, re.S | re.M)]


def block(marker: str) -> str:
    """The one block holding ``marker``."""
    found = [b for b in readme_blocks() if marker in b]
    assert len(found) == 1, f"{len(found)} README python blocks hold {marker!r}"
    return found[0]


def _run(code: str, names: dict[str, Any]) -> dict[str, Any]:
    namespace = {"__name__": "readme_snippet", **names}
    exec(compile(code, str(README), "exec"), namespace)  # the README's own code
    return namespace


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return (got.double() - want.double()).abs().max().item() if got.numel() else 0.0


def _globals(seed: int, s: int, hq: int = 4, hkv: int = 2, d: int = 8) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(2, s, hq, d), (2, s, hkv, d), (2, s, hkv, d)]
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in shapes]


# -- inside the ranks ----------------------------------------------------------------------


def core_blocks(rank: int, world: int) -> dict[str, float]:
    """Use, compat and KV-cache blocks: the largest error of each against float64."""
    errors: dict[str, float] = {}
    s_glob = 32
    q, k, v = _globals(0, s_glob)
    scale = 1 / math.sqrt(q.shape[-1])
    want, want_lse = full_attention(q, k, v, causal=True, scale=scale)
    zig = torch.tensor(sharded_positions("zigzag", rank, world, s_glob))

    def zigzag(x: torch.Tensor) -> torch.Tensor:
        return tokenring.shard(x, rank=rank, world_size=world, layout="zigzag")

    ns = _run(
        block("out = tokenring.token_ring_attn("),
        {"q": q, "k_local": zigzag(k), "v_local": zigzag(v)},
    )
    errors["use out"] = _err(ns["out"], want[:, zig])
    errors["use lse"] = _err(ns["lse"], want_lse[:, :, zig])
    errors["use positions"] = float(not torch.equal(torch.as_tensor(ns["positions"]), zig))

    parts = re.split(r"\n(?=# (?:from|one process))", block("from tokenring.compat import"))
    assert len(parts) == 3, parts
    ns = _run(parts[0], {"q": zigzag(q), "k": zigzag(k), "v": zigzag(v), "group": None})
    errors["compat zigzag out"] = _err(ns["out"], want[:, zig])
    errors["compat zigzag lse"] = _err(ns["lse"], want_lse[:, :, zig])

    cu = [0, 5, 17, s_glob]
    want_docs, _ = full_attention(
        q[:1],
        k[:1],
        v[:1],
        causal=True,
        scale=scale,
        mask=visible_mask(s_glob, causal=True, cu_seqlens=cu),
    )
    rows = slice(rank * s_glob // world, (rank + 1) * s_glob // world)  # llama3's contiguous
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    names = {"q": q[0, rows], "k": k[0, rows], "v": v[0, rows], "cu_seqlens": cu_seqlens}
    ns = _run(parts[1], {**names, "rank": rank, "world": world})
    errors["compat llama3 out"] = _err(ns["out"], want_docs[0, rows])

    def packed(x: torch.Tensor) -> torch.Tensor:
        return tokenring.shard(
            x[0], rank=rank, world_size=world, layout="zigzag", seq_dim=0, cu_seqlens=cu
        )

    names = {"q_packed": q[0], "k_local": packed(k), "v_local": packed(v), "max_len": 15}
    ns = _run(
        parts[2],
        {**names, "cu_seqlens": cu_seqlens, "rank": rank, "world": world, "tokenring": tokenring},
    )
    doc_pos = torch.tensor(sharded_positions("zigzag", rank, world, s_glob, cu))
    errors["compat varlen out"] = _err(ns["out"], want_docs[0, doc_pos])

    lengths = [13, 7]
    seqs = [_globals(10 + b, n, hq=4, hkv=2, d=8) for b, n in enumerate(lengths)]  # (2, n, H, D)

    def new_rows(step: Any) -> tuple[torch.Tensor, ...]:
        pos = step.new_positions[rank]
        return tuple(
            torch.cat([seqs[b][i][0, pos[b]] for b in range(len(lengths))]).bfloat16()
            for i in range(3)
        )

    code = block("tokenring.DistributedKVCache(")
    assert "q, k, v = ..." in code
    code = code.replace("q, k, v = ...", "q, k, v = new_rows(step)")
    names = {"torch": torch, "tokenring": tokenring, "L": 1, "B": 2, "Hkv": 2, "D": 8, "l": 0}
    names |= {"dev": torch.device("cpu"), "prompts": [[0] * n for n in lengths], "rank": rank}
    with torch.no_grad():
        ns = _run(code, {**names, "new_rows": new_rows, "hw": "h100-nvswitch"})
    got = torch.split(ns["out"], ns["step"].seq_rows(rank))
    for b in range(len(lengths)):
        sq, sk, sv = (x[:1].bfloat16() for x in seqs[b])
        want_b, _ = full_attention(sq, sk, sv, causal=True, scale=scale)
        errors[f"kv cache sequence {b}"] = _err(
            got[b], want_b[0, ns["step"].new_positions[rank][b]]
        )
    return errors


def _tiny_llama(auto: str) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config, attn_implementation=auto).double()


def _loss64(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def hf_blocks(rank: int, workdir: str) -> dict[str, Any]:
    """The transformers blocks, and BERT's own losses given labels= (refused)."""
    from tokenring import hf

    out: dict[str, Any] = {}
    hf.register()
    oracle = _tiny_llama("sdpa")
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = oracle(input_ids=ids).logits
    path = f"{workdir}/llama"  # transformers saves on rank 0 only
    if rank == 0:
        oracle.save_pretrained(path)
    dist.barrier()
    ns = _run(block('hf.SequenceParallel(layout="zigzag")'), {"path": path, "input_ids": ids})
    out["hf logits"] = _err(ns["full"], want)
    out["hf loss"] = _err(ns["loss"].detach(), _loss64(want, ids))
    out["hf dtype"] = str(ns["full"].dtype)

    class Accelerator:  # the loop's only use of accelerate
        def backward(self, loss: torch.Tensor) -> None:
            loss.backward()

    model = _tiny_llama("tokenring")
    mine = ids if rank == 0 else ids.flip(1)  # broadcast_batch hands rank 0's to the group
    names = {"hf": hf, "sp": hf.SequenceParallel(), "model": model, "ids": mine}
    ns = _run(block("hf.broadcast_batch(sp,"), {**names, "accelerator": Accelerator()})
    out["accelerate loss"] = _err(ns["loss"].detach(), _loss64(want, ids))
    out["accelerate grads"] = sum(p.grad is not None for p in model.parameters())

    ns = _run(block("generate_tiny.py"), {})
    out["generate equal"] = torch.equal(ns["tokens"], ns["want"])

    out["own losses"] = _own_losses(hf, rank)
    batch = hf.shard_batch(hf.SequenceParallel(), ids)
    labels = {"labels": ids} if rank == 0 else {}  # rank 0 alone asks for the loss
    try:
        model(
            input_ids=batch.input_ids, position_ids=batch.position_ids,
            sequence_parallel=hf.SequenceParallel(), **labels,
        )  # fmt: skip
        out["labels on one rank"] = "no error"
    except ValueError as exc:
        out["labels on one rank"] = str(exc)
    return out


def _own_losses(hf: Any, rank: int) -> list[str]:
    """BertForMaskedLM / BertForTokenClassification given this rank's labels: the errors."""
    from transformers import BertConfig, BertForMaskedLM, BertForTokenClassification

    config = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    labels = torch.where(torch.arange(16) % 3 == 0, -100, ids % 2)
    sp = hf.SequenceParallel(layout="contiguous")
    batch = hf.shard_batch(sp, ids)
    mine = labels[:, rank * 8 : (rank + 1) * 8].contiguous()
    errors = []
    for cls in (BertForMaskedLM, BertForTokenClassification):
        torch.manual_seed(0)
        model = cls._from_config(config, attn_implementation="tokenring").double().eval()
        try:
            model(
                input_ids=batch.input_ids, position_ids=batch.position_ids, labels=mine,
                sequence_parallel=sp,
            )  # fmt: skip
            errors.append(f"{cls.__name__}: no error")
        except NotImplementedError as exc:
            errors.append(f"{cls.__name__}: {exc}")
    return errors


def flux_block() -> float:
    ns = _run(block("flux_tiny.py"), {})
    return _err(ns["full"], ns["want"])


def run_ranks(workdir: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict[str, Any] = {"core": core_blocks(rank, world)}
    if HAVE_HF:
        result["hf"] = hf_blocks(rank, workdir)
    if HAVE_DIFFUSERS:
        result["flux"] = flux_block()
    return result


# -- the tests -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    workdir = str(tmp_path_factory.mktemp("readme"))
    return tokenring.launch(run_ranks, workdir, world_size=P, timeout_s=240)


def test_readme_has_the_blocks_this_file_runs() -> None:
    assert len(readme_blocks()) == 8  # a new block: run it here too


def test_core_blocks_match_the_oracle(per_rank: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(per_rank):
        for name, err in res["core"].items():
            tol = 2e-2 if name.startswith("kv cache") else 1e-10  # bfloat16 inputs and output
            assert err <= tol, f"rank {rank}: {name} off by {err}"


def test_hf_blocks_match_one_process(per_rank: list[dict[str, Any]]) -> None:
    if not HAVE_HF:
        pytest.skip("transformers is not installed (pip install 'tokenring-attention[hf]')")
    for rank, res in enumerate(per_rank):
        got = res["hf"]
        assert got["hf dtype"] == "torch.float64", got
        for name in ("hf logits", "hf loss", "accelerate loss"):
            assert got[name] <= 1e-10, f"rank {rank}: {name} off by {got[name]}"
        assert got["accelerate grads"] > 0
        assert got["generate equal"], f"rank {rank}: generate_tiny's tokens differ"


def test_a_loss_the_model_computes_itself_raises_on_every_rank(
    per_rank: list[dict[str, Any]],
) -> None:
    if not HAVE_HF:
        pytest.skip("transformers is not installed (pip install 'tokenring-attention[hf]')")
    for rank, res in enumerate(per_rank):
        for line in res["hf"]["own losses"]:
            assert "computed its loss from labels= in its own code" in line, f"rank {rank}: {line}"


def test_labels_on_one_rank_raise_on_every_rank(per_rank: list[dict[str, Any]]) -> None:
    """Rank 0 alone given labels= used to wait in the labels loss's rank check while rank 1
    went on (a hang until the timeout); the forward's rank check now compares them."""
    if not HAVE_HF:
        pytest.skip("transformers is not installed (pip install 'tokenring-attention[hf]')")
    for rank, res in enumerate(per_rank):
        got = res["hf"]["labels on one rank"]
        assert "labels: rank 0 has True, rank 1 has False" in got, f"rank {rank}: {got}"


def test_flux_block_matches_one_process(per_rank: list[dict[str, Any]]) -> None:
    if not HAVE_DIFFUSERS:
        pytest.skip("diffusers is not installed (pip install 'tokenring-attention[diffusers]')")
    for rank, res in enumerate(per_rank):
        assert res["flux"] <= 1e-5, f"rank {rank}: flux_tiny off by {res['flux']}"
