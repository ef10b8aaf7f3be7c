"""Same-host transport: a message through shared memory, its header also through gloo.

Legend: a *segment* is one anonymous shared-memory file (``memfd``) that one sender writes and
one receiver maps; a *use* is one message carried by a segment (numbered 1, 2, ... per segment).

Note [Shared-memory transport]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
gloo moves every byte through the kernel's TCP stack even between processes on one host: about
0.4 ms of CPU per MiB each way on a 2-core box (the sender's write, the receiver's read, gloo's
I/O threads), where copying a MiB in memory costs under 0.05 ms. When every rank of a group can
map the others' memory files (each rank opens the others' probe files through /proc when the
communicator is built), a message of SHM_MIN_BYTES or more travels through a segment, and only
its 64-byte header (Note [Message header]) over gloo, which still orders the messages, wakes the
receiver and bounds every wait by the timeout:

    sender                                        receiver
    copy the message into a free segment            (header receive posted, as before)
    header: + (segment fd, index, use); post  --->  header arrives and is checked
                                                    map the segment (once, via /proc/pid/fd)
                                                    the message's tensors are views of it

A receive costs no copy. The receiver marks a use consumed when no tensor holds its memory any
more (a K/V block passed on, a partial merged): each frame is a ctypes array over its bytes,
which ``torch.frombuffer`` keeps alive exactly as long as the frame's storage. A segment is free
for its sender again once its last use is consumed; a sender with no free segment big enough
makes a new one, so a send never waits on shared memory, and a peer that fails leaves this rank
waiting only on gloo, bounded as before. Segments have no names, so nothing is left behind
however a process ends; a sender closes a segment's descriptor once its receiver has mapped it
(a closed communicator's unmapped ones wait in _UNMAPPED). Space is reserved when a segment is
made (``posix_fallocate``): no room raises there, naming it, instead of a SIGBUS later.

The consumed mark is a plain store after the receiver's last read: it relies on stores not
passing earlier loads (x86-64), so the transport is used only there. It is off for CUDA tensors
(the staged path), for the lab (its emulated links must carry the bytes: the lab sets
TOKENRING_SHARED_MEMORY=0), and when any rank asks for it off.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import struct
import weakref
from collections.abc import Sequence

import torch

__all__ = ["ENV_VAR", "SHM_MIN_BYTES", "SharedMemoryLinks", "shm_wanted"]

ENV_VAR = "TOKENRING_SHARED_MEMORY"
SHM_MIN_BYTES = 4096  # smaller messages ride whole in the header frame over gloo
# (last use written, last use consumed, mapped by the receiver) as int64, padded to a cache line
_CONTROL_NUM_BYTES = 64
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


def write_probe(token: int) -> int:
    """A memory file holding ``token``; its descriptor (the caller closes it)."""
    fd = os.memfd_create("tokenring-probe")
    os.write(fd, _USE.pack(token))
    return fd


def read_probe(pid: int, fd: int, token: int) -> bool:
    """Whether process ``pid``'s descriptor ``fd`` opens here and holds ``token``."""
    try:
        with open(_peer_file(pid, fd), "rb") as f:
            return f.read(_USE.size) == _USE.pack(token)
    except OSError:
        return False


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


def _released(segment: _Segment, use_left: list[int]) -> None:
    """One frame of a use is no longer held; with its last the use is consumed, and the
    sender may write the segment again."""
    use_left[1] -= 1
    if use_left[1] == 0:
        segment.lent = False
        _USE.pack_into(segment.map, 8, use_left[0])


# Segments of closed senders that their receiver has not mapped yet: their descriptors stay
# open (the receiver opens them through /proc) until it has. Swept whenever links close.
_UNMAPPED: list[_Segment] = []


def _mapped(segment: _Segment) -> bool:
    return bool(_USE.unpack_from(segment.map, 16)[0])


def _close_mapped(segments: list[_Segment]) -> list[_Segment]:
    """Close the descriptors of ``segments`` their receiver has mapped; the others."""
    left = []
    for segment in segments:
        if segment.fd >= 0 and _mapped(segment):
            os.close(segment.fd)
            segment.fd = -1
        if segment.fd >= 0:
            left.append(segment)
    return left


def _release(out: dict[int, list[_Segment]]) -> None:
    """A sender's segments go: close what was mapped, keep the rest for their receivers."""
    _UNMAPPED[:] = _close_mapped(_UNMAPPED + [s for pool in out.values() for s in pool])
    out.clear()


class SharedMemoryLinks:
    """This rank's segments: those it writes, per receiver, and those it maps, per sender
    (Note [Shared-memory transport]).

    Args:
        rank: this rank, for messages.
        pids: every rank's process id, in group-rank order.
    """

    def __init__(self, rank: int, pids: Sequence[int]) -> None:
        self.rank, self.pids = rank, tuple(pids)
        self._out: dict[int, list[_Segment]] = {}
        self._in: dict[tuple[int, int], _Segment] = {}  # (src, index)
        self.num_written = self.num_viewed = 0  # messages through shared memory
        self._finalizer = weakref.finalize(self, _release, self._out)

    def write(self, dst: int, parts: Sequence[torch.Tensor]) -> tuple[int, int, int]:
        """Copy the bytes of ``parts`` (any dtype and strides) back to back into a free segment
        to ``dst``; ``(fd + 1, index, use)`` for the header."""
        sizes = [t.numel() * t.element_size() for t in parts]
        num_bytes = sum(sizes)
        pool = self._out.setdefault(dst, [])
        segment = next(
            (s for s in pool if s.capacity >= num_bytes and s.consumed() == s.written), None
        )
        if segment is None:
            segment = self._make(dst, len(pool), num_bytes)
            pool.append(segment)
        elif segment.fd >= 0:  # once mapped, its receiver needs the descriptor no more
            _close_mapped([segment])
        offset = _CONTROL_NUM_BYTES
        for part, size in zip(parts, sizes, strict=True):
            target = segment.data[offset : offset + size]
            target.view(part.dtype).view(part.shape).copy_(part)
            offset += size
        segment.written += 1
        _USE.pack_into(segment.map, 0, segment.written)
        self.num_written += 1
        return segment.fd + 1 if segment.fd >= 0 else -1, segment.index, segment.written

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
        bytes (uint8, 1-D, back to back), without a copy; consumed once no tensor holds any.

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
        frames, offset = [], _CONTROL_NUM_BYTES
        for size in sizes:  # a storage per frame, as a receive from a socket makes them
            window = (ctypes.c_uint8 * size).from_buffer(segment.map, offset)
            weakref.finalize(window, _released, segment, use_left)
            frames.append(torch.frombuffer(window, dtype=torch.uint8))
            offset += size
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
            segment = _Segment(index, mmap.mmap(local, os.fstat(local).st_size))
        finally:
            os.close(local)
        _USE.pack_into(segment.map, 16, 1)  # its sender may close the descriptor now
        return segment

    @property
    def num_segments(self) -> tuple[int, int]:
        """Segments this rank writes and those it has mapped."""
        return sum(len(pool) for pool in self._out.values()), len(self._in)

    @property
    def num_lent(self) -> int:
        """Mapped segments whose last use tensors still hold."""
        return sum(segment.lent for segment in self._in.values())

    def close(self) -> None:
        """Drop every mapping this object holds (tensors that still view a segment keep its
        memory) and close the descriptors of the segments their receivers have mapped (the
        others once they have). Idempotent."""
        self._finalizer()
        self._out.clear()
        self._in.clear()
