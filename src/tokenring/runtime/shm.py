"""Same-host transport: every message through shared memory, gloo only to build the group.

Legend: a *segment* is one anonymous shared-memory file (``memfd``) that one sender writes and
one receiver maps; a *use* is one message carried by a segment (numbered 1, 2, ... per segment);
an *inbox* is a ring of message headers that one sender fills for one receiver.

Note [Shared-memory transport]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
gloo moves every byte through the kernel's TCP stack even between processes on one host: on a
2-core box, two ranks swapping 2-8 MiB messages through the communicator's socket path pay
about 1.2 ms of CPU per MiB sent (packing, fresh receive buffers, the sender's write, the
receiver's read, gloo's I/O threads) and 0.2 ms per swap however small; through shared memory
0.1-0.2 ms per MiB and 0.13-0.15 ms (``benchmarks/transport.py``, ``results/transport.md``).
When every rank of a group can map the others' files (each rank maps the others' inbox files
through /proc when the communicator is built, a collective over its control group),
point-to-point messages of CPU tensors leave gloo altogether:

    sender                                        receiver
    copy the message into a free segment            (receive numbered k-th from this sender)
    its header (+ segment fd, index, use) into      wait: futex on the inbox's written count,
      slot k of the receiver's inbox; count k+1;      0.1 s at a time, checking the sender lives
      futex wake                              --->  header from slot k, checked (as over gloo)
                                                    map the segment (once, via /proc/pid/fd)
                                                    the message's tensors are views of it

Messages match in posting order, as gloo matches them per pair: both ends number a pair's
messages walking the slots, then the channels, in the same order (Note [Slots] in
tokenring.runtime.comm). A receive costs no copy and no system call when its message is there.
The receiver marks a use consumed when no tensor holds its memory any more (a K/V block passed
on, a partial merged): each frame is a ctypes array over its bytes, which
``torch.frombuffer`` keeps alive exactly as long as the frame's storage. A segment is free for
its sender again once its last use is consumed; a sender with no free segment big enough makes
a new one, so a send never waits on a segment. It waits on an inbox only when its receiver has
left _SLOTS headers unread, bounded by the timeout. Every wait is bounded by the communicator's
timeout, and a peer that exits or crashes is named within 0.1 s. Segments have no names, so
nothing is left behind however a process ends. At the end of each pass (``wait_sends``) a
sender keeps at most IDLE_NUM_BYTES of idle segments to write again and retires the rest
(marked, descriptor closed); a receiver unmaps the retired ones it no longer uses, so between
calls the transport holds at most that much per communicator. A closed communicator's segments
that a receiver may still read keep their descriptors until consumed (_IN_FLIGHT). Every
mapping also holds a descriptor (CPython's mmap keeps one). Space is reserved when a file
is made (``posix_fallocate``): no room raises there, naming it, instead of a SIGBUS later.

Stores are published in order and a consumed mark follows the receiver's last read of a use:
both rely on x86-64's ordering (stores are not reordered with earlier loads or stores), so the
transport is used only there. It is off for CUDA tensors (the staged path), for the lab (its
emulated links must carry the bytes: the lab sets TOKENRING_SHARED_MEMORY=0), and when any rank
asks for it off; collectives (all-gather, all-reduce) stay on gloo. The rank check's small
exchanges come through the inboxes too (Note [Exchanges through shared memory] in
tokenring.runtime.comm); a rank whose communicator failed says so in its inbox file, so a
peer waiting on it fails at once instead of at the timeout (``give_up``).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import struct
import time
import weakref
from collections.abc import Sequence

import torch

__all__ = ["ENV_VAR", "SharedMemoryLinks", "make_inboxes", "open_inboxes", "shm_wanted"]

ENV_VAR = "TOKENRING_SHARED_MEMORY"
# (last use written, last use consumed, retired by the sender) as int64, padded to a cache line
_CONTROL_NUM_BYTES = 64
FRAME_ALIGN = 64
"""Each frame of a message starts at a multiple of this many bytes in its segment: a frame
that follows one of an odd size (a bf16 partial of an odd head dim) would otherwise be read
as a tensor at an address its dtype cannot have."""
IDLE_NUM_BYTES = 64 << 20  # idle segments kept to write again, per communicator
_MIN_CAPACITY = 1 << 20
_USE = struct.Struct("<q")


def shm_wanted(option: bool | None) -> bool:
    """Whether this rank asks for the transport: ``option``, or when None the environment
    variable TOKENRING_SHARED_MEMORY (default on); only on x86-64 Linux.

    Raises:
        ValueError: the environment variable is not one of 0/1/true/false/on/off/yes/no.
    """
    if option is None:
        value = os.environ.get(ENV_VAR, "1").strip().lower()
        if value not in ("0", "1", "true", "false", "on", "off", "yes", "no"):
            raise ValueError(f"{ENV_VAR} must be 0 or 1; got {value!r}")
        option = value in ("1", "true", "on", "yes")
    machine = platform.machine().lower()
    return option and machine in ("x86_64", "amd64") and hasattr(os, "memfd_create")


def _peer_file(pid: int, fd: int) -> str:
    return f"/proc/{pid}/fd/{fd}"


# Inboxes: one file per rank, made before the probe (its first 8 bytes: the probe's token, the
# next 8: whether its communicator gave up), then one inbox per sender: (messages written, u32:
# the futex word) at 0, (messages read, u32) at 64, then _SLOTS message headers of 64 bytes.
_SLOTS = 512
_HEADER_NUM_BYTES = 64
_INBOX_NUM_BYTES = 128 + _SLOTS * _HEADER_NUM_BYTES
_FILE_HEADER_NUM_BYTES = 64
_MASK = 0xFFFFFFFF
_GAVE_UP_OFFSET = 8  # in a rank's inbox file: nonzero once its communicator failed
_WAKE_ALL = 0x7FFFFFFF


def make_inboxes(world_size: int, token: int) -> tuple[int, mmap.mmap]:
    """This rank's inbox file, holding ``token``: its descriptor and mapping."""
    fd = os.memfd_create("tokenring-inboxes")
    size = _FILE_HEADER_NUM_BYTES + world_size * _INBOX_NUM_BYTES
    try:
        os.posix_fallocate(fd, 0, size)
        mapped = mmap.mmap(fd, size)
    except OSError:
        os.close(fd)
        raise
    _USE.pack_into(mapped, 0, token)
    return fd, mapped


def open_inboxes(pid: int, fd: int, token: int) -> mmap.mmap | None:
    """Process ``pid``'s inbox file (its descriptor ``fd``) mapped here if it holds ``token``."""
    try:
        local = os.open(_peer_file(pid, fd), os.O_RDWR)
    except OSError:
        return None
    try:
        size = os.fstat(local).st_size
        mapped = mmap.mmap(local, size) if size >= _FILE_HEADER_NUM_BYTES else None
    except OSError:
        mapped = None
    finally:
        os.close(local)
    if mapped is None or _USE.unpack_from(mapped, 0)[0] != token:
        return None
    return mapped


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_LIBC = ctypes.CDLL(None, use_errno=True)
_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1  # x86-64 (the transport is used only there)


def _futex(address: int, op: int, value: int, timeout_s: float | None = None) -> None:
    """futex(2) on a word of shared memory (not FUTEX_PRIVATE: the word is in two processes)."""
    timeout = None
    if timeout_s is not None:
        timeout = ctypes.byref(_Timespec(int(timeout_s), int(timeout_s % 1 * 1e9)))
    word, long = ctypes.c_void_p(address), ctypes.c_long
    _LIBC.syscall(long(_SYS_FUTEX), word, long(op), long(value), timeout, None, long(0))


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (not exited, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


class _Box:
    """One inbox: written by its sender, read by its receiver (Note [Shared-memory transport])."""

    __slots__ = ("address", "read", "written")

    def __init__(self, mapped: mmap.mmap, index: int) -> None:
        base = _FILE_HEADER_NUM_BYTES + index * _INBOX_NUM_BYTES
        self.written = ctypes.c_uint32.from_buffer(mapped, base)
        self.read = ctypes.c_uint32.from_buffer(mapped, base + 64)
        self.address = ctypes.addressof(self.written)

    def slot(self, k: int) -> int:
        """The address of message ``k``'s header."""
        return self.address + 128 + (k % _SLOTS) * _HEADER_NUM_BYTES

    def holds(self, k: int) -> bool:
        """Whether message ``k`` (counted from 0) was written."""
        return 0 < (self.written.value - k) & _MASK < 1 << 31


class _Segment:
    """One mapped segment; ``data`` is all of it as uint8, control words first."""

    __slots__ = ("capacity", "data", "fd", "index", "lent", "map", "written")

    def __init__(self, index: int, mapped: mmap.mmap, fd: int = -1) -> None:
        self.index, self.map, self.fd = index, mapped, fd  # fd: the sender's, kept open
        self.data = torch.frombuffer(mapped, dtype=torch.uint8)
        self.capacity = len(mapped) - _CONTROL_NUM_BYTES
        self.written = _USE.unpack_from(mapped, 0)[0]
        self.lent = False  # a receiver's: tensors hold a use of it

    def consumed(self) -> int:
        return int(_USE.unpack_from(self.map, 8)[0])


def _frame_starts(sizes: Sequence[int]) -> list[int]:
    """Where frames of ``sizes`` bytes start in a segment: after its control block, each at
    the next multiple of FRAME_ALIGN."""
    starts, offset = [], _CONTROL_NUM_BYTES
    for size in sizes:
        starts.append(offset)
        offset += -(-size // FRAME_ALIGN) * FRAME_ALIGN
    return starts


def _released(segment: _Segment, use_left: list[int]) -> None:
    """One frame of a use is no longer held; with its last the use is consumed, and the
    sender may write the segment again."""
    use_left[1] -= 1
    if use_left[1] == 0:
        segment.lent = False
        _USE.pack_into(segment.map, 8, use_left[0])


# Segments of closed senders whose last message was not consumed yet: their descriptors stay
# open (a receiver opens a segment through /proc) until it is. Swept whenever links release.
_IN_FLIGHT: list[_Segment] = []


def _idle(segment: _Segment) -> bool:
    """Whether a sender's segment holds no message its receiver may still read."""
    return segment.consumed() == segment.written


def _retire(segment: _Segment) -> None:
    """A sender is done with ``segment``: marked (its receiver unmaps it when it next
    releases), its descriptor closed; the memory goes with the last mapping."""
    _USE.pack_into(segment.map, 16, 1)
    if segment.fd >= 0:
        os.close(segment.fd)
        segment.fd = -1


def _sweep(segments: list[_Segment]) -> list[_Segment]:
    """Retire the idle ``segments``; the others."""
    busy = []
    for segment in segments:
        if _idle(segment):
            _retire(segment)
        else:
            busy.append(segment)
    return busy


def _release(out: dict[int, list[_Segment]]) -> None:
    """A sender's segments go: the idle ones now, the others once consumed."""
    _IN_FLIGHT[:] = _sweep(_IN_FLIGHT + [s for pool in out.values() for s in pool])
    out.clear()


class SharedMemoryLinks:
    """This rank's end of the transport (Note [Shared-memory transport]): the segments it
    writes, per receiver, and those it maps, per sender; its inboxes and the peers' it writes.

    Args:
        rank: this rank, for messages.
        pids: every rank's process id, in group-rank order.
        inboxes: this rank's inbox file, mapped (one inbox per sender).
        peers: each peer's inbox file, mapped here, by the peer's rank.

    Attributes:
        idle_num_bytes: the idle segments kept at a pass's end to write again (IDLE_NUM_BYTES).
        num_written, num_viewed: messages sent and received through shared memory.
    """

    def __init__(
        self, rank: int, pids: Sequence[int], inboxes: mmap.mmap, peers: dict[int, mmap.mmap]
    ) -> None:
        self.rank, self.pids = rank, tuple(pids)
        self._files = {**peers, rank: inboxes}  # each file's header says if its rank gave up
        self._inboxes = {src: _Box(inboxes, src) for src in peers}  # read here
        self._outboxes = {dst: _Box(peer, rank) for dst, peer in peers.items()}  # written here
        self._num_sent = dict.fromkeys(peers, 0)
        self._num_expected = dict.fromkeys(peers, 0)
        self._num_read = dict.fromkeys(peers, 0)
        self._read_early: dict[int, set[int]] = {src: set() for src in peers}
        self._out: dict[int, list[_Segment]] = {}
        self._num_made: dict[int, int] = {}  # segments made per receiver: the next one's index
        self.idle_num_bytes = IDLE_NUM_BYTES
        self._in: dict[tuple[int, int], _Segment] = {}  # (src, index)
        self.num_written = self.num_viewed = 0  # messages through shared memory
        self._finalizer = weakref.finalize(self, _release, self._out)

    def write(self, dst: int, frames: Sequence[Sequence[torch.Tensor]]) -> tuple[int, int, int]:
        """Copy ``frames`` into a free segment to ``dst``, each frame's parts (any dtype and
        strides) back to back from a ``FRAME_ALIGN``-byte boundary (so a frame's fields keep
        the alignment a fresh tensor has); ``(fd + 1, index, use)`` for the header."""
        sizes = [sum(t.numel() * t.element_size() for t in parts) for parts in frames]
        starts = _frame_starts(sizes)
        num_bytes = starts[-1] + sizes[-1] - _CONTROL_NUM_BYTES
        pool = self._out.setdefault(dst, [])
        segment = next((s for s in pool if s.capacity >= num_bytes and _idle(s)), None)
        if segment is None:
            self._num_made[dst] = index = self._num_made.get(dst, 0) + 1
            segment = self._make(dst, index, num_bytes)
            pool.append(segment)
        for parts, offset in zip(frames, starts, strict=True):
            for part in parts:
                size = part.numel() * part.element_size()
                target = segment.data[offset : offset + size]
                target.view(part.dtype).view(part.shape).copy_(part)
                offset += size
        segment.written += 1
        _USE.pack_into(segment.map, 0, segment.written)
        self.num_written += 1
        return segment.fd + 1, segment.index, segment.written

    def _make(self, dst: int, index: int, num_bytes: int) -> _Segment:
        # size classes an eighth of a power of two apart: a little waste, few distinct sizes
        granule = max(_MIN_CAPACITY, (1 << max(num_bytes - 1, 1).bit_length()) >> 3)
        size = _CONTROL_NUM_BYTES + -(-num_bytes // granule) * granule
        fd = -1
        try:
            fd = os.memfd_create(f"tokenring-{self.rank}-to-{dst}-{index}")
            os.posix_fallocate(fd, 0, size)  # reserve now: no room raises here, not later
            mapped = mmap.mmap(fd, size)
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            raise RuntimeError(
                f"rank {self.rank}: making a {size}-byte shared-memory segment for messages "
                f"to rank {dst} failed ({exc}); free memory, or set {ENV_VAR}=0 to send every "
                "byte over gloo"
            ) from exc
        return _Segment(index, mapped, fd)

    def view(self, src: int, where: Sequence[int], sizes: Sequence[int]) -> list[torch.Tensor]:
        """Use ``where = (fd + 1, index, use)`` of ``src``'s segment as frames of ``sizes``
        bytes (uint8, 1-D, laid out as :meth:`write` lays them), without a copy; consumed once
        no tensor holds any.

        Raises:
            RuntimeError: the segment cannot be mapped or holds another use (the sender
                failed, or wrote over a use in progress).
        """
        fd_plus_one, index, use = where
        segment = self._in.get((src, index))
        if segment is None:
            segment = self._in[(src, index)] = self._open(src, fd_plus_one - 1, index)
        written = _USE.unpack_from(segment.map, 0)[0]
        if written != use or segment.lent:
            raise RuntimeError(
                f"rank {self.rank}: shared-memory segment {index} of rank {src} holds message "
                f"{written} where the header announced {use}, or that segment is still in use "
                "here (the sender wrote over a message in use)"
            )
        segment.lent = True
        use_left = [use, len(sizes)]  # the use, and its frames still held
        frames = []
        for size, offset in zip(sizes, _frame_starts(sizes), strict=True):
            # a storage per frame, as a receive from a socket makes them
            window = (ctypes.c_uint8 * size).from_buffer(segment.map, offset)
            weakref.finalize(window, _released, segment, use_left)
            frames.append(torch.frombuffer(window, dtype=torch.uint8))
        self.num_viewed += 1
        return frames

    def _open(self, src: int, fd: int, index: int) -> _Segment:
        path = _peer_file(self.pids[src], fd)
        try:
            local = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise RuntimeError(
                f"rank {self.rank}: shared-memory segment {index} of rank {src} ({path}) "
                f"cannot be opened ({exc}); the sender failed"
            ) from exc
        try:
            return _Segment(index, mmap.mmap(local, os.fstat(local).st_size))
        finally:
            os.close(local)

    def release_idle(self) -> None:
        """Keep at most ``idle_num_bytes`` of idle segments to write again, retire the others, and
        unmap the segments their senders retired that no tensor here holds: between calls the
        transport holds little memory (run by ``Communicator.wait_sends``, at a pass's end)."""
        _IN_FLIGHT[:] = _sweep(_IN_FLIGHT)
        kept = 0
        for dst, pool in self._out.items():
            keep = []
            for segment in pool:
                idle = _idle(segment)
                if idle and kept + segment.capacity > self.idle_num_bytes:
                    _retire(segment)
                    continue
                kept += segment.capacity if idle else 0
                keep.append(segment)
            self._out[dst] = keep
        for key, segment in list(self._in.items()):
            if not segment.lent and _USE.unpack_from(segment.map, 16)[0]:
                del self._in[key]

    # -- inboxes -------------------------------------------------------------------------------
    def post(self, dst: int, header: torch.Tensor, timeout_s: float) -> None:
        """Put a message's 64-byte header (CPU, uint8) into ``dst``'s inbox and wake it.

        Raises:
            RuntimeError: ``dst`` left _SLOTS messages unread for ``timeout_s``, or is gone.
        """
        box, k = self._outboxes[dst], self._num_sent[dst]
        deadline = time.monotonic() + timeout_s
        while (k - box.read.value) & _MASK >= _SLOTS:  # full: wait for the reader (rare)
            gone = self.gone(dst)
            if gone is not None:
                raise RuntimeError(f"rank {self.rank}: {gone}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"rank {self.rank}: rank {dst} left {_SLOTS} messages unread for "
                    f"{timeout_s:g} s (it failed, or waits for something else)"
                )
            time.sleep(0.001)
        ctypes.memmove(box.slot(k), header.data_ptr(), _HEADER_NUM_BYTES)
        box.written.value = (k + 1) & _MASK  # after the header: x86-64 keeps stores in order
        self._num_sent[dst] = k + 1
        _futex(box.address, _FUTEX_WAKE, 1)

    def give_up(self) -> None:
        """Say that this rank's communicator failed: every wait on it through these links
        (a receive, a full inbox) fails at once, naming this rank. Idempotent."""
        mine = self._files.get(self.rank)
        if mine is None:  # closed
            return
        _USE.pack_into(mine, _GAVE_UP_OFFSET, 1)
        for box in self._outboxes.values():
            _futex(box.address, _FUTEX_WAKE, _WAKE_ALL)

    def gave_up(self, rank: int) -> bool:
        """Whether ``rank``'s communicator failed (:meth:`give_up`)."""
        return _USE.unpack_from(self._files[rank], _GAVE_UP_OFFSET)[0] != 0

    def gone(self, rank: int) -> str | None:
        """Why ``rank`` will not send or read any more messages, or None."""
        if self.gave_up(rank):
            why = "a call, transfer or check failed there"
            return f"rank {rank} is gone from this communicator ({why})"
        if not _alive(self.pids[rank]):
            return f"rank {rank} is gone (it exited or crashed)"
        return None

    def expect(self, src: int) -> int:
        """The number of the next message from ``src`` (messages match in posting order)."""
        k = self._num_expected[src]
        self._num_expected[src] = k + 1
        return k

    def arrived(self, src: int, k: int) -> bool:
        return self._inboxes[src].holds(k)

    def wait(self, src: int, k: int, header: torch.Tensor, timeout_s: float) -> None:
        """Wait for message ``k`` from ``src`` and copy its header into ``header``.

        Raises:
            TimeoutError: it did not come within ``timeout_s``.
            ConnectionError: ``src`` is gone (exited or crashed) and it did not come.
        """
        box = self._inboxes[src]
        deadline = time.monotonic() + timeout_s
        while not box.holds(k):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no message within {timeout_s:g} s")
            written = box.written.value
            if not box.holds(k):  # sleeps unless the word moved on since it was read
                _futex(box.address, _FUTEX_WAIT, written, min(left, 0.1))
            gone = None if box.holds(k) else self.gone(src)
            if gone is not None:
                raise ConnectionError(gone)
        ctypes.memmove(header.data_ptr(), box.slot(k), _HEADER_NUM_BYTES)
        early = self._read_early[src]
        early.add(k)
        while self._num_read[src] in early:  # the sender reuses slots read in order
            early.discard(self._num_read[src])
            self._num_read[src] += 1
        box.read.value = self._num_read[src] & _MASK

    @property
    def num_segments(self) -> tuple[int, int]:
        """Segments this rank writes and those it has mapped."""
        return sum(len(pool) for pool in self._out.values()), len(self._in)

    @property
    def num_lent(self) -> int:
        """Mapped segments whose last use tensors still hold."""
        return sum(segment.lent for segment in self._in.values())

    def detach(self) -> None:
        """Forget everything here without retiring a segment or marking a file: in a process
        forked from the one whose links these are, whose segments and inboxes they share (Note
        [One process, one thread at a time] in tokenring.runtime.comm)."""
        self._finalizer.detach()
        for pool in self._out.values():
            for segment in pool:
                if segment.fd >= 0:  # this process's copy of the descriptor
                    os.close(segment.fd)
        self._out.clear()
        self._in.clear()
        self._files.clear()
        self._inboxes.clear()
        self._outboxes.clear()

    def close(self) -> None:
        """Drop every mapping this object holds (tensors that still view a segment keep its
        memory) and retire the segments it wrote (those a receiver may still read once they
        are consumed). Idempotent."""
        self._finalizer()
        self._out.clear()
        self._in.clear()
        self._files.clear()
        self._inboxes.clear()  # each mapping holds a descriptor (mmap keeps one) until freed
        self._outboxes.clear()
