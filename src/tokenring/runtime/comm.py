"""The communicator: every byte a strategy moves goes through one of these.

It owns a process group per *channel* (a flow, ``Flow.TRAVEL`` or ``Flow.RETURN``, of a lane),
so both directions of a link carry traffic at once; lays out each
:class:`~tokenring.core.schedule.Transfer` as one message (Note [Message frames]); posts
batched P2P, receives first; counts messages and bytes per flow and peer; and may record a
timeline.

Note [Staged path]
~~~~~~~~~~~~~~~~~~
Where NCCL cannot run (two ranks on one device, no peer access), CUDA tensors travel over
gloo through pinned host buffers (``path == "gloo-staged"``): a send is copied to the host on
a side stream first, a receive copied to the device on the current stream when waited for.
For correctness checks of P ranks on one GPU, not for speed.

Note [Slots]
~~~~~~~~~~~~
P2P is posted in *slots* ``(step, after_segments)``: a rank posts, in one batch per flow, the
receives of transfers whose sender posts them in that slot and its own sends of that slot. All
ranks walk the slots in the same order, so NCCL's in-order streams cannot form a circular wait,
and gloo sees every receive posted no later than the matching send's batch (receives first).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import hashlib
import json
import os
import pickle
import secrets
import struct
import threading
import time
import types
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from tokenring.core.schedule import Flow, Transfer
from tokenring.core.sketch import SKETCH_NUM_VALUES, Sketch
from tokenring.runtime.shm import SharedMemoryLinks, make_inboxes, open_inboxes, shm_wanted

__all__ = [
    "HEADER_NUM_BYTES",
    "MAX_TIMEOUT_S",
    "Communicator",
    "Event",
    "Message",
    "PendingCollective",
    "PendingRecv",
    "Timeline",
    "TrafficCounter",
    "check_timeout_s",
    "clear_group_defaults",
    "destroy_idle_groups",
    "forget_destroyed_groups",
]

FieldSpec = tuple[tuple[int, ...], torch.dtype]

_T = TypeVar("_T")

MAX_TIMEOUT_S = 1e7
"""The longest timeout taken (about 115 days; check_timeout_s's message says 1e7): every wait
the library issues must end."""


def _checked_group(
    group: dist.ProcessGroup | None,
    separate_groups: object,
    stage_through_host: object,
    shared_memory: object,
) -> dist.ProcessGroup:
    """The group a Communicator runs over (the default one for None), once torch.distributed
    is initialised, the group is live and this rank's, and the flags are bools (or None).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: naming the flag or the group, its value and what was expected.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; call tokenring.init_distributed() or "
            "torch.distributed.init_process_group() before building a Communicator"
        )
    for name, flag in (
        ("separate_groups", separate_groups),
        ("stage_through_host", stage_through_host),
        ("shared_memory", shared_memory),
    ):
        # a string is truthy: shared_memory="no" would turn the transport on
        if not isinstance(flag, bool) and (flag is not None or name == "separate_groups"):
            expected = "True or False" + (" or None" if name != "separate_groups" else "")
            raise ValueError(f"{name} must be {expected}; got {flag!r}")
    base = group if group is not None else dist.group.WORLD
    assert base is not None
    if not isinstance(base, dist.ProcessGroup) or not _registered(base):
        raise ValueError(
            "group must be a live ProcessGroup that contains this rank; got "
            + (f"{base!r}" if not isinstance(base, dist.ProcessGroup) else "a destroyed one")
            + " (dist.new_group returns GroupMember.NON_GROUP_MEMBER on ranks outside it; "
            "dist.destroy_process_group destroys one)"
        )
    return base


def check_timeout_s(value: object, name: str = "timeout_s") -> float:
    """``value`` as a timeout in seconds: an int or float (not a bool: True would be a 1 s
    limit), > 0 and below MAX_TIMEOUT_S (so finite); the one check of every timeout the
    library takes (the communicator's, ``init_distributed``'s, ``launch``'s).

    Raises:
        ValueError: naming ``name``, the value and what was expected.
    """
    # nan fails both comparisons
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < MAX_TIMEOUT_S:
        return float(value)
    raise ValueError(
        f"{name} must be a finite number > 0; got {value!r} (a number of seconds below 1e7)"
    )


# (flow, lane), each with its own process group; lane 1: the bidirectional ring's other way
CHANNELS: tuple[tuple[Flow, int], ...] = tuple(
    (flow, lane) for lane in (0, 1) for flow in (Flow.TRAVEL, Flow.RETURN)
)


def _channel(tr: Transfer) -> tuple[Flow, int]:
    return (tr.payload.flow, tr.lane)


@dataclass(slots=True)
class Event:
    """One bar of a timeline: compute or a transfer, with perf_counter seconds."""

    kind: str  # "compute" | "send" | "recv" | "merge"
    label: str  # e.g. "q", "out", "kv", "step 2"
    step: int
    start_s: float
    end_s: float
    peer: int = -1
    num_bytes: int = 0


@dataclass(slots=True)
class Timeline:
    """Events of one rank; cheap (a list append per event)."""

    events: list[Event] = field(default_factory=list)

    def clear(self) -> None:
        self.events.clear()


@dataclass(slots=True)
class TrafficCounter:
    """Messages and bytes per ``(flow, peer)``, for sends and receives separately."""

    sent_bytes: dict[tuple[str, int], int] = field(default_factory=dict)
    recv_bytes: dict[tuple[str, int], int] = field(default_factory=dict)
    sent_messages: int = 0
    recv_messages: int = 0

    def add(self, *, sent: bool, flow: Flow, peer: int, num_bytes: int) -> None:
        table = self.sent_bytes if sent else self.recv_bytes
        key = (flow.value, peer)
        table[key] = table.get(key, 0) + num_bytes
        if sent:
            self.sent_messages += 1
        else:
            self.recv_messages += 1

    def total_sent(self, flow: Flow | None = None) -> int:
        return sum(v for (f, _), v in self.sent_bytes.items() if flow is None or f == flow.value)

    def reset(self) -> None:
        self.sent_bytes.clear()
        self.recv_bytes.clear()
        self.sent_messages = 0
        self.recv_messages = 0


# Note [Message header]
# ~~~~~~~~~~~~~~~~~~~~~
# Every message starts with HEADER_NUM_BYTES: five int64 (magic, payload bytes, transfer id,
# sender rank, a digest of the frames' sizes), then three that say where a payload sent
# through shared memory is (Note [Shared-memory transport] in tokenring.runtime.shm; zero
# otherwise), 64 bytes in all. gloo completes a receive of
# a *shorter* message and leaves the rest of the buffer stale, so the receiver zeroes the
# header slot before posting and checks every field on arrival, before the other frames; a
# mismatch raises naming the transfer, both sizes and the peer. Counters hold payload bytes.
#
# Note [Message frames]
# ~~~~~~~~~~~~~~~~~~~~~
# A message of two fields or more is its header frame (the header, then the fields under
# APART_MIN_BYTES back to back, largest element size first, so each lies at a multiple of
# its own) and, after it, each field of APART_MIN_BYTES or more as a
# frame of its own, in field order, on the same channel (gloo and NCCL deliver a pair's
# operations in order). Both ends derive the split from the fields' sizes alone. So a
# contiguous tensor leaves without a copy: a kernel's partial out beside its lse, any rows of
# a K/V block's k and v (Note [K/V message layout] in tokenring.runtime.ring).
#
# A message of one field travels whole, in its header frame: each frame is one more operation
# to post and, on gloo, one more ready-to-receive notice.
_MAGIC = 0x746F6B656E72696E  # "tokenrin"
HEADER_NUM_BYTES = 64  # a cache line: the payload starts 64-byte aligned, as a fresh tensor
_HEADER_FIELDS = 5
APART_MIN_BYTES = 64 * 1024  # a field this big travels as a frame of its own
AGREE_FRAME_NUM_BYTES = 4096  # one message of Communicator.all_gather_bytes
DIGEST_NUM_BYTES = 16  # blake2b digest of a call's signature (Note [Agreement by digest])
# then a signature's Sketches, in its fields' order: each its rtol (0: none), K values and K
# non-finite codes (Note [Replicated values agreed by sketch] in tokenring.core.sketch), in every
# frame MAX_SKETCHES of them (unused ones zero): the same size for every call
MAX_SKETCHES = 4
_SKETCH_STRUCT = struct.Struct(f"<{1 + 2 * SKETCH_NUM_VALUES}d")
_NO_SKETCH = Sketch(values=(0.0,) * SKETCH_NUM_VALUES, rtol=0.0)
DIGEST_FRAME_NUM_BYTES = 8 + DIGEST_NUM_BYTES + MAX_SKETCHES * _SKETCH_STRUCT.size

# Note [Agreement by digest]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``Communicator.agree`` runs before every checked call: one exchange of 16-byte blake2b
# digests (of the signature's JSON, or of the validation error) over the control (gloo)
# group. Every rank sees every digest, so all take the same branch:
#
#   all digests equal, no problem here  -> done (the signatures are equal)
#   any digest differs, or a problem    -> every rank exchanges the JSON rows (4 KiB frames)
#                                          and raises naming the field, the value and the ranks
#
# A signature may hold up to MAX_SKETCHES fields whose values are ``Sketch``es (values that must
# be the same on every rank up to rounding: Note [Replicated values agreed by sketch] in
# tokenring.core.sketch). Their numbers travel in the digest frame beside the digest (which
# covers only the fields' names); with the digests equal, every rank compares every rank's
# sketches with rank 0's, each within rank 0's rtol, so all raise together, naming every field
# that differs (a Flux model call's timestep, guidance and pooled projections are three).
#
# Note [Deferred agreement]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# An attention call posts its digest and goes on (``agreed(..., deferred=True)``); the
# exchange completes, and raises as above, at the communicator's next transfer, collective or
# ``settle()``, whichever comes first. So no message of a call leaves before its ranks agree,
# and a rank does not wait for the slowest one before it has work of its own to do: the
# planning, and the forward's first segment (the program computes it before posting slot 0:
# Note [Rank program] in tokenring.runtime.program). Where the ranks arrive apart (four ranks
# sharing two cores), a check before the first segment made every rank wait for the last: it
# is 0.3 ms of CPU, yet calls with it took 4-6 ms longer than without (bf16 forward,
# benchmarks/results/peers_shm.md); deferred, a rank waits 0.14-1.2 ms for it
# (benchmarks/rank_waits.py, results/rank_waits.md). A call that fails before it
# settles settles first (``settled_on_error``): a disagreement is the cause to report. A
# communicator closed with a check pending is not pooled (its exchange may still be posted).
# The backward, cache steps and the hybrid check before anything else, as before.
#
# Note [Errors every rank raised]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A rank check that raises raises on every rank (the verdict: a rank's problem, or the ranks
# disagree), so the code around it must not tell the peers again: they are not waiting for
# anything. Each such error is marked (_EVERY_RANK) as it leaves the check;
# ``raised_on_every_rank`` finds the mark on an error or on the errors it was raised from or
# while handling (a model's code may wrap it), and counts a failed communicator too (its
# peers learn of the failure at once, or in their next exchange). An error without either is
# this rank's alone: its peers wait somewhere for it (Note [A forward that fails on one
# rank] in tokenring.hf.attention).
_EVERY_RANK = "_tokenring_raised_on_every_rank"

# Note [Abandoned calls]
# ~~~~~~~~~~~~~~~~~~~~~~
# Messages match in posting order, per pair (Note [Slots]). A call that stops midway on one
# rank (its kernel raised, a receive failed or timed out, a header did not match) leaves
# that order behind: its peers' messages of the call still come to it, and its own never
# leave. A later call over the same communicator would take those for its own, and a header
# cannot tell them apart when they name the same transfer: the same step of the same
# strategy, other numbers. So any error out of a rank program (``execute``) marks the
# communicator failed (``abandon``), and a failed communicator refuses every exchange and
# rank check, naming the first failure; through shared memory its peers' waits on it fail
# at once, naming this rank (``SharedMemoryLinks.give_up``), over gloo at their timeout.
# Only the rank check's verdict is no failure: every rank raises it before any transfer.
# Recovery is a new communicator, built on every rank.
#
# Note [Exchanges through shared memory]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With the shared-memory transport (Note [Shared-memory transport] in tokenring.runtime.shm),
# ``all_gather_bytes`` (the rank check's digests and rows) goes through the inboxes too: each
# frame is copied into a segment and announced by a header with _EXCHANGE_MAGIC, numbered in
# posting order with the pair's other messages; a frame of another size or kind names the
# peer ("it runs other code"). A waiting rank sleeps on the inbox's futex instead of on gloo's
# sockets and I/O threads: a 4-rank check on 2 cores, 0.89-1.09 -> 0.61-0.69 ms of wall time
# (``benchmarks/profile_call.py --agree``, results/rank_waits.md). Because a
# send completes at once, a rank that gave up (timed out in a check, any failed transfer)
# marks its inbox file (``SharedMemoryLinks.give_up``): its peers' waits on it fail at once,
# naming it, and an exchange whose frame came from a rank that gave up fails too, as gloo's
# closed sockets did. The probe that sets the transport up runs over gloo.


# Note [Communication runs eagerly]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The integrations call the communicator from code a user's torch.compile traces: the
# transformers attention function's rank checks, the mask function's, generate's forward
# hooks under model.compile(), the Flux processor's checks. dynamo traced into the exchanges
# themselves, shared memory and sockets included: a 2-layer Llama's first compiled forward
# compiled 209 frames (12 s with backend="eager", 22 graphs of a few ops), recompiled more of
# them at the second and third calls, and guarded compiled code on values in shared memory
# (a peer's message counter, a file descriptor) that change under it. Nothing there is a
# tensor program: the building of a communicator and every exchange that code outside the
# attention operator calls (the checks and collectives) run eagerly (torch.compiler.disable:
# a graph break at the call, nothing traced inside). The point-to-point path (exchange,
# PendingRecv) runs only inside the attention operator's implementation, which is opaque to
# dynamo already (Note [The attention operator] in tokenring.api).
_eager = torch.compiler.disable(reason="tokenring communicates eagerly")
"""A communicator method that runs eagerly under torch.compile (Note [Communication runs
eagerly])."""


def _compare_sketches(names: list[str], frames: list[bytes], what: str) -> None:
    """ValueError, the same on every rank (each compares the same frames), naming each field
    of ``names`` where a rank's sketch (Note [Agreement by digest]) is farther from rank 0's
    than rank 0's rtol."""
    k, size = SKETCH_NUM_VALUES, _SKETCH_STRUCT.size
    diffs = []
    for i, name in enumerate(names):
        at = DIGEST_NUM_BYTES + i * size
        sketches = [
            Sketch(values=tuple(u[1 : 1 + k]), rtol=u[0], nonfinite=tuple(u[1 + k :]))
            for u in (_SKETCH_STRUCT.unpack(f[at : at + size]) for f in frames)
        ]
        first = sketches[0]
        for r, other in enumerate(sketches[1:], start=1):
            distance = first.distance(other)
            if other.nonfinite != first.nonfinite:
                diffs.append(
                    f"{name}: rank {r} differs from rank 0 in its NaN or inf values (their "
                    "places or kinds)"
                )
                break
            if not distance <= first.rtol:
                diffs.append(
                    f"{name}: rank {r} differs from rank 0 (the distance of their values is "
                    f"{distance:.2g} of their norm, where rounding stays within "
                    f"{first.rtol:.2g})"
                )
                break
    if diffs:
        raise ValueError(f"ranks disagree on this {what}: " + "; ".join(diffs))


@functools.lru_cache(maxsize=4096)
def _transfer_id(tr: Transfer) -> int:
    """A stable 31-bit id of a transfer: what travels, whose rows, which step and lane."""
    key = f"{tr.payload.value}|{tr.owner}|{tr.rows}|{tr.step}|{tr.lane}|{tr.heads}"
    key += f"|{tr.src}|{tr.dst}"
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


_HEADER_STRUCT = struct.Struct(f"<{HEADER_NUM_BYTES // 8}q")
_EXCHANGE_MAGIC = 0x65676E6168637865  # "exchange": a frame of Communicator.all_gather_bytes
_SHM_FIELDS = struct.Struct("<3q")  # (segment fd + 1, index, use) after the five fields


def _write_header(buffer: torch.Tensor, tr: Transfer, num_bytes: int, layout: int) -> None:
    """Write the header of ``tr``'s message into the front of ``buffer`` (uint8)."""
    fields = [_MAGIC, num_bytes, _transfer_id(tr), tr.src, layout]
    fields += [0] * (HEADER_NUM_BYTES // 8 - _HEADER_FIELDS)
    if buffer.device.type == "cpu":  # no tensor operations: on every message's path
        ctypes.memmove(buffer.data_ptr(), _HEADER_STRUCT.pack(*fields), HEADER_NUM_BYTES)
        return
    header = torch.tensor(fields, dtype=torch.int64, device=buffer.device)
    buffer[:HEADER_NUM_BYTES].copy_(header.view(torch.uint8))


def _read_header(buffer: torch.Tensor) -> list[int]:
    """The header at the front of a CPU ``buffer`` (uint8) as it arrived."""
    return list(_HEADER_STRUCT.unpack(ctypes.string_at(buffer.data_ptr(), HEADER_NUM_BYTES)))


class Message:
    """A message laid out for the wire (Note [Message frames]): ``buffer`` is the header, then
    the small fields; ``apart`` each big field's frame (uint8, 1-D). Sent without a copy."""

    __slots__ = ("apart", "buffer")

    def __init__(self, buffer: torch.Tensor, apart: tuple[torch.Tensor, ...] = ()) -> None:
        assert buffer.dtype == torch.uint8 and buffer.dim() == 1
        self.buffer = buffer
        self.apart = apart

    @property
    def frames(self) -> list[torch.Tensor]:
        return [self.buffer, *self.apart]

    @property
    def num_bytes(self) -> int:
        """Payload bytes (the header not counted)."""
        return sum(f.numel() for f in self.frames) - HEADER_NUM_BYTES

    @property
    def layout(self) -> int:
        """A digest of the frames' sizes, as the header carries it (Note [Message frames])."""
        return _layout([f.numel() for f in self.frames])


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _apart(sizes: Sequence[int]) -> list[bool]:
    """Which fields of a message travel as frames of their own (Note [Message frames])."""
    return [len(sizes) > 1 and n >= APART_MIN_BYTES for n in sizes]


def _pack(tr: Transfer, tensors: Sequence[torch.Tensor] | Message) -> Message:
    """``tr``'s message, its header written (Note [Message frames])."""
    if isinstance(tensors, Message):
        message = tensors
    else:
        apart = _apart([_nbytes(t) for t in tensors])
        small = [t for t, own in zip(tensors, apart, strict=True) if not own]
        fields = [(tuple(t.shape), t.dtype) for t in small]
        header_frame, views = Communicator.message(fields, tensors[0].device, zeroed=False)
        for view, t in zip(views, small, strict=True):
            view.copy_(t)
        own_frames = zip(tensors, apart, strict=True)
        frames = tuple(t.contiguous().reshape(-1).view(torch.uint8) for t, own in own_frames if own)
        message = Message(header_frame.buffer, frames)
    _write_header(message.buffer, tr, message.num_bytes, message.layout)
    return message


def _sizes(fields: Sequence[FieldSpec]) -> list[int]:
    return [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in fields]


def _blank(
    fields: Sequence[FieldSpec], device: torch.device, new: Callable[..., torch.Tensor]
) -> Message:
    """A message of ``fields``, its frames made by ``new`` (Note [Message frames])."""
    frames = [new(n, dtype=torch.uint8, device=device) for n in _frame_sizes(_sizes(fields))]
    return Message(frames[0], tuple(frames[1:]))


def _inline_order(dtypes: Sequence[torch.dtype], apart: Sequence[bool]) -> list[int]:
    """The fields that travel in the header frame, in the order they lie there: by element
    size, largest first (stable), so each starts at a multiple of its own element size after
    the 64-byte header (an fp32 lse after a bf16 partial of an odd size could not be viewed)."""
    inline = [i for i, own in enumerate(apart) if not own]
    return sorted(inline, key=lambda i: -dtypes[i].itemsize)


def _unpack(message: Message, fields: Sequence[FieldSpec]) -> list[torch.Tensor]:
    """The tensors of a message (views of its frames), in field order."""
    sizes = _sizes(fields)
    apart = _apart(sizes)
    frames: dict[int, torch.Tensor] = dict(
        zip((i for i, own in enumerate(apart) if own), message.apart, strict=True)
    )
    offset = HEADER_NUM_BYTES
    for i in _inline_order([dtype for _, dtype in fields], apart):
        frames[i] = message.buffer[offset : offset + sizes[i]]
        offset += sizes[i]
    assert offset == message.buffer.numel(), "receive buffer size differs from the fields"
    out = []
    for i, (shape, dtype) in enumerate(fields):
        assert frames[i].numel() == sizes[i], "a frame's size differs from its field"
        out.append(frames[i].view(dtype).view(shape))
    return out


def _frame_sizes(sizes: Sequence[int]) -> list[int]:
    """Bytes of each frame of a message of fields of ``sizes`` bytes, the header frame first."""
    split = list(zip(sizes, _apart(sizes), strict=True))
    inline = sum(n for n, own in split if not own)
    return [HEADER_NUM_BYTES + inline, *(n for n, own in split if own)]


def _layout(frame_sizes: Sequence[int]) -> int:
    """A digest of the frames' sizes, as the header carries it (Note [Message frames])."""
    return zlib.crc32(",".join(str(n) for n in frame_sizes).encode()) & 0x7FFFFFFF


def _first_line(exc: BaseException) -> str:
    lines = str(exc).splitlines()
    return lines[0][:300] if lines else type(exc).__name__


def _check_header(
    rank: int, tr: Transfer, header: list[int], expected_bytes: int, expected_layout: int
) -> None:
    """Raise unless ``header`` announces ``tr`` with the expected bytes and frames."""
    magic, num_bytes, transfer_id, sender, layout = header[:_HEADER_FIELDS]
    what = (
        f"rank {rank}: receive of {tr.payload.value!r} rows {tr.rows} of owner {tr.owner} "
        f"from rank {tr.src} at step {tr.step}"
    )
    if magic != _MAGIC:
        raise RuntimeError(
            f"{what} completed without a message header (expected {expected_bytes} payload "
            "bytes; the peer sent a shorter or foreign message: its schedule differs from "
            "this rank's, e.g. an option that only some ranks passed with check_ranks=False)"
        )
    if num_bytes != expected_bytes:
        raise RuntimeError(
            f"{what}: the message carries {num_bytes} payload bytes, this rank expected "
            f"{expected_bytes} (the ranks built different schedules or shapes)"
        )
    if transfer_id != _transfer_id(tr) or sender != tr.src:
        raise RuntimeError(
            f"{what}: rank {sender} sent a different transfer of the same size (the ranks "
            "built different schedules)"
        )
    if layout != expected_layout:
        raise RuntimeError(
            f"{what}: the message's fields have other sizes than this rank expected (same "
            "total bytes; the ranks built different shapes)"
        )


class _PostFailed(Exception):
    """Posting an operation with group rank ``peer`` failed with ``cause``."""

    def __init__(self, peer: int, cause: Exception) -> None:
        super().__init__(str(cause))
        self.peer, self.cause = peer, cause


def comm_path(backend: str, device: torch.device) -> str:
    """How messages of tensors on ``device`` travel: nccl, gloo or gloo-staged."""
    if backend == "gloo" and device.type == "cuda":
        return "gloo-staged"
    return backend


class PendingRecv:
    """A posted receive; ``wait()`` returns its tensors."""

    def __init__(
        self,
        comm: Communicator,
        transfer: Transfer,
        message: Message,
        fields: list[FieldSpec],
        *,
        shared: bool = False,
    ) -> None:
        self.transfer, self._comm, self._message, self._fields = transfer, comm, message, fields
        self._frame_sizes = _frame_sizes(_sizes(fields))  # what the header must announce
        self._works: list[Any] = []  # one per frame, posted in frame order
        self._posted_s = time.perf_counter()
        self._result: list[torch.Tensor] | None = None
        # what the backend fills: the frames, or host buffers if staged; with shared memory
        # nothing (``message`` is the header, which comes to this rank's inbox; wait() makes
        # the whole message)
        self._wires = [] if shared else message.frames
        self._shared = shared
        self._seq = -1  # shared: the message's number from its sender, set when posted

    def message(self) -> Message:
        """The received message, to pass on as it came (after :meth:`wait`): no copy."""
        assert self._result is not None, "wait() first"
        return self._message

    def ready(self) -> bool:
        """Whether ``wait()`` would return at once (never blocks; no host sync on CUDA)."""
        if self._shared and self._result is None:
            assert self._comm.shared is not None
            return self._comm.shared.arrived(self.transfer.src, self._seq)
        return self._result is not None or all(
            work is None or work.is_completed() for work in self._works
        )

    def wait(self) -> list[torch.Tensor]:
        if self._result is None:
            comm, tr = self._comm, self.transfer
            if self._shared:
                self._wait_shared()
            else:
                frames, works = self._message.frames, self._works or [None] * len(self._wires)
                posted = zip(frames, self._wires, works, strict=True)
                for index, (frame, wire, work) in enumerate(posted):
                    comm._wait(work, tr, "receive")
                    if wire is not frame:  # staged: host -> device, on the current stream
                        frame.copy_(wire, non_blocking=True)
                    if index == 0:  # the header frame: checked before waiting for the rest
                        self._check()
            self._result = _unpack(self._message, self._fields)
            comm._num_open -= 1
            comm._maybe_release()
            if comm.timeline is not None:
                span = (self._posted_s, time.perf_counter(), tr.src, self._message.num_bytes)
                comm.timeline.events.append(Event("recv", tr.payload.value, tr.step, *span))
        return self._result

    def _wait_shared(self) -> None:
        """The header from this rank's inbox, checked; then the message as views of the
        sender's segment (Note [Shared-memory transport] in tokenring.runtime.shm)."""
        comm, tr, header = self._comm, self.transfer, self._message.buffer
        assert comm.shared is not None
        try:
            comm.shared.wait(tr.src, self._seq, header, comm.timeout.total_seconds())
        except (TimeoutError, ConnectionError) as exc:
            raise comm._failed(tr, "receive", exc) from exc
        self._check()
        offset = header.data_ptr() + _HEADER_FIELDS * 8
        where = _SHM_FIELDS.unpack(ctypes.string_at(offset, _SHM_FIELDS.size))
        try:
            frames = comm.shared.view(tr.src, where, self._frame_sizes)
        except RuntimeError as exc:  # sent, then exited: its segment went with it
            gone = comm.shared.gone(tr.src)
            raise comm._failed(tr, "receive", ConnectionError(gone) if gone else exc) from exc
        self._message = Message(frames[0], tuple(frames[1:]))

    def _check(self) -> None:
        buffer = self._message.buffer
        sizes = self._frame_sizes
        expected = (sum(sizes) - HEADER_NUM_BYTES, _layout(sizes))
        if buffer.device.type == "cpu":
            self._comm._checked_header(self.transfer, _read_header(buffer), expected)
        else:  # checked in wait_sends, once per call: no host sync inside the step loop
            # a copy: the buffer's header slot may carry this block on (Message)
            header = buffer[:HEADER_NUM_BYTES].view(torch.int64).clone()
            self._comm._unchecked.append((self.transfer, header, expected))


class Communicator:
    """Batched, counted P2P over one process group per channel of the same ranks.

    Args:
        group: the sequence-parallel process group, its ranks in order forming the ring
            (group ranks everywhere, never global ranks). ``None``: the default group.
        timeout_s: how long any single transfer may take before the call fails.
        separate_groups: one process group per channel (default); False: all share ``group``.
        stage_through_host: move messages through host buffers (Note [Staged path]). None:
            exactly for CUDA tensors on gloo.
        shared_memory: send point-to-point messages of CPU tensors through shared memory
            when every rank of a gloo group can map the others' memory files, i.e. shares
            the host (Note [Shared-memory transport] in tokenring.runtime.shm); on only if
            every rank asks for it. None: the environment variable TOKENRING_SHARED_MEMORY
            (default 1). Building a gloo communicator checks this, a collective.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: ``timeout_s`` is not a number of seconds > 0 (below MAX_TIMEOUT_S);
            ``separate_groups`` not a bool, ``stage_through_host`` or ``shared_memory`` not a
            bool or None; ``group`` is not a ProcessGroup this rank is in, or was destroyed;
            ``timeout_s`` or ``separate_groups`` differs between the ranks (every rank raises).
    """

    @_eager
    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        timeout_s: float = 300.0,
        separate_groups: bool = True,
        stage_through_host: bool | None = None,
        shared_memory: bool | None = None,
    ) -> None:
        base = _checked_group(group, separate_groups, stage_through_host, shared_memory)
        timeout_s = check_timeout_s(timeout_s)  # a float: 3 and 3.0 are one pool key
        self.group = base
        self.rank = dist.get_rank(base)
        self.world_size = dist.get_world_size(base)
        self.timeout = timedelta(seconds=timeout_s)
        self.backend = str(dist.get_backend(base))
        ranks = dist.get_process_group_ranks(base)
        self.global_ranks = tuple(ranks)  # for messages: the group may be destroyed later
        self._closed = False
        # Note [One process, one thread at a time]
        self._pid = os.getpid()
        self._use_lock = threading.Lock()
        self._user: int | None = None  # the thread whose operations are in progress
        self._depth = 0  # entries of ``_user`` in progress
        self._num_open = 0  # receives, gathers and collectives posted, not yet waited for
        # (channels, control) made for this communicator or pooled (Note [Channel pool])
        self._pool_key: _PoolKey | None = None
        self._own: _OwnGroups | None = None
        self._build_key: str | None = None  # Note [Failures through the store]
        if self.world_size > 1:  # every rank agrees (on gloo without groups of its own too)
            self._pool_key = (self.global_ranks, self.backend, timeout_s, separate_groups)
            self._own, num_live = self._agreed_idle_groups(ranks, separate_groups)
            if separate_groups or self.backend != "gloo":
                self._own = self._own or self._make_groups(ranks, separate_groups, num_live)
            else:  # gloo over ``group`` alone: nothing to pool
                self._pool_key = None
        channels, control = self._own if self._own is not None else ({}, None)
        self._groups = {channel: channels.get(channel, base) for channel in CHANNELS}
        self._control = (control or base) if self.world_size > 1 else None
        self.counter = TrafficCounter()
        self.timeline: Timeline | None = None
        self._pending_sends: list[tuple[Any, Transfer]] = []
        self._agreeing: Callable[[], None] | None = None  # Note [Deferred agreement]
        self._unchecked: list[tuple[Transfer, torch.Tensor, tuple[int, int]]] = []
        self._broken: str | None = None
        self._verdict: BaseException | None = None  # the last deferred check's ValueError
        self.stage_through_host = stage_through_host
        self._copy_stream: Any = None
        self.shared: SharedMemoryLinks | None = None
        if self._own is not None and self.backend == "gloo":
            wanted = shm_wanted(shared_memory) and not stage_through_host
            self.shared = self._probe_shared_memory(wanted)

    def _probe_shared_memory(self, wanted: bool) -> SharedMemoryLinks | None:
        """The shared-memory links if every rank wants them and maps every other rank's inbox
        file, else None (Note [Shared-memory transport] in tokenring.runtime.shm)."""
        token, fd, inboxes = secrets.randbits(62) + 1, -1, None
        if wanted:
            with contextlib.suppress(OSError):
                fd, inboxes = make_inboxes(self.world_size, token)
        try:
            what = "the shared-memory probe"
            mine = struct.pack("<4q", fd >= 0, os.getpid(), fd, token)
            rows = [struct.unpack("<4q", row) for row in self.all_gather_bytes(mine, what=what)]
            peers = {
                r: open_inboxes(pid, peer_fd, peer_token) if want and fd >= 0 else None
                for r, (want, pid, peer_fd, peer_token) in enumerate(rows)
                if r != self.rank
            }
            seen = fd >= 0 and all(m is not None for m in peers.values())
            verdicts = self.all_gather_bytes(bytes([seen]), what=what)
        finally:
            if fd >= 0:  # every peer that could map it has (the verdicts came after)
                os.close(fd)
        if inboxes is None or not all(v == b"\x01" for v in verdicts):
            return None
        pids = [row[1] for row in rows]
        return SharedMemoryLinks(self.rank, pids, inboxes, {r: m for r, m in peers.items() if m})

    def _uses_shm(self, device: torch.device) -> bool:
        """Whether messages of tensors on ``device`` travel through shared memory (Note
        [Shared-memory transport] in tokenring.runtime.shm)."""
        return self.shared is not None and device.type == "cpu"

    def _agreed_idle_groups(
        self, ranks: list[int], separate_groups: bool
    ) -> tuple[_OwnGroups | None, int]:
        """The pooled groups every rank reuses, or None where every rank makes new ones (Note
        [Channel pool]), and the most groups a rank holds (Note [Group names]); a rank that
        does not come fails as :meth:`_new_group` does."""
        assert self._pool_key is not None
        try:
            own, num_live, self._build_key = _take_agreed_groups(
                self._pool_key, self.rank, self.timeout
            )
            return own, num_live
        except _PoolAgreementFailed as exc:
            what = "the control (gloo) group"
            if separate_groups:
                what = f"the {CHANNELS[0][0].value!r} process group of lane {CHANNELS[0][1]}"
            raise self._join_failed(what, ranks, exc) from exc

    def _make_groups(self, ranks: list[int], separate_groups: bool, num_live: int) -> _OwnGroups:
        """New groups over ``ranks``, once this rank holds ``num_live`` groups, as many as the
        rank that holds the most (Note [Group names])."""
        if len(ranks) < dist.get_world_size():  # named after the count: use_local_synchronization
            _hold_groups(num_live)
        channels: dict[tuple[Flow, int], dist.ProcessGroup] = {}
        for channel in CHANNELS if separate_groups else ():
            flow, lane = channel
            channels[channel] = self._new_group(
                ranks, f"{flow.value}_{lane}", f"the {flow.value!r} process group of lane {lane}"
            )
        # agreements: a gloo group of their own, no device sync, never queued behind transfers
        control = self._new_group(ranks, "control", "the control (gloo) group", backend="gloo")
        return channels, control

    def _new_group(
        self, ranks: list[int], name: str, what: str, backend: str | None = None
    ) -> dist.ProcessGroup:
        # group rank i is ranks[i] as in ``group``, whose ranks need not be sorted (torch's
        # new_group(sort_ranks=False)); new_group sorts unless told not to, and only a torch
        # that knows sort_ranks can make an unsorted group
        order: dict[str, Any] = {} if ranks == sorted(ranks) else {"sort_ranks": False}
        try:
            made = dist.new_group(
                ranks=ranks,
                timeout=self.timeout,
                backend=backend,
                # Note [Channel pool]
                use_local_synchronization=len(ranks) < dist.get_world_size(),
                group_desc=f"tokenring_{name}",
                **order,
            )
        except Exception as exc:
            raise self._join_failed(what, ranks, exc) from exc
        assert made is not None
        return made

    def _join_failed(self, what: str, ranks: list[int], exc: Exception) -> RuntimeError:
        return RuntimeError(
            f"rank {self.rank}: creating {what} over ranks {ranks} failed; a peer did not "
            f"join in time (it failed, is slow, or did not call attention with this group): {exc}"
        )

    # -- agreement ---------------------------------------------------------------------------
    @_eager
    def all_gather_bytes(
        self, data: bytes, *, what: str, frame_num_bytes: int = AGREE_FRAME_NUM_BYTES
    ) -> list[bytes]:
        """Every rank's ``data`` (at most ``frame_num_bytes - 8`` bytes), in group-rank order,
        over the control group (or the inboxes: Note [Exchanges through shared memory])
        within the timeout.

        Args:
            what: what the ranks agree on, for the error message.
            frame_num_bytes: the size of each message; the same on every rank.

        Raises:
            ValueError: ``data`` is too long.
            RuntimeError: ranks not heard from within the timeout, or gone (named).
        """
        return self._post_gather(data, what=what, frame_num_bytes=frame_num_bytes)()

    def _post_gather(
        self, data: bytes, *, what: str, frame_num_bytes: int
    ) -> Callable[[], list[bytes]]:
        """:meth:`all_gather_bytes`, posted: what waits for it and returns every rank's data."""
        with self._in_use():
            self.settle()
            if len(data) > frame_num_bytes - 8:
                raise ValueError(
                    f"data for {what} must be at most {frame_num_bytes - 8} bytes; got {len(data)}"
                )
            self._check_open()
            if self.world_size == 1:
                return lambda: [data]
            self._check_usable(what)
            # row r: rank r's length (int64) then data; ctypes: tensor ops cost more than the swap
            table = torch.zeros(self.world_size, frame_num_bytes, dtype=torch.uint8)
            mine = table[self.rank]
            framed = struct.pack("<q", len(data)) + data
            ctypes.memmove(mine.data_ptr(), framed, len(framed))
            frames = {r: table[r] for r in range(self.world_size) if r != self.rank}
            swapped = self._post_swap(mine, frames)
            self._num_open += 1

            def finish() -> list[bytes]:
                try:
                    silent, closed = swapped()
                except BaseException as exc:  # interrupted while waiting: the swap is half done
                    self._interrupted(exc)
                    raise
                finally:
                    self._num_open -= 1
                    self._maybe_release()
                if silent or closed:
                    parts = []
                    if silent:
                        parts.append(
                            f"rank(s) {silent} did not arrive within "
                            f"{self.timeout.total_seconds():g} s (frozen, slow, failed before the "
                            "call, called something else, or skipped this check: check_ranks=False "
                            "on it, not here)"
                        )
                    parts.extend(closed.values())
                    message = f"rank {self.rank}: {what}: " + "; ".join(parts)
                    raise self._failure(f"{what} failed", message)
                out = []
                for r in range(self.world_size):
                    start = table.data_ptr() + r * frame_num_bytes
                    (num,) = struct.unpack("<q", ctypes.string_at(start, 8))
                    out.append(ctypes.string_at(start + 8, min(max(num, 0), frame_num_bytes - 8)))
                return out

            return finish

    def _post_swap(
        self, mine: torch.Tensor, frames: dict[int, torch.Tensor]
    ) -> Callable[[], tuple[list[int], dict[int, str]]]:
        """Post the swap of ``mine`` for every peer's frame; what waits for it (within the
        timeout, from when it is called) and returns the peers silent, and those gone with
        why. Through the inboxes when this communicator has them (:meth:`_post_shared_swap`)."""
        if self.shared is not None:
            return self._post_shared_swap(mine, frames)
        control = self._control
        assert control is not None
        silent: list[int] = []
        closed: dict[int, str] = {}

        def attempt(r: int, call: Callable[..., Any], *args: Any, waiting: bool = False) -> Any:
            """``call(*args)``; on failure None, with ``r`` silent (a wait timed out) or gone."""
            try:
                return call(*args)
            except Exception as exc:
                if waiting and "imed out" in str(exc):
                    silent.append(r)
                else:
                    why = _first_line(exc)
                    closed.setdefault(r, f"rank {r} is gone (it exited or crashed): {why}")
                return None

        # the group's own send and recv: dist.isend / irecv add Python checks
        recvs = {r: attempt(r, control.recv, [frame], r, 0) for r, frame in frames.items()}
        sends = {r: attempt(r, control.send, [mine], r, 0) for r in frames}

        def wait() -> tuple[list[int], dict[int, str]]:
            deadline = time.monotonic() + self.timeout.total_seconds()

            def left() -> timedelta:
                return timedelta(seconds=max(deadline - time.monotonic(), 0.01))

            # A peer gone already: this exchange cannot complete; say so at once.
            for r, work in recvs.items() if not closed else ():
                attempt(r, work.wait, left(), waiting=True)
            for r, work in sends.items() if not silent and not closed else ():
                attempt(r, work.wait, left())
            return silent, closed

        return wait

    def _post_shared_swap(
        self, mine: torch.Tensor, frames: dict[int, torch.Tensor]
    ) -> Callable[[], tuple[list[int], dict[int, str]]]:
        """:meth:`_post_swap` through the inboxes (Note [Exchanges through shared memory])."""
        shared = self.shared
        assert shared is not None
        silent: list[int] = []
        closed: dict[int, str] = {}
        num_bytes = mine.numel()
        seqs = {r: shared.expect(r) for r in frames}
        header = torch.empty(HEADER_NUM_BYTES, dtype=torch.uint8)  # post copies it
        for r in frames:
            where = shared.write(r, [[mine]])
            fields = (_EXCHANGE_MAGIC, num_bytes, 0, self.rank, 0, *where)
            ctypes.memmove(header.data_ptr(), _HEADER_STRUCT.pack(*fields), HEADER_NUM_BYTES)
            try:
                shared.post(r, header, self.timeout.total_seconds())
            except RuntimeError as exc:
                closed[r] = _first_line(exc).removeprefix(f"rank {self.rank}: ")

        def wait() -> tuple[list[int], dict[int, str]]:
            deadline = time.monotonic() + self.timeout.total_seconds()
            for r, frame in frames.items() if not closed else ():
                try:
                    shared.wait(r, seqs[r], header, max(deadline - time.monotonic(), 0.01))
                except TimeoutError:
                    silent.append(r)
                    continue
                except ConnectionError as exc:
                    closed[r] = str(exc)
                    continue
                magic, size, _, sender, _, *where = _read_header(header)
                if (magic, size, sender) != (_EXCHANGE_MAGIC, num_bytes, r):
                    closed[r] = (
                        f"rank {r} sent another message ({size} bytes from rank {sender}) where "
                        f"this rank expected a {num_bytes}-byte exchange frame: it runs other code"
                        " (or skipped this rank check: check_ranks=False on it, not here)"
                    )
                    continue
                try:
                    (view,) = shared.view(r, where, [num_bytes])
                except RuntimeError as exc:  # sent, then exited: its segment went with it
                    why = _first_line(exc).removeprefix(f"rank {self.rank}: ")
                    closed[r] = shared.gone(r) or why
                    continue
                frame.copy_(view)
                del view  # consumed: the sender may write the segment again
                if shared.gave_up(r):  # it sent, then gave up waiting (for this rank, maybe)
                    closed[r] = shared.gone(r) or ""
            return silent, closed

        return wait

    @_eager
    def all_gather_object(self, obj: Any, *, what: str) -> list[Any]:
        """Every rank's picklable ``obj`` in group-rank order (``what``: for errors); two rounds
        of :meth:`all_gather_bytes`, the sizes then the pickles. Not counted."""
        data = pickle.dumps(obj)
        sizes = self.all_gather_bytes(struct.pack("<q", len(data)), what=f"{what} (sizes)")
        frame_num_bytes = 8 + max(struct.unpack("<q", size)[0] for size in sizes)
        gathered = self.all_gather_bytes(data, what=what, frame_num_bytes=frame_num_bytes)
        return [pickle.loads(blob) for blob in gathered]

    @_eager
    def agree(
        self, signature: dict[str, Any] | None, problem: Exception | None, *, what: str
    ) -> None:
        """Raise on every rank unless every rank is valid and passed the same signature.

        Args:
            signature: this rank's JSON-able description of the call (None when invalid).
            problem: this rank's validation error, or None; re-raised after the exchange.
            what: the call, for messages ("attention call", "cache step").

        Raises:
            ValueError: on this rank ``problem``; on the others "rank r cannot run this
                {what}: {problem}"; on every rank the fields where signatures differ.
            RuntimeError: a rank did not arrive within the timeout, or is gone.
        """
        self._post_agree(signature, problem, what=what)()

    def _post_agree(
        self, signature: dict[str, Any] | None, problem: Exception | None, *, what: str
    ) -> Callable[[], None]:
        """:meth:`agree` with its digests posted (Note [Agreement by digest]): what waits for
        them and raises as :meth:`agree` does."""
        if self.world_size == 1:
            if problem is not None:
                raise problem
            return lambda: None
        # the call too: ranks in different calls (one skipped a check) are told so
        sketched = sorted((k, v) for k, v in (signature or {}).items() if isinstance(v, Sketch))
        if len(sketched) > MAX_SKETCHES:  # a problem the peers learn, not a raise here alone
            problem = TypeError(
                f"a signature holds {MAX_SKETCHES} Sketches at most; got {len(sketched)}"
            )
            signature, sketched = None, []
        mine: dict[str, Any] = {"signature": signature, "call": what}
        if signature is None:
            mine = {"invalid": str(problem), "call": what}
        if signature is not None and sketched:  # the digest covers their names
            mine["signature"] = signature | {name: "compared by sketch" for name, _ in sketched}
        data = json.dumps(mine, sort_keys=True).encode()
        digest = hashlib.blake2b(data, digest_size=DIGEST_NUM_BYTES).digest()
        sketches = [v for _, v in sketched] + [_NO_SKETCH] * (MAX_SKETCHES - len(sketched))
        frame = digest + b"".join(
            _SKETCH_STRUCT.pack(v.rtol, *v.values, *v.nonfinite) for v in sketches
        )
        check = f"the {what} check"
        gather = self._post_gather(frame, what=check, frame_num_bytes=DIGEST_FRAME_NUM_BYTES)

        def finish() -> None:
            frames = gather()
            try:
                if problem is not None or any(f[:DIGEST_NUM_BYTES] != digest for f in frames):
                    self._disagreement(data, problem, what)
                if sketched:  # every rank has the same fields: the digests are equal
                    _compare_sketches([name for name, _ in sketched], frames, what)
            except Exception as exc:  # every rank raises here: Note [Errors every rank raised]
                setattr(exc, _EVERY_RANK, True)
                raise

        return finish

    def raised_on_every_rank(self, exc: BaseException) -> bool:
        """Whether every rank of this communicator knows of ``exc`` already: it, or an error
        it was raised from or while handling, is a rank check's verdict (which every rank
        raised), or this communicator failed (its peers learn it at once or in their next
        exchange). Otherwise ``exc`` is this rank's alone (Note [Errors every rank raised])."""
        if self._broken is not None:
            return True
        seen: set[int] = set()
        chained: BaseException | None = exc
        while chained is not None and id(chained) not in seen:
            if getattr(chained, _EVERY_RANK, False):
                return True
            seen.add(id(chained))
            chained = chained.__cause__ or chained.__context__
        return False

    def _disagreement(self, data: bytes, problem: Exception | None, what: str) -> None:
        """The rest of :meth:`agree` where a digest differs or a rank found a problem: every
        rank's JSON row, then what raises."""
        if len(data) > AGREE_FRAME_NUM_BYTES - 8:  # an unusually long error or signature
            mine: dict[str, Any] = {"invalid": str(problem)[:1000], "call": what}
            if problem is None:
                mine = {"signature": {"digest": zlib.crc32(data)}, "call": what}
            data = json.dumps(mine).encode()
        rows = [json.loads(b) for b in self.all_gather_bytes(data, what=f"the {what} check")]
        calls = [row.get("call") for row in rows]
        if any(call != what for call in calls):
            # a rank that failed posts its error to the check it expects its peers in next
            # (Note [A forward that fails on one rank] in tokenring.hf.attention): the cause
            failed = [
                f"rank {r} failed: {row['invalid']}; "
                for r, row in enumerate(rows)
                if "invalid" in row
            ]
            hint = (  # a rank that failed says why it is elsewhere
                ""
                if failed
                else " (every rank must make the same calls, with the same check_ranks: a "
                "rank that passed check_ranks=False skipped a check the others run)"
            )
            raise ValueError(
                "".join(failed)
                + "ranks are in different calls: "
                + ", ".join(f"rank {r} in a {call}" for r, call in enumerate(calls))
                + hint
            )
        if problem is not None:
            raise problem
        invalid = [(r, row["invalid"]) for r, row in enumerate(rows) if "invalid" in row]
        if invalid:
            raise ValueError(
                "; ".join(f"rank {r} cannot run this {what}: {why}" for r, why in invalid)
            )
        first = rows[0]
        for r, row in enumerate(rows):
            if row != first:
                a, b = first.get("signature", first), row.get("signature", row)
                diffs = [
                    f"{name}: rank 0 has {a.get(name)}, rank {r} has {b.get(name)}"
                    for name in sorted(set(a) | set(b))
                    if a.get(name) != b.get(name)
                ]
                raise ValueError(f"ranks disagree on this {what}: " + "; ".join(diffs))

    @staticmethod
    def message(
        fields: Sequence[FieldSpec], device: torch.device, *, zeroed: bool = True
    ) -> tuple[Message, list[torch.Tensor]]:
        """A message of ``fields`` (zeroed or not) and views of its tensors, to fill and send."""
        message = _blank(fields, device, torch.zeros if zeroed else torch.empty)
        return message, _unpack(message, fields)

    # -- the staged path (Note [Staged path]) ---------------------------------------------------
    def path(self, device: torch.device) -> str:
        """How this communicator's messages of tensors on ``device`` travel: nccl, gloo,
        gloo-shm (Note [Shared-memory transport]) or gloo-staged."""
        if self._uses_shm(device):
            return "gloo-shm"
        if self.stage_through_host:
            return f"{self.backend}-staged"
        if self.stage_through_host is False:
            return self.backend
        return comm_path(self.backend, device)

    def _staged(self, device: torch.device) -> bool:
        return self.path(device).endswith("staged")

    def to_wire(self, buffer: torch.Tensor) -> torch.Tensor:
        """``buffer`` as the backend can send it: itself, or a host copy if staged."""
        if not self._staged(buffer.device):
            return buffer
        host = torch.empty(buffer.numel(), dtype=torch.uint8, pin_memory=buffer.is_cuda)
        if not buffer.is_cuda:
            return host.copy_(buffer)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(buffer.device)
        self._copy_stream.wait_stream(torch.cuda.current_stream(buffer.device))
        with torch.cuda.stream(self._copy_stream):
            host.copy_(buffer, non_blocking=True)
            buffer.record_stream(self._copy_stream)
        self._copy_stream.synchronize()
        return host

    # -- posting -----------------------------------------------------------------------------
    def exchange(
        self,
        sends: Sequence[tuple[Transfer, Sequence[torch.Tensor] | Message]],
        recvs: Sequence[tuple[Transfer, list[FieldSpec]]],
        *,
        device: torch.device,
    ) -> dict[Transfer, PendingRecv]:
        """Post one slot's receives and sends (receives first), one batch per channel.

        Args:
            sends: each transfer with its tensors, or its :class:`Message` (no copy).
            recvs: each transfer with ``(shape, dtype)`` of the tensors to receive.
            device: where receive buffers live.

        Returns:
            The pending receives by transfer.
        """
        with self._in_use():
            self._check_open()
            self.settle()
            self._check_usable("transfers")
            pending: dict[Transfer, PendingRecv] = {}
            batches: dict[tuple[Flow, int], tuple[list[PendingRecv], list[Any]]] = {}
            for tr, f in recvs:
                pending[tr] = rec = self._recv(tr, f, device)
                batches.setdefault(_channel(tr), ([], []))[0].append(rec)
            for tr, x in sends:
                batches.setdefault(_channel(tr), ([], []))[1].append((tr, self._send(tr, x)))
            for channel in CHANNELS:  # the same order on every rank
                if channel not in batches:
                    continue
                recv_list, sending = batches[channel]
                if self._uses_shm(device):  # numbered and posted in this order on both ends
                    self._post_shared(recv_list, sending)
                    continue
                ops = [(False, wire, rec.transfer.src) for rec in recv_list for wire in rec._wires]
                ops += [(True, wire, tr.dst) for tr, wires in sending for wire in wires]
                try:
                    works = self._post(ops, self._groups[channel])
                except Exception as exc:
                    peers = sorted({tr.src for tr, _ in recvs} | {tr.dst for tr, _ in sends})
                    with_whom = f"ranks {peers}"
                    if isinstance(exc, _PostFailed):  # the peer whose connection is closed
                        with_whom, exc = f"rank {exc.peer}", exc.cause
                    raise self._failure(
                        "posting transfers failed",
                        f"rank {self.rank}: posting the {channel[0].value!r} transfers of step "
                        f"{(sends or recvs)[0][0].step} with {with_whom} failed (a peer failed or "
                        f"exited): {_first_line(exc)}",
                    ) from exc
                if len(works) != len(ops):  # coalesced into one work (NCCL): all complete with it
                    works = [works[-1] if works else None] * len(ops)
                by_op = iter(works)
                for rec in recv_list:
                    rec._works = [next(by_op) for _ in rec._wires]
                for tr, wires in sending:
                    self._pending_sends.extend((next(by_op), tr) for _ in wires)
            return pending

    def _post_shared(
        self, recv_list: list[PendingRecv], sending: list[tuple[Transfer, list[torch.Tensor]]]
    ) -> None:
        """Number one channel's receives and put its sends' headers into their receivers'
        inboxes (Note [Shared-memory transport] in tokenring.runtime.shm)."""
        shared = self.shared
        assert shared is not None
        for rec in recv_list:
            rec._seq = shared.expect(rec.transfer.src)
        for tr, (header,) in sending:
            try:
                shared.post(tr.dst, header, self.timeout.total_seconds())
            except RuntimeError as exc:
                raise self._failed(tr, "send", exc) from exc

    def _recv(self, tr: Transfer, fields: list[FieldSpec], device: torch.device) -> PendingRecv:
        """A receive of ``tr`` to post, counted."""
        num_bytes = sum(_sizes(fields))
        shared = self._uses_shm(device)
        if shared:  # the header comes to the inbox, the rest is a view of a segment
            message = Message(torch.empty(HEADER_NUM_BYTES, dtype=torch.uint8))
        else:
            message = _blank(fields, device, torch.empty)
        # a message that never arrives has no magic
        if device.type == "cpu":
            ctypes.memset(message.buffer.data_ptr(), 0, HEADER_NUM_BYTES)
        else:
            message.buffer[:HEADER_NUM_BYTES].zero_()
        rec = PendingRecv(self, tr, message, fields, shared=shared)
        self._num_open += 1
        if self._staged(device):  # the host buffers the backend fills
            pin = device.type == "cuda"
            rec._wires = [
                torch.empty(f.numel(), dtype=torch.uint8, pin_memory=pin) for f in rec._wires
            ]
        self.counter.add(sent=False, flow=tr.payload.flow, peer=tr.src, num_bytes=num_bytes)
        return rec

    def _post(
        self, ops: Sequence[tuple[bool, torch.Tensor, int]], group: dist.ProcessGroup
    ) -> list[Any]:
        """Post ``(is_send, tensor, group peer)`` in order on ``group``; their works."""
        if self.backend == "gloo":  # posting fails at once where a peer's connection closed
            works = []
            for is_send, t, peer in ops:
                try:
                    works.append(group.send([t], peer, 0) if is_send else group.recv([t], peer, 0))
                except Exception as exc:
                    raise _PostFailed(peer, exc) from exc
            return works
        p2p = [
            dist.P2POp(dist.isend if is_send else dist.irecv, t, group=group, group_peer=peer)
            for is_send, t, peer in ops
        ]
        return dist.batch_isend_irecv(p2p)

    def _send(self, tr: Transfer, tensors: Sequence[torch.Tensor] | Message) -> list[torch.Tensor]:
        """The wire buffers of ``tr``'s message (Note [Message frames]), counted."""
        if isinstance(tensors, Message):
            num_bytes, device = tensors.num_bytes, tensors.buffer.device
        else:
            num_bytes, device = sum(_nbytes(t) for t in tensors), tensors[0].device
        self.counter.add(sent=True, flow=tr.payload.flow, peer=tr.dst, num_bytes=num_bytes)
        if self.timeline is not None:
            now = time.perf_counter()
            event = Event("send", tr.payload.value, tr.step, now, now, tr.dst, num_bytes)
            self.timeline.events.append(event)
        if self._uses_shm(device):  # the header, posted to the receiver's inbox
            return [self._send_shared(tr, tensors, num_bytes)]
        return [self.to_wire(f) for f in _pack(tr, tensors).frames]

    def _send_shared(
        self, tr: Transfer, tensors: Sequence[torch.Tensor] | Message, num_bytes: int
    ) -> torch.Tensor:
        """Copy ``tr``'s message into a segment to its receiver (tensors straight from where
        they lie: one copy); the header to post, naming the segment (Note [Shared-memory
        transport] in tokenring.runtime.shm)."""
        assert self.shared is not None
        if isinstance(tensors, Message):
            message = _pack(tr, tensors)
            header, frames = message.buffer[:HEADER_NUM_BYTES], [[f] for f in message.frames]
        else:  # laid out as _pack lays it out, without packing it first
            sizes = [_nbytes(t) for t in tensors]
            header = torch.empty(HEADER_NUM_BYTES, dtype=torch.uint8)
            _write_header(header, tr, num_bytes, _layout(_frame_sizes(sizes)))
            apart = _apart(sizes)
            inline = [tensors[i] for i in _inline_order([t.dtype for t in tensors], apart)]
            frames = [[header, *inline]]
            frames += [[t] for t, own in zip(tensors, apart, strict=True) if own]
        where = self.shared.write(tr.dst, frames)
        offset = header.data_ptr() + _HEADER_FIELDS * 8
        ctypes.memmove(offset, _SHM_FIELDS.pack(*where), _SHM_FIELDS.size)
        return header

    def wait_sends(self) -> None:
        """Wait for every send posted so far; check the pending device headers (one sync);
        release idle shared memory (Note [Shared-memory transport] in tokenring.runtime.shm).
        A deferred rank check completes first (Note [Deferred agreement])."""
        self.settle()
        self._wait_sends_if(lambda work, tr: True)
        self._maybe_release()
        if self.shared is not None:
            self.shared.release_idle()
        if self._unchecked:
            unchecked, self._unchecked = self._unchecked, []
            headers = torch.stack([h for _, h, _ in unchecked]).tolist()
            for (tr, _, expected), header in zip(unchecked, headers, strict=True):
                self._checked_header(tr, header, expected)

    def _checked_header(self, tr: Transfer, header: list[int], expected: tuple[int, int]) -> None:
        """:func:`_check_header`; where a peer failed first, a message that is not ``tr``'s
        fails this communicator, its error after what that peer said (Note [Failures through
        the store]: one that told its peers of an error of its own, Communicator.tell, may
        have sent a check's message where this rank waits for a transfer's)."""
        try:
            _check_header(self.rank, tr, header, *expected)
        except RuntimeError as exc:
            if not self._failed_peers():
                raise  # this rank's finding: its call is abandoned, its error in the store
            raise self._failure("a receive failed", str(exc)) from None

    def release_sends(self) -> None:
        """Forget the sends that have completed (their buffers may be freed); never blocks."""
        # completed: _wait raises if it failed
        self._wait_sends_if(lambda work, _: work is None or work.is_completed())

    def wait_sends_through(self, step: int) -> None:
        """Wait for the sends of steps ``<= step`` only (on CUDA: no host sync)."""
        self._wait_sends_if(lambda _, tr: tr.step <= step)

    def wait_sent(self, transfers: Sequence[Transfer]) -> None:
        """Wait for the pending sends of ``transfers`` (a program's SENT); no host sync."""
        if transfers:
            wanted = set(transfers)
            self._wait_sends_if(lambda _, tr: tr in wanted)

    def _wait_sends_if(self, wanted: Callable[[Any, Transfer], bool]) -> None:
        """Wait for the pending sends ``wanted(work, transfer)`` picks; keep the rest."""
        later = []
        for work, tr in self._pending_sends:
            if wanted(work, tr):
                self._wait(work, tr, "send")
            else:
                later.append((work, tr))
        self._pending_sends = later

    def _wait(self, work: Any, tr: Transfer, what: str) -> None:
        if work is None:
            return
        try:
            work.wait(self.timeout)
        except Exception as exc:
            raise self._failed(tr, what, exc) from exc

    def _failed(self, tr: Transfer, what: str, exc: Exception) -> RuntimeError:
        """The error of a failed ``what`` ("send", "receive") of ``tr``; marks this
        communicator broken (its groups may hold unmatched operations)."""
        peer = tr.src if what == "receive" else tr.dst
        return self._failure(
            f"a {what} failed",
            f"rank {self.rank}: {what} of {tr.payload.value!r} rows {tr.rows} of owner "
            f"{tr.owner} {'from' if what == 'receive' else 'to'} rank {peer} at step "
            f"{tr.step} failed (peer failed, mismatched, or slower than "
            f"{self.timeout.total_seconds():.0f} s): {exc}",
        )

    def _failure(self, why: str, message: str) -> RuntimeError:
        """Mark this communicator failed for ``why`` (:meth:`_break`); ``message``, after what
        the peers that failed first said (Note [Failures through the store])."""
        self._break(why)
        failed = self._failed_peers()
        return RuntimeError((f"{failed}; so " if failed else "") + message)

    # -- collectives: posted async on ``group``, waited for at most ``timeout`` --------------

    @_eager
    def all_gather_into_tensor(
        self, output: torch.Tensor, input: torch.Tensor, *, label: str
    ) -> PendingCollective:
        """Post ``dist.all_gather_into_tensor`` (rank j's at block j of dim 0). Not counted."""
        post = functools.partial(dist.all_gather_into_tensor, output, input)
        pending = self._collective("all-gather", label, post)
        if self.world_size == 1:
            output.copy_(input.reshape(output.shape))
        return pending

    @_eager
    def all_gather(
        self, tensor: torch.Tensor, *, label: str, shapes_agreed: bool = False
    ) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape and dtype), in group-rank order. Not counted.

        Args:
            shapes_agreed: the caller knows every rank's ``tensor`` has this shape and dtype:
                skip the check (one small exchange over the control group).

        Raises:
            ValueError: the ranks' shapes or dtypes differ (every rank raises, naming each
                rank's); gloo would abort the process, NCCL read past the buffers.
        """
        if not shapes_agreed and self.world_size > 1:
            mine = f"{tuple(tensor.shape)} {tensor.dtype}".encode()[: AGREE_FRAME_NUM_BYTES - 8]
            rows = self.all_gather_bytes(mine, what=f"all-gather {label!r} shapes")
            if any(row != rows[0] for row in rows):
                raise ValueError(
                    f"tensor to all-gather ({label!r}) must have the same shape and dtype on "
                    "every rank; got "
                    + ", ".join(f"{row.decode()} on rank {r}" for r, row in enumerate(rows))
                )
        flat = tensor.contiguous().reshape(-1)
        gathered = flat.new_empty(self.world_size * flat.numel())  # rank j's at block j
        self.all_gather_into_tensor(gathered, flat, label=label).wait()
        blocks = gathered.view(self.world_size, flat.numel()).unbind(0)
        return [block.view(tensor.shape) for block in blocks]

    @_eager
    def all_reduce(
        self, tensor: torch.Tensor, *, op: Any = dist.ReduceOp.SUM, label: str
    ) -> PendingCollective:
        """Post ``dist.all_reduce`` of ``tensor`` in place (any strides: one that is not
        contiguous is reduced in a contiguous copy, written back by ``wait()``). Not counted.

        Raises:
            ValueError: ``tensor`` has elements that share memory (an expanded tensor).
        """
        shape, strides = tensor.shape, tensor.stride()
        if any(stride == 0 and size > 1 for stride, size in zip(strides, shape, strict=True)):
            raise ValueError(
                f"tensor to all-reduce ({label!r}) must not have elements that share memory; "
                f"got shape {tuple(shape)} with strides {strides} (an expanded "
                "tensor: reduce tensor.contiguous())"
            )
        # gloo reduces numel() elements from data_ptr() in memory order: a slice took other
        # elements and overwrote some outside it, and ranks whose strides differ (one
        # transposed) would add different elements (silent wrong answers).
        wire = tensor if tensor.is_contiguous() else tensor.contiguous()
        post = functools.partial(dist.all_reduce, wire, op)
        pending = self._collective("all-reduce", label, post)
        if wire is not tensor:
            pending._copy_back = (wire, tensor)
        return pending

    @_eager
    def barrier(self, *, label: str) -> None:
        """Wait until every rank of the group reached this barrier, for at most ``timeout``."""
        self._collective("barrier", label, dist.barrier).wait()

    def _collective(self, op: str, label: str, post: Callable[..., Any]) -> PendingCollective:
        """``post(group=, async_op=True)``, the collective ``op``, once this communicator is
        open and settled (a group of one: nothing)."""
        with self._in_use():
            self._check_open()
            self.settle()
            work = post(group=self.group, async_op=True) if self.world_size > 1 else None
            self._num_open += work is not None
            return PendingCollective(self, work, op, label)

    def describe_group(self) -> str:
        """The group in words, for error messages: its description and global ranks."""
        return f"group {self.group.group_desc!r} (global ranks {list(self.global_ranks)})"

    # -- lifetime ----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran; a closed communicator refuses every call."""
        return self._closed

    @property
    def group_alive(self) -> bool:
        """Whether ``group`` is still registered with torch.distributed."""
        return _registered(self.group)

    def close(self) -> None:
        """Release the groups this communicator made (to Note [Channel pool] unless it failed;
        ``group`` is the caller's); afterwards every call raises. Idempotent; call it on every
        rank once every transfer was waited for."""
        if self.closed:
            return
        self._closed = True
        if self._foreign() and self.shared is not None:  # the parent's segments and inboxes
            self.shared.detach()
            self.shared = None
        own, self._own = self._own, None
        self._groups, self._control = {}, None
        self._pending_sends.clear()
        if self._foreign():  # the groups are the parent's: never pooled here
            return
        if self._agreeing is not None:  # its exchange is still posted: never pooled
            self._agreeing = None
            self._broken = self._broken or "closed with a deferred rank check pending"
        if self.shared is not None:
            self.shared.close()
        if own is None or self._pool_key is None or self._broken is not None:
            return
        if _registered_set(own):
            _IDLE_GROUPS.setdefault(self._pool_key, []).append(own)

    def abandon(self, exc: BaseException) -> None:
        """A call stopped midway on this rank, raising ``exc``: mark this communicator failed
        (Note [Abandoned calls]), unless ``exc`` is the rank check's verdict, which every
        rank raises before any transfer of the call. A deferred check completes first, as in
        :meth:`settled_on_error`, before the peers hear of the failure.

        Raises:
            ValueError: the deferred check's verdict (the ranks disagree), the cause to report.
        """
        if exc is self._verdict:
            return
        try:
            self.settle()
        except ValueError:
            raise  # every rank raises it before any transfer: nothing is out of order
        except RuntimeError:
            pass  # a peer's view of this failure, or another: ``exc`` is the cause here
        self._fail_now(exc)

    def _fail_now(self, exc: BaseException) -> None:
        """Mark this communicator failed by ``exc`` and tell the peers at once: its error in
        the store, the inboxes, the sockets (Note [Failures through the store])."""
        if self._foreign():  # Note [One process, one thread at a time]: the parent's
            return
        if self._broken is None:  # the first failure, before the inboxes tell the peers
            self._store_failure(exc)
        self._break(f"a call failed on this rank: {_first_line(exc)}")
        self._close_links()

    def _store_failure(self, exc: BaseException | None) -> None:
        """``exc`` as this rank's entry in the store, None: no entry (Note [Failures through
        the store])."""
        if self._build_key is not None:
            with contextlib.suppress(Exception), _STORE_LOCK:  # the store may be gone
                store = dist.distributed_c10d._get_default_store()
                key = f"{self._build_key}/failed/{self.rank}"
                if exc is None:
                    store.delete_key(key)
                    return
                why = _first_line(exc) if str(exc) else type(exc).__name__
                store.set(key, why[:2000])

    @_eager
    def tell(self, exc: Exception, *, what: str, within_s: float | None = None) -> None:
        """Tell the peers that this rank's own code raised ``exc`` (no operation of this
        communicator did), at the ``what`` rank check they meet next: its problem there
        (:meth:`agree`), every rank raising it. Waits for them at most ``within_s`` (default
        TELL_WITHIN_S; the timeout where shorter): peers held in a collective of another
        library (FSDP's all-gathers) never come, and this rank's error should not wait out
        the timeout for them. Past it, this communicator fails with ``exc`` as its cause in
        the store, which peers that reach the check later read (Note [Failures through the
        store]). The caller raises ``exc``."""
        if self.world_size == 1 or self._foreign():
            return
        saved = self.timeout
        wait = TELL_WITHIN_S if within_s is None else within_s
        self.timeout = min(saved, timedelta(seconds=wait))
        # in the store first: a peer whose transfer takes the check's message for its own
        # fails at once, and starts its error with ``exc`` from there
        self._store_failure(exc)
        try:
            self.agree(None, exc, what=what)
        except Exception as got:
            if got is exc or self._broken is None:  # the peers met it: ``exc`` here,
                self._store_failure(None)  # "ranks are in different calls" there
                return
            self._close_links()  # no peer came, or one failed: ``exc`` is the cause
        finally:
            self.timeout = saved

    def _interrupted(self, exc: BaseException) -> None:
        """An operation of a call stopped on this rank by ``exc``: where it is no Exception
        (KeyboardInterrupt, SystemExit), which no rank check exchanges, the peers go on with
        the call, so this communicator fails (Note [Abandoned calls])."""
        if not isinstance(exc, Exception):
            self._fail_now(exc)

    # Note [One process, one thread at a time]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Messages match in posting order per pair (Note [Slots]). Two threads of one rank whose
    # calls overlap on one communicator interleave their messages in an order the peers do
    # not share: over gloo's sockets two calls of the same shapes took each other's messages
    # and returned wrong numbers without an error. So a communicator serves one thread at a
    # time: the thread whose operation (a transfer, a rank check, a collective) is in
    # progress holds it until everything it posted was waited for; another thread that posts
    # meanwhile raises, and the communicator fails on every rank (its first user's call too:
    # the peers may have paired either call with theirs). Calls one after another from any
    # threads (a backward on autograd's thread) are fine.
    #
    # A process forked from a rank shares its sockets and shared memory: a child that used
    # the communicator posted into the peers' inboxes as the rank, and the peers took its
    # call for the parent's (wrong numbers on both sides). So a communicator refuses every
    # operation in another process than the one that built it, and touches nothing shared
    # there (not the inboxes, the store or the pool).

    def _foreign(self) -> bool:
        return os.getpid() != self._pid

    @contextlib.contextmanager
    def _in_use(self) -> Iterator[None]:
        """Hold this communicator for the calling thread while the block posts (Note [One
        process, one thread at a time]).

        Raises:
            RuntimeError: called in another process than the one that built it, or while
                another thread's operations are in progress (this communicator fails).
        """
        if self._foreign():
            raise RuntimeError(
                f"rank {self.rank}: this communicator was built in process {self._pid} and "
                f"cannot be used in process {os.getpid()} (a fork shares its parent's "
                "connections and shared memory: its messages would be taken for the "
                "parent's); use it in the process that built it"
            )
        me = threading.get_ident()
        with self._use_lock:
            other = self._user if self._user != me and self._broken is None else None
            if other is None:
                self._user = me
                self._depth += 1
        if other is not None:
            exc = RuntimeError(
                f"rank {self.rank}: this communicator was used by two threads at once "
                f"(thread {me} posted while thread {other}'s operations were in progress); "
                "messages match in posting order, so one communicator serves one thread at "
                "a time: give each thread its own communicator, or serialize the calls"
            )
            self._fail_now(exc)
            raise exc
        try:
            yield
        finally:
            with self._use_lock:
                self._depth -= 1
            self._maybe_release()

    def _maybe_release(self) -> None:
        """Let another thread use this communicator if nothing of its user is in progress."""
        with self._use_lock:
            idle = self._depth == 0 and self._num_open == 0 and self._agreeing is None
            if idle and not self._pending_sends:
                self._user = None

    def _close_links(self) -> None:
        """Over gloo's sockets: close this rank's connections in the groups it made, so that
        a peer blocked on one fails at once instead of at its timeout (Note [Failures through
        the store]): a receive that times out closes its pair, here after 1 ms, on a tag no
        message uses."""
        if self.shared is not None or self.backend != "gloo" or self._own is None:
            return
        channels, control = self._own
        groups = {id(g): g for g in (*channels.values(), control) if g is not None}
        for group in groups.values():
            for peer in range(self.world_size):
                if peer != self.rank:
                    with contextlib.suppress(Exception):  # the timeout that closes it
                        work = group.recv([torch.zeros(1, dtype=torch.uint8)], peer, _CLOSE_TAG)
                        work.wait(timedelta(milliseconds=1))

    def _failed_peers(self, *, with_own: bool = True) -> str:
        """What ranks that abandoned a call of this communicator said (Note [Failures through
        the store]; this rank's own entry too with ``with_own``: another thread of it failed
        first), as a sentence to put before an error, or ""."""
        if self._build_key is None:
            return ""
        said = []
        with contextlib.suppress(Exception), _STORE_LOCK:
            store = dist.distributed_c10d._get_default_store()
            for r in range(self.world_size):
                key = f"{self._build_key}/failed/{r}"
                if (r != self.rank or with_own) and store.check([key]):
                    said.append(f"rank {r} failed first: {store.get(key).decode()}")
        return "; ".join(said)

    def _break(self, why: str) -> None:
        """Mark this communicator failed (its groups may hold unmatched operations; it is
        never pooled) and tell the peers that wait on it through shared memory. The first
        reason stays: it is the root cause."""
        self._broken = self._broken or why
        if self.shared is not None:
            self.shared.give_up()

    def _check_usable(self, what: str) -> None:
        """Raise if this communicator failed (Note [Abandoned calls])."""
        if self._broken is not None:
            failed = self._failed_peers(with_own=False)  # a peer's root cause (own: above)
            raise RuntimeError(
                f"rank {self.rank}: this communicator failed earlier and cannot be used for "
                f"{what}: {self._broken}" + (f" ({failed})" if failed else "") + "; build a "
                "new one on every rank (tokenring.close_communicators() drops the cached ones)"
            )

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(
                f"rank {self.rank}: this Communicator of {self.describe_group()} was closed "
                "(close() ran, or its group was destroyed); use tokenring.get_communicator("
                "group) with a live group, or build a new Communicator"
            )

    # -- checked calls -----------------------------------------------------------------------
    @_eager
    def agreed(
        self,
        validate: Callable[[], tuple[_T, dict[str, Any] | None]],
        *,
        what: str,
        check_ranks: bool = True,
        errors: tuple[type[Exception], ...] = (ValueError, NotImplementedError),
        deferred: bool = False,
    ) -> _T:
        """What ``validate()`` returns, once every rank found its call valid and the same
        (:meth:`agree`; Note [Rank agreement] in tokenring.api); else raise on every rank.

        Args:
            validate: this rank's checks; returns the result and its signature (None: only a
                failure is exchanged, a later check compares signatures).
            what: the call, for messages ("cache step").
            check_ranks: False: nothing is exchanged.
            errors: what ``validate`` raises for an invalid call; others propagate at once.
            deferred: a valid call returns at once and the check completes before this
                communicator's next transfer, collective or :meth:`settle` (Note [Deferred
                agreement]); it raises there.

        Raises:
            As :meth:`agree`; with ``check_ranks=False``, this rank's error.
        """
        try:
            try:
                result, signature = validate()
            except errors as exc:
                if check_ranks:
                    self.agree(None, exc, what=what)  # raises exc here; the peers learn it
                raise
            if check_ranks and signature is not None:
                finish = self._post_agree(signature, None, what=what)
                if deferred:
                    self._agreeing = finish
                else:
                    finish()
        except BaseException as exc:  # a KeyboardInterrupt: the peers may be in the call
            self._interrupted(exc)
            raise
        return result

    def settle(self) -> None:
        """Complete the deferred rank check, if one is pending (Note [Deferred agreement]).

        Raises:
            As :meth:`agree`.
        """
        finish, self._agreeing = self._agreeing, None
        if finish is not None:
            try:
                finish()
            except ValueError as exc:  # the ranks disagree: every rank raises, nothing sent
                self._verdict = exc
                raise

    @contextlib.contextmanager
    def settled_on_error(self) -> Iterator[None]:
        """If the block raises, complete the deferred rank check first: when the ranks
        disagree, that is the cause to report (the block's error chained to it)."""
        try:
            yield
        except BaseException as exc:
            if isinstance(exc, Exception):
                self.settle()
            else:  # a KeyboardInterrupt: the peers go on with the call (Note [Abandoned calls])
                self.abandon(exc)
            raise

    @_eager
    def all_gather_int(self, value: int, device: torch.device, *, label: str) -> list[int]:
        """Every rank's ``value``, in group-rank order (an int64 on ``device``). Not counted."""
        mine = torch.tensor([value], dtype=torch.int64, device=device)
        return [int(x) for x in self.all_gather(mine, label=label, shapes_agreed=True)]


class PendingCollective:
    """A posted collective; ``wait()`` raises after the timeout, naming op, rank and group."""

    def __init__(self, comm: Communicator, work: Any, op: str, label: str) -> None:
        self._comm, self._work, self._op, self._label = comm, work, op, label
        self._posted_s = time.perf_counter()
        self._copy_back: tuple[torch.Tensor, torch.Tensor] | None = None  # (result, caller's)

    @_eager
    def wait(self) -> None:
        comm = self._comm
        if self._work is not None:
            try:
                self._work.wait(comm.timeout)
                comm._num_open -= 1
                comm._maybe_release()
            except Exception as exc:
                raise comm._failure(
                    f"the {self._op} {self._label!r} failed",
                    f"rank {comm.rank}: the {self._op} {self._label!r} over "
                    f"{comm.describe_group()} failed or did not complete within the "
                    f"communicator's timeout of {comm.timeout.total_seconds():g} s (a peer "
                    f"failed, was called with other arguments, or is slower): {exc}",
                ) from exc
            self._work = None
            if comm.timeline is not None:
                event = Event("recv", self._label, 0, self._posted_s, time.perf_counter())
                comm.timeline.events.append(event)
        if self._copy_back is not None:
            result, target = self._copy_back
            self._copy_back = None
            target.copy_(result)


# Note [Channel pool]
# ~~~~~~~~~~~~~~~~~~~
# The groups a closed communicator made wait here for the next communicator over the same
# ranks, backend, timeout and channel layout instead of being destroyed, so a program that
# makes a group per step keeps a flat number of sockets and threads (a failed communicator's
# are never reused). Destroying them also invites a torch naming clash: a group made with
# use_local_synchronization is named after its ranks and the number of live groups, so a new
# one can get a live group's name ("already been created") or a destroyed one's stale store
# addresses ("Connection refused").
#
# Whether to reuse is agreed by the ranks, as dist.new_group is a collective: pools differ
# when a communicator failed on some ranks only (a rank check that timed out on rank 0
# because rank 1 raised before its call: rank 0's is not pooled, rank 1's is), or after
# destroy_idle_groups ran on some ranks only. Each rank names the pooled sets it holds for
# the key (a digest of its groups' names: torch derives a group's store prefix from its
# name, so the ranks of one set name it alike), oldest first, and swaps the list with the
# other ranks through the default group's store (reachable before any new group exists,
# whatever the backend), under a key of the ranks and backend and this rank's count of builds
# over them, within the communicator's timeout (each rank's timeout and separate_groups travel
# in its entry: ranks whose options differ raise ValueError naming them, instead of waiting
# under different keys until each blamed the other for not arriving, or meeting a later build
# of the other kind). A gloo communicator without separate groups pools nothing but agrees
# all the same:
#
#   every rank holds the same sets (the normal path)  -> every rank takes the newest
#   sets held by some ranks only                       -> dropped from the pool (not destroyed)
#   no set held by every rank                          -> every rank makes new groups
#
# "Newest" is in rank 0's order, so every rank picks the same set. Ranks that arrive
# together meet by polling the store for a few milliseconds (FileStore.wait sleeps 10 ms
# between looks): a 2-rank build and close over launch's FileStore (2 busy cores) took
# 1.3-1.5 ms with the agreement, 1.0-1.7 ms without it; a plain wait, 13.5 ms.
# A rank not heard from fails the build as a new_group would
# ("creating ... failed; a peer did not join in time"); the rank that timed out marks its
# entry given up, so a peer that comes later fails too and the counts of builds stay in
# step. A rank deletes its entry of two builds ago: every peer has read it, as each wrote
# its entry of the last build, which this rank read, only after reading that one.
# Note [Failures through the store]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A rank whose call stops midway (its kernel raised) tells peers waiting on it through
# shared memory at once (Note [Abandoned calls]), but not why ("rank 1 is gone"). Over
# sockets a peer's posted receive can only time out: gloo wakes it for a closed socket, not
# for a peer that lives on, and its message said "timed out". So the failing rank first writes
# its error to the default group's store under the key its communicator's build agreed on
# (Note [Channel pool]: the same on every rank), and a peer whose transfer, collective or
# agreement of that communicator fails reads its peers' entries (a non-blocking check) and
# puts "rank r failed first: ..." at the head of its error. Over gloo's sockets it then
# closes its connections in the groups it made (a receive on an unused tag that times out
# after 1 ms closes its pair): a peer blocked on one fails at once ("Connection closed by
# peer"), abandons its call and closes its own, so the failure crosses a ring of P ranks in
# about P hops instead of a timeout each. NCCL peers still wait for the timeout.
TELL_WITHIN_S = 1.0
"""How long :meth:`Communicator.tell` waits for the peers at the check they meet next: the
compute between two of a model's rank checks (a layer, the head) with room to spare. A peer
held in a transfer's receive instead (over gloo's sockets the check's message cannot reach it)
learns when the teller stops waiting and closes its links; one that comes later finds the
error in the store. So it is short: the price of missing a slow peer is only a communicator
failed on every rank (rebuilt by the next ``get_communicator`` after
``close_communicators()``) instead of one that stays usable."""
_STORE_LOCK = threading.Lock()
"""Serialises this process's failure entries in the store (Note [Failures through the store]):
threads of one rank may fail at once, and a store client is not made for concurrent use."""

_CLOSE_TAG = 1 << 30
"""The tag of :meth:`Communicator._close_links`' receives (every message uses tag 0)."""

_PoolKey = tuple[tuple[int, ...], str, float, bool]  # ranks, backend, timeout_s, separate
_OwnGroups = tuple[dict[tuple[Flow, int], dist.ProcessGroup], dist.ProcessGroup]  # + control
_IDLE_GROUPS: dict[_PoolKey, list[_OwnGroups]] = {}
# communicators built over each (ranks, backend) on this rank (ranks whose timeouts or
# separate_groups differ meet under one store key, and learn it)
_NUM_BUILDS: dict[tuple[tuple[int, ...], str], int] = {}
_GAVE_UP = "!"  # what a rank that timed out leaves in its entry
_POLL_S = 0.005  # how long _wait_for polls before it waits


class _PoolAgreementFailed(RuntimeError):
    """A rank did not come to agree on pooled groups (Note [Channel pool])."""


def _set_name(own: _OwnGroups) -> str:
    """A pooled set's name, the same on each of its ranks (Note [Channel pool])."""
    channels, control = own
    names = [channels[c].group_name for c in sorted(channels, key=str)] + [control.group_name]
    return hashlib.blake2b("/".join(names).encode(), digest_size=8).hexdigest()


def _take_agreed_groups(
    key: _PoolKey, rank: int, timeout: timedelta
) -> tuple[_OwnGroups | None, int, str]:
    """The pooled set for ``key`` that every rank of the group takes, or None where every rank
    makes new groups (Note [Channel pool]), the most groups a rank of it holds (Note [Group
    names]) and a store key of this build, the same on every rank (Note [Failures through the
    store]); ``rank``: this rank's group rank.

    Raises:
        _PoolAgreementFailed: a rank did not arrive within ``timeout``, or gave up waiting.
        ValueError: the ranks' communicators have different timeouts or separate_groups
            (each rank's named).
    """
    ranks, backend, timeout_s, separate = key
    idle = [own for own in _IDLE_GROUPS.pop(key, []) if _registered_set(own)]
    # (groups destroyed by destroy_process_group() of everything are dropped)
    names = [_set_name(own) for own in idle]
    counted = (ranks, backend)
    build = _NUM_BUILDS[counted] = _NUM_BUILDS.get(counted, -1) + 1
    # not keyed by the timeout or separate_groups: ranks that differ in them meet, and learn it
    prefix = "tokenring_pool/" + "_".join(map(str, ranks)) + f"/{backend}"
    keys = [f"{prefix}/{build}/{r}" for r in range(len(ranks))]
    store = dist.distributed_c10d._get_default_store()
    counts = f"{_num_live_groups()};{_world().group_count}"
    store.set(keys[rank], f"{timeout_s!r};{int(separate)};{counts};" + ",".join(names))
    try:
        _wait_for(store, keys, timeout)
    except Exception as exc:
        store.set(keys[rank], _GAVE_UP)
        silent = [r for r, k in enumerate(keys) if not store.check([k])]
        _IDLE_GROUPS[key] = idle
        raise _PoolAgreementFailed(
            f"agreeing on pooled groups: rank(s) {silent} did not arrive within "
            f"{timeout.total_seconds():g} s ({_first_line(exc)})"
        ) from exc
    lists = [store.get(k) for k in keys]
    if build >= 2:
        with contextlib.suppress(Exception):  # a store without deletion keeps it
            store.delete_key(f"{prefix}/{build - 2}/{rank}")
    gave_up = [r for r, got in enumerate(lists) if got == _GAVE_UP.encode()]
    if gave_up:
        _IDLE_GROUPS[key] = idle
        raise _PoolAgreementFailed(
            f"agreeing on pooled groups: rank(s) {gave_up} gave up waiting for this rank "
            f"after {timeout.total_seconds():g} s"
        )
    # timeout; separate_groups; live groups; groups named by number; pooled sets
    rows = [got.decode().split(";", 4) for got in lists]
    try:
        _check_same_options(rows)
    except ValueError:
        _IDLE_GROUPS[key] = idle
        raise
    held = [set(row[4].split(",")) - {""} for row in rows]
    common = set.intersection(*held)
    newest = [name for name in rows[0][4].split(",") if name in common][-1:]
    by_name = dict(zip(names, idle, strict=True))
    _IDLE_GROUPS[key] = [by_name[name] for name in names if name in common - set(newest)]
    num_live = max(int(row[2]) for row in rows)
    _world().group_count = max(int(row[3]) for row in rows)  # Note [Group names]
    return (by_name[newest[0]] if newest else None), num_live, f"{prefix}/{build}"


def _check_same_options(rows: list[list[str]]) -> None:
    """ValueError naming each rank's timeout_s or separate_groups (the first two fields of
    the ranks' pool entries) when they differ."""
    timeouts = [f"{float(row[0]):g}" for row in rows]
    separates = [str(row[1] == "1") for row in rows]
    for name, values in (("timeout_s", timeouts), ("separate_groups", separates)):
        if any(value != values[0] for value in values):
            raise ValueError(
                f"{name} must be the same on every rank of a communicator's group; got "
                + ", ".join(f"{value} on rank {r}" for r, value in enumerate(values))
            )


def _wait_for(store: dist.Store, keys: list[str], timeout: timedelta) -> None:
    """Wait until ``store`` holds ``keys``: polled for the first milliseconds, where ranks that
    arrive together meet (a FileStore's own wait sleeps 10 ms between looks), then the
    store's wait for the rest of ``timeout``."""
    start, pause_s = time.monotonic(), 1e-4
    while not store.check(keys):
        waited_s = time.monotonic() - start
        if waited_s > _POLL_S:
            store.wait(keys, max(timeout - timedelta(seconds=waited_s), timedelta(milliseconds=1)))
            return
        time.sleep(pause_s)
        pause_s = min(2 * pause_s, 1e-3)


# Note [Group names]
# ~~~~~~~~~~~~~~~~~~
# torch names a group made with use_local_synchronization (a communicator's groups over
# fewer ranks than the world) after its ranks and the number of groups the calling rank
# holds, and its ranks meet in the store under that name. Ranks that hold different numbers
# of groups would wait under different names until the timeout, then blame each other
# ("a peer did not join in time"): with world 3, groups [0, 1] and [0, 2] made on every rank
# leave rank 0 in three groups and ranks 1 and 2 in two; a communicator over [0, 1] built
# before one over [0, 2] adds five groups on ranks 0 and 1, not on rank 2. So the ranks swap
# their numbers with the pool agreement (Note [Channel pool]) and each rank below the
# highest first makes groups of itself alone (gloo, no peer) until it holds as many.
#
# The number goes back when a group is destroyed, and a name comes back with it: the next
# group over the same ranks would take the name of a live group ("already been created") or
# of a destroyed one, whose old addresses the store still holds ("Connection refused", a
# peer did not join). So while the world lives the library destroys none of its groups:
# close_communicators pools every closed communicator's set (forget_destroyed_groups drops
# only those destroy_process_group destroyed), the next communicator over the same ranks
# takes it again, and destroy_idle_groups destroys them at exit (launch: before it destroys
# the world).
#
# A group over every rank of the world is named by a count instead, of the groups this rank
# made so (``group_count``), and a new_group that failed counted too: a rank whose peer
# raised between the pool agreement and new_group (a KeyboardInterrupt) counted one group
# more than the peer, and every later communicator's groups met under different names
# ("Connection refused", "Wait timeout"). So the ranks swap that count in the agreement as
# well, and each takes the highest.
_FILLERS: list[dist.ProcessGroup] = []


def _world() -> Any:
    """torch.distributed's record of this process's groups."""
    return dist.distributed_c10d._world


def _num_live_groups() -> int:
    """How many process groups this rank holds (Note [Group names])."""
    return len(dist.distributed_c10d._world.pg_names)


def _hold_groups(num_live: int) -> None:
    """Make groups of this rank alone until it holds ``num_live`` (Note [Group names])."""
    me = dist.get_rank()
    while _num_live_groups() < num_live:
        filler = dist.new_group(
            [me], backend="gloo", use_local_synchronization=True, group_desc="tokenring_filler"
        )
        assert filler is not None
        _FILLERS.append(filler)


def _registered_set(own: _OwnGroups) -> bool:
    channels, control = own
    return all(_registered(g) for g in (*channels.values(), control))


def forget_destroyed_groups() -> None:
    """Drop the pooled groups and fillers no longer registered (destroy_process_group ran),
    so that freeing them joins their threads; destroy none (Note [Group names])."""
    for key in list(_IDLE_GROUPS):
        _IDLE_GROUPS[key] = [own for own in _IDLE_GROUPS[key] if _registered_set(own)]
    _FILLERS[:] = [g for g in _FILLERS if _registered(g)]


def destroy_idle_groups() -> None:
    """Destroy the pooled process groups of closed communicators (Note [Channel pool]) and
    the fillers (Note [Group names]): at exit, or when the world is torn down."""
    pooled = [
        g for idle in _IDLE_GROUPS.values() for own in idle for g in (*own[0].values(), own[1])
    ]
    pooled += _FILLERS
    _IDLE_GROUPS.clear()
    _FILLERS.clear()
    unique = list({id(g): g for g in pooled}.values())
    del pooled
    for i in range(len(unique)):  # no loop variable left holding a group
        if _registered(unique[i]):
            dist.destroy_process_group(unique[i])
    _free_at_once(unique)


def _free_at_once(groups: list[dist.ProcessGroup]) -> None:
    """Free ``groups`` (this holds their last references), each in a thread of its own, and
    wait for all: freeing a gloo group joins its transport's loop, which wakes every 10 ms,
    so one after the other they took 15-40 ms each, at every launch's end. Where no thread
    can start (at interpreter exit, Python 3.12+), one after the other."""
    boxes = [[g] for g in groups]
    groups.clear()
    threads = [threading.Thread(target=box.clear, name="tokenring-free") for box in boxes]
    del boxes  # each thread's box now holds its group's last reference
    started = []
    try:
        for thread in threads:
            thread.start()
            started.append(thread)
    except RuntimeError:  # can't create new thread at interpreter shutdown
        pass
    for thread in started:
        thread.join()
    threads.clear()  # the unstarted ones' boxes (bound methods) free theirs here


# Note [Groups in default arguments]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A gloo group alive while Python finalises can abort the process after every result was
# right (Note [Clean exit] in tokenring.launch). Some torch functions take the default group
# as a default argument (``group=group.WORLD`` in torch.distributed.nn.functional and others),
# evaluated at import: imported after init_process_group, they keep it in ``__defaults__``.
# ``clear_group_defaults`` (run by tokenring.close_communicators, so at interpreter exit) sets
# such a default (the default group, or one no longer registered) back to None, which torch
# reads as the default group. Only functions of torch's own modules are touched.


def clear_group_defaults() -> None:
    """Set to None each default argument of a torch function that holds the default process
    group or a destroyed one (Note [Groups in default arguments])."""

    def stale(value: Any) -> bool:
        # type(), not isinstance: some torch objects answer __class__ with a warning
        return issubclass(type(value), dist.ProcessGroup) and (
            value is dist.group.WORLD or not _registered(value)
        )

    for obj in gc.get_objects():
        if type(obj) is not types.FunctionType:
            continue
        module = obj.__module__ or ""
        if module != "torch" and not module.startswith("torch."):
            continue
        if obj.__defaults__ and any(stale(x) for x in obj.__defaults__):
            obj.__defaults__ = tuple(None if stale(x) else x for x in obj.__defaults__)
        if obj.__kwdefaults__ and any(stale(x) for x in obj.__kwdefaults__.values()):
            obj.__kwdefaults__ = {k: None if stale(x) else x for k, x in obj.__kwdefaults__.items()}


def _registered(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is registered with torch.distributed, i.e. not destroyed yet."""
    if not dist.is_initialized():
        return False
    try:
        dist.get_rank(group)  # raises ValueError for a group that is not registered
    except ValueError:
        return False
    return True
