"""Merging partial attention results by their log-sum-exp, in the accumulation dtype.

Legend: B batch, n rows, H heads, D head dim.

Note [Safe merge]
~~~~~~~~~~~~~~~~~
Two partials (o1, l1) and (o2, l2) of the same rows over disjoint key sets combine as::

    l = logaddexp(l1, l2);  o = exp(l1 - l) * o1 + exp(l2 - l) * o2

A row that no key has reached yet has l = -inf and o = 0. Then l1 - l is (-inf) - (-inf) =
NaN, so weights are taken as 0 wherever l = -inf: such rows stay (o = 0, l = -inf) and never
turn into NaN.

The weights sum to 1 wherever l is finite, so ``o = o1 + w2 * (o2 - o1)``: one ``lerp_``
pass (a partial in another dtype converted first). Where l = -inf, w2 = 0 keeps o1 = 0.
"""

from __future__ import annotations

import torch

__all__ = ["merge_into"]


def merge_into(
    out_acc: torch.Tensor,
    lse_acc: torch.Tensor,
    rows: tuple[int, int],
    out_part: torch.Tensor,
    lse_part: torch.Tensor,
) -> None:
    """Merge a partial into accumulators in place.

    Args:
        out_acc: ``(B, s, H, D)`` accumulation dtype.
        lse_acc: ``(B, H, s)`` accumulation dtype.
        rows: the local rows ``(start, stop)`` the partial covers (n = stop - start).
        out_part: ``(B, n, H, D)`` any float dtype.
        lse_part: ``(B, H, n)``.
    """
    start, stop = rows
    out = out_acc[:, start:stop]  # (B, n, H, D) view
    lse = lse_acc[:, :, start:stop]  # (B, H, n) view
    part_lse = lse_part.to(lse_acc.dtype)
    new_lse = torch.logaddexp(lse, part_lse)
    unreached = torch.isneginf(new_lse)
    w_new = torch.where(unreached, 0.0, torch.exp(part_lse - new_lse))  # (B, H, n)
    out.lerp_(out_part.to(out.dtype), w_new.transpose(1, 2).unsqueeze(-1))  # Note [Safe merge]
    lse.copy_(new_lse)
