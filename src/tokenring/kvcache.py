"""The distributed KV cache: per layer, the K/V of a batch of sequences sharded over the ranks.

This module owns where cached tokens live and how much memory they take. Every rank keeps the
K/V of its own tokens and a replicated record of which positions every rank holds, so each
rank derives every placement, message size and mask without asking. Attention over it is
``tokenring.inference``; placement (Note [Placement]) is ``tokenring.strategies.cached``.

Legend: B sequences in the batch, T new tokens of a sequence in a step, C cached tokens of a
sequence before it, P world size, bs block size, L layers, Hkv key/value heads, D head dim,
e bytes per element, n rows a rank holds.

Note [Memory accounting]
~~~~~~~~~~~~~~~~~~~~~~~~
Each (layer, sequence) shard of n rows lives in one tensor per K and V whose capacity is n
rounded up to a whole block (growing a block at a time copies once per bs rows). So::

    reserved(r) = L * sum_b roundup(n_rb, bs) * 2 * Hkv * D * e

which every rank computes for every rank. ``begin_step`` checks it against ``budget_bytes``
before anything is allocated or sent, so all ranks raise the same :class:`KVCacheBudgetError`
at the same step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch

from tokenring.api import _DTYPES, autocast_hint, check_flags, get_communicator
from tokenring.core.layout import check_int
from tokenring.runtime.comm import Communicator
from tokenring.strategies.cached import CacheStep, place_new_tokens

__all__ = ["CacheStep", "DistributedKVCache", "KVCacheBudgetError", "place_new_tokens"]


class KVCacheBudgetError(RuntimeError):
    """A step would make a rank's cache exceed its ``budget_bytes``; raised on every rank.

    Args:
        message: the error's text.
        rank: the rank whose cache would exceed its budget (kept as ``.rank``).
        budget_bytes, need_bytes: that rank's budget and what the step needs (kept as
            attributes of the same names).
    """

    def __init__(self, message: str, *, rank: int, budget_bytes: int, need_bytes: int) -> None:
        super().__init__(message)
        self.rank = rank
        self.budget_bytes = budget_bytes
        self.need_bytes = need_bytes


def _is_count(n: Any) -> bool:
    """Whether ``n`` is an int >= 0 (a bool is not)."""
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


class _Growable:
    """Rows appended to a tensor whose capacity grows in whole blocks (Note [Memory accounting])."""

    def __init__(
        self, tail: tuple[int, ...], dtype: torch.dtype, device: torch.device, block: int
    ) -> None:
        self.data = torch.empty((0, *tail), dtype=dtype, device=device)
        self.size = 0
        self.block = block

    def extend(self, rows: torch.Tensor) -> None:
        n = rows.shape[0]
        if self.size + n > self.data.shape[0]:
            grown = torch.empty(
                (_round_up(self.size + n, self.block), *self.data.shape[1:]),
                dtype=self.data.dtype,
                device=self.data.device,
            )
            grown[: self.size] = self.data[: self.size]
            self.data = grown
        self.data[self.size : self.size + n] = rows
        self.size += n

    def view(self) -> torch.Tensor:
        return self.data[: self.size]


def _check_options(sizes: dict[str, int], dtype: torch.dtype, budget_bytes: Any) -> None:
    """:class:`DistributedKVCache`'s ValueErrors for its sizes, dtype and budget."""
    for name, value in sizes.items():
        check_int(name, value, 1)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of float64, float32, bfloat16, float16; got {dtype}")
    if budget_bytes is not None and (
        isinstance(budget_bytes, bool)
        or not isinstance(budget_bytes, int | float)
        or not budget_bytes >= 0
    ):
        raise ValueError(f"budget_bytes must be >= 0 or None; got {budget_bytes!r}")


def _checked_device(device: Any) -> torch.device:
    """``device`` as a torch.device; ValueError naming it for what torch cannot parse."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device must be a torch.device, a device string ('cpu', 'cuda:0') or a device "
            f"index; got {device!r} ({exc})"
        ) from None


def _ranks(
    group: Any, rank: int | None, world_size: int | None
) -> tuple[Communicator | None, int, int]:
    """The cache's communicator (None without a group), rank and world size."""
    if group is not None and (rank is not None or world_size is not None):
        raise ValueError(
            "group and rank/world_size are exclusive: give group= (attention runs on it) or "
            "rank= and world_size= (bookkeeping only), not both; got "
            f"group={type(group).__name__}, rank={rank!r}, world_size={world_size!r}"
        )
    if (rank is None) != (world_size is None):
        raise ValueError(
            f"rank and world_size must be given together; got rank={rank}, world_size={world_size}"
        )
    comm = None
    if world_size is None:
        comm = get_communicator(group)
        rank, world_size = comm.rank, comm.world_size
    assert rank is not None and world_size is not None
    check_int("world_size", world_size, 1)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}); got {rank!r}")
    return comm, rank, world_size


class DistributedKVCache:
    """K/V of a batch of B sequences for every layer, sharded over the ranks of a group.

    Use it in steps: ``begin_step(new)`` places the new tokens (Note [Placement]) and checks
    the budget; then each layer's ``tokenring.inference.cached_attn`` appends and attends.

    Args:
        num_layers: L.
        batch: B, the number of sequences (fixed for the cache's life).
        heads_kv, head_dim: Hkv, D.
        dtype, device: of the stored K/V (and of the q, k, v given to attention).
        block_size: bs, tokens per placement block and allocation unit.
        budget_bytes: the most K/V bytes one rank may reserve (all layers); None: no limit.
        group: ProcessGroup, 1-D DeviceMesh, Communicator or None (default group); attention
            runs on its communicator.
        rank, world_size: both instead of a group: bookkeeping only (attention cannot run).
        zigzag_first_prefill: place a first prefill of equal lengths in the zigzag layout (it
            runs on the ordinary attention path).

    Raises:
        ValueError: a size that is not an int >= 1 (bools are not sizes), an unsupported
            dtype, rank outside [0, world_size), only one of rank / world_size, a group
            together with rank / world_size, a device torch cannot parse, or a non-bool
            ``zigzag_first_prefill``.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        batch: int,
        heads_kv: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        block_size: int = 64,
        budget_bytes: int | None = None,
        group: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        zigzag_first_prefill: bool = True,
    ) -> None:
        sizes = dict(num_layers=num_layers, batch=batch, heads_kv=heads_kv, head_dim=head_dim)
        _check_options(sizes | {"block_size": block_size}, dtype, budget_bytes)
        check_flags(zigzag_first_prefill=zigzag_first_prefill)
        self.comm, self.rank, self.world_size = _ranks(group, rank, world_size)
        self.num_layers, self.batch = num_layers, batch
        self.heads_kv, self.head_dim = heads_kv, head_dim
        # as tensors report it: "cuda" is cuda:<current device> (q.device must equal it)
        self.dtype, self.device = dtype, torch.empty(0, device=_checked_device(device)).device
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self.zigzag_first_prefill = zigzag_first_prefill
        self._lengths = [0] * batch
        self._num_steps = 0
        self._step: CacheStep | None = None
        # Replicated: [sequence][rank] positions held. Local: [layer][sequence] K and V.
        cpu = torch.device("cpu")
        self._positions = [
            [_Growable((), torch.int64, cpu, block_size) for _ in range(self.world_size)]
            for _ in range(batch)
        ]
        tail = (heads_kv, head_dim)
        self._keys, self._values = (
            [
                [_Growable(tail, dtype, self.device, block_size) for _ in range(batch)]
                for _ in range(num_layers)
            ]
            for _ in range(2)
        )
        self._appended = [True] * num_layers  # per layer: appended the current step's K/V
        self.memo: dict[Any, Any] = {}
        """Per-step results every layer reuses (plans, the strategy pick); ``begin_step`` clears."""

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def lengths(self) -> tuple[int, ...]:
        """Tokens of each sequence in the cache (including the current step's)."""
        return tuple(self._lengths)

    @property
    def step(self) -> CacheStep | None:
        """The step begun last (None before the first)."""
        return self._step

    @property
    def token_bytes(self) -> int:
        """K and V bytes of one token in one layer: 2 * Hkv * D * e."""
        return 2 * self.heads_kv * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def tokens_held(self) -> list[list[int]]:
        """``[rank][sequence]``: tokens each rank holds (replicated knowledge)."""
        return [self._held(r) for r in range(self.world_size)]

    def reserved_bytes(self, rank: int | None = None) -> int:
        """Bytes ``rank`` (default: this one) reserves for K/V; see Note [Memory accounting]."""
        return self._reserve(self._held(self.rank if rank is None else rank))

    def used_bytes(self, rank: int | None = None) -> int:
        """Bytes of the K/V rows ``rank`` (default: this one) actually holds, all layers."""
        held = sum(self._held(self.rank if rank is None else rank))
        return self.num_layers * held * self.token_bytes

    def _held(self, rank: int) -> list[int]:
        if not _is_count(rank) or rank >= self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}); got {rank!r}")
        return [self._positions[b][rank].size for b in range(self.batch)]

    def allocated_bytes(self) -> int:
        """Bytes of this rank's K/V tensors as allocated."""
        return sum(
            buf.data.numel() * buf.data.element_size()
            for store in (self._keys, self._values)
            for layer in store
            for buf in layer
        )

    def _reserve(self, held: Sequence[int]) -> int:
        tokens = sum(_round_up(n, self.block_size) for n in held)
        return self.num_layers * tokens * self.token_bytes

    # -- steps -----------------------------------------------------------------------------------
    def _placement(self, new: Sequence[int]) -> CacheStep:
        """The step that places ``new``, its ``kv_positions`` not filled in yet."""
        new = tuple(new) if isinstance(new, Sequence) else new
        if not isinstance(new, tuple) or len(new) != self.batch or not all(map(_is_count, new)):
            raise ValueError(
                f"new must be {self.batch} ints >= 0 (new tokens per sequence); got {new!r}"
            )
        p = self.world_size
        first = not any(self._lengths) and len(set(new)) == 1  # a first prefill, equal lengths
        zigzag = self.zigzag_first_prefill and first and new[0] > 0 and new[0] % (2 * p) == 0
        placed = place_new_tokens(
            cached=self._lengths, new=new, world_size=p, block_size=self.block_size, zigzag=zigzag
        )
        return CacheStep(
            index=self._num_steps,
            world_size=p,
            zigzag=zigzag,
            cached=tuple(self._lengths),
            new=new,
            new_positions=placed,
            kv_positions=(),
        )

    def plan_step(self, new: Sequence[int]) -> CacheStep:
        """Where ``new`` tokens per sequence would go, without changing the cache.

        Raises:
            ValueError: ``new`` is not B ints >= 0.
        """
        step = self._placement(new)
        kv_positions = tuple(
            tuple(
                torch.cat([self._positions[b][r].view(), placed_b])
                for b, placed_b in enumerate(step.new_positions[r])
            )
            for r in range(self.world_size)
        )
        return dataclasses.replace(step, kv_positions=kv_positions)

    def begin_step(self, new: Sequence[int], *, check_ranks: bool = True) -> CacheStep:
        """Place ``new`` tokens per sequence, check the budget and make this the current step
        (the same ``new`` on every rank).

        Args:
            new: T_b per sequence (0 for a sequence that does not advance).
            check_ranks: agree on ``new`` first (with a group; ``Communicator.agree``).

        Returns:
            The step: positions per rank, packed-row counts (``CacheStep``).

        Raises:
            ValueError: ``new`` is not B ints >= 0, ranks passed different ``new`` or hold
                caches of other options or lengths, or ``check_ranks`` is not a bool.
            RuntimeError: a layer has not appended the previous step's K/V.
            KVCacheBudgetError: a rank would reserve more than ``budget_bytes`` (on every
                rank; the cache is unchanged).
        """
        # a check_ranks that is not a bool is validate's error: its rank tells the others
        validate = functools.partial(self._checked_placement, new, check_ranks)
        if self.comm is None:  # no group to agree over
            step = validate()[0]
        else:  # Note [Rank agreement] in tokenring.api
            what, errors = "cache step", (ValueError, RuntimeError)
            check = check_ranks is not False
            step = self.comm.agreed(validate, what=what, check_ranks=check, errors=errors)
        placed = step.new_positions
        if self.budget_bytes is not None:
            held = [
                [self._positions[b][r].size + len(placed[r][b]) for b in range(self.batch)]
                for r in range(self.world_size)
            ]
            self._check_budget(held, step.new)
        for b in range(self.batch):
            for r in range(self.world_size):
                self._positions[b][r].extend(placed[r][b])
            self._lengths[b] += step.new[b]
        # Views, not copies: later appends write past their end or into a new buffer.
        kv_positions = tuple(
            tuple(self._positions[b][r].view() for b in range(self.batch))
            for r in range(self.world_size)
        )
        step = dataclasses.replace(step, kv_positions=kv_positions)
        self._num_steps += 1
        self._step = step
        self._appended = [False] * self.num_layers
        self.memo.clear()
        return step

    def _checked_placement(
        self, new: Sequence[int], check_ranks: bool = True
    ) -> tuple[CacheStep, dict[str, Any]]:
        """:meth:`_placement` of ``new`` (every layer appended the last step) and its signature;
        ``check_ranks`` is checked here, so a rank's bad flag reaches its peers."""
        check_flags(check_ranks=check_ranks)
        step = self._placement(new)
        missing = [layer for layer, done in enumerate(self._appended) if not done]
        if missing:
            raise RuntimeError(
                f"layers {missing} have not appended the K/V of step {self._num_steps - 1}; "
                "every layer must run attention (or append) once per step"
            )
        # and what every rank's placements and budget checks follow: the options and the
        # tokens cached so far (two caches stepped in another order on each rank can agree on
        # the step index and the new tokens, and still place them after other lengths)
        names = ("num_layers", "batch", "heads_kv", "head_dim", "block_size", "budget_bytes")
        options = {name: getattr(self, name) for name in names}
        options |= {"dtype": str(self.dtype), "zigzag_first_prefill": self.zigzag_first_prefill}
        state = {"new tokens": list(step.new), "cached tokens": list(self._lengths)}
        return step, {**state, "step": self._num_steps, **options}

    def _check_budget(self, held: list[list[int]], new: tuple[int, ...]) -> None:
        """Raise if any rank would reserve more than the budget holding ``held[rank][seq]``."""
        assert self.budget_bytes is not None
        need = [self._reserve(row) for row in held]
        over = [r for r in range(self.world_size) if need[r] > self.budget_bytes]
        if not over:
            return
        r = over[0]
        others = f" (also over: ranks {over[1:]})" if len(over) > 1 else ""
        raise KVCacheBudgetError(
            f"KV cache budget exceeded at step {self._num_steps}: rank {r} would need "
            f"{need[r]} bytes ({sum(held[r])} cached tokens in blocks of {self.block_size}, "
            f"x {self.num_layers} layers x {self.token_bytes} bytes per token) but its budget "
            f"is {self.budget_bytes} bytes{others}; new tokens per sequence {list(new)}, "
            f"cached {self._lengths}. Raise budget_bytes, add ranks or shorten the context.",
            rank=r,
            budget_bytes=self.budget_bytes,
            need_bytes=need[r],
        )

    # -- storage ---------------------------------------------------------------------------------
    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this rank's new K/V rows of the current step for ``layer``.

        Args:
            k, v: ``(n, Hkv, D)`` packed rows (``CacheStep.num_rows(rank)``), sequence by
                sequence.

        Raises:
            ValueError: no step begun, a layer outside [0, L), the layer already appended this
                step, or k/v of the wrong shape, dtype or device.
        """
        step = self.check_append(layer, k, v)
        sizes = list(step.seq_rows(self.rank))
        for b, (k_b, v_b) in enumerate(zip(k.split(sizes), v.split(sizes), strict=True)):
            self._keys[layer][b].extend(k_b)
            self._values[layer][b].extend(v_b)
        self._appended[layer] = True

    def check_append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> CacheStep:
        """The current step if :meth:`append` would take ``k``, ``v``; else its ValueError."""
        step = self._step
        if step is None:
            raise ValueError("no cache step has begun; call cache.begin_step(new) first")
        if not _is_count(layer) or layer >= self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}); got {layer!r}")
        if self._appended[layer]:
            raise ValueError(
                f"layer {layer} has already appended the K/V of step {step.index}; call "
                "begin_step for the next tokens"
            )
        want = (step.num_rows(self.rank), self.heads_kv, self.head_dim)
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != want:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(
                    f"{name} must have shape (rows={want[0]}, heads_kv={want[1]}, "
                    f"head_dim={want[2]}) (this rank's new rows of step {step.index}); "
                    f"got {shape}"
                )
            if x.dtype != self.dtype or x.device != self.device:
                raise ValueError(
                    f"{name} must be {self.dtype} on {self.device} like the cache; got "
                    f"{x.dtype} on {x.device}{autocast_hint(x.device)}"
                )
        return step

    def appended(self, layer: int) -> bool:
        """Whether ``layer`` has appended the current step's K/V."""
        return self._appended[layer]

    def shard(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's cached ``(k, v)`` of ``seq`` in ``layer``: ``(n, Hkv, D)`` views, rows in
        the order of ``step.kv_positions[rank][seq]``."""
        return self._keys[layer][seq].view(), self._values[layer][seq].view()
