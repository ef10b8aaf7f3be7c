"""Sequence layouts: which global token positions each rank owns.

Legend: B batch, S global seq, s local seq (S // P), H heads, D head dim, P world size.

Two layouts:
- ``Layout.CONTIGUOUS``: rank r owns positions [r*s, (r+1)*s). Any s >= 1. Balanced for
  non-causal attention (DiT); unbalanced for causal (rank P-1 does P times rank 0's work).
- ``Layout.ZIGZAG``: the sequence is cut into 2P chunks of c = s/2 tokens; rank r owns chunk r
  followed by chunk 2P-1-r. Every rank gets one early and one late chunk, so causal work is
  balanced. Needs an even s.

Note [Zigzag chunks]
~~~~~~~~~~~~~~~~~~~~
P = 3, 2P = 6 chunks of c tokens::

    global:  | c0 | c1 | c2 | c3 | c4 | c5 |
    rank 0:  | c0 | c5 |        local rows [0, c) = c0, [c, 2c) = c5
    rank 1:  | c1 | c4 |
    rank 2:  | c2 | c3 |

Local row i of rank r sits at global position ``chunk_start + (i mod c)``; positions inside a
shard are increasing, so a causal mask over one rank's own shard is the plain top-left causal
mask.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

__all__ = ["Layout", "global_positions", "shard", "unshard", "validate_seq_local"]


class Layout(enum.Enum):
    """How the global sequence is distributed over the ranks of the group."""

    CONTIGUOUS = "contiguous"
    ZIGZAG = "zigzag"

    @classmethod
    def parse(cls, value: Layout | str) -> Layout:
        """Accept a ``Layout`` or its string value; raise ValueError naming the options."""
        if isinstance(value, Layout):
            return value
        try:
            return cls(value)
        except ValueError:
            options = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"layout must be one of {options}; got {value!r}") from None


def validate_seq_local(seq_local: int, layout: Layout, *, name: str = "seq_local") -> None:
    """Raise ValueError when ``seq_local`` tokens per rank cannot be split by ``layout``."""
    if seq_local < 1:
        raise ValueError(f"{name} must be >= 1; got {seq_local}")
    if layout is Layout.ZIGZAG and seq_local % 2 != 0:
        raise ValueError(
            f"{name} must be even for layout 'zigzag' (two chunks per rank); got {seq_local}"
        )


def _validate_world(rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}); got {rank}")


def global_positions(
    *, rank: int, world_size: int, seq_local: int, layout: Layout | str
) -> torch.Tensor:
    """Global token positions held by ``rank``, in local order.

    Use these as RoPE ``position_ids`` on each rank.

    Returns:
        int64 tensor of shape ``(seq_local,)``.
    """
    layout = Layout.parse(layout)
    _validate_world(rank, world_size)
    validate_seq_local(seq_local, layout)
    if layout is Layout.CONTIGUOUS:
        return torch.arange(rank * seq_local, (rank + 1) * seq_local)
    chunk = seq_local // 2
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    last_chunk = 2 * world_size - 1 - rank
    second = torch.arange(last_chunk * chunk, (last_chunk + 1) * chunk)
    return torch.cat([first, second])


def _seq_local_of(seq_len: int, world_size: int, layout: Layout) -> int:
    parts = world_size * (2 if layout is Layout.ZIGZAG else 1)
    if seq_len % parts != 0:
        raise ValueError(
            f"sequence length must be divisible by {parts} for layout '{layout.value}' "
            f"with world_size {world_size}; got {seq_len}"
        )
    return seq_len // world_size


def shard(
    x: torch.Tensor, *, rank: int, world_size: int, layout: Layout | str, seq_dim: int = 1
) -> torch.Tensor:
    """Take ``rank``'s shard of a global tensor along ``seq_dim``.

    Args:
        x: global tensor, e.g. ``(B, S, H, D)`` with ``seq_dim=1``.

    Returns:
        ``(B, s, H, D)`` (the same shape with ``S`` replaced by ``s = S // P``), contiguous.
    """
    layout = Layout.parse(layout)
    _validate_world(rank, world_size)
    seq_local = _seq_local_of(x.shape[seq_dim], world_size, layout)
    index = global_positions(
        rank=rank, world_size=world_size, seq_local=seq_local, layout=layout
    ).to(x.device)
    return x.index_select(seq_dim, index).contiguous()


def unshard(
    shards: Sequence[torch.Tensor], *, layout: Layout | str, seq_dim: int = 1
) -> torch.Tensor:
    """Inverse of :func:`shard`: put every rank's shard back in global order.

    Args:
        shards: one ``(B, s, H, D)`` tensor per rank, in rank order.

    Returns:
        ``(B, S, H, D)``.
    """
    layout = Layout.parse(layout)
    world_size = len(shards)
    if world_size < 1:
        raise ValueError("shards must hold one tensor per rank; got an empty sequence")
    seq_local = shards[0].shape[seq_dim]
    for r, s in enumerate(shards):
        if s.shape != shards[0].shape:
            raise ValueError(
                f"shards[{r}] has shape {tuple(s.shape)}; expected {tuple(shards[0].shape)}"
            )
    validate_seq_local(seq_local, layout, name=f"shards[*].shape[{seq_dim}]")
    stacked = torch.cat(list(shards), dim=seq_dim)
    positions = torch.cat(
        [
            global_positions(rank=r, world_size=world_size, seq_local=seq_local, layout=layout)
            for r in range(world_size)
        ]
    ).to(stacked.device)
    inverse = torch.empty_like(positions)
    inverse[positions] = torch.arange(positions.numel(), device=positions.device)
    return stacked.index_select(seq_dim, inverse)
