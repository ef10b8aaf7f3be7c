"""Process setup and the transports as a demanding user meets them: torchrun's environment,
backends and timeouts refused before anything starts or waits, naming the variable or argument
and its value; ranks that leave threads or return what the launcher cannot read; the
communicator's in-place all-reduce of tensors that are not contiguous, and its options.

Legend: P world size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import tokenring
from tokenring.runtime.comm import Communicator

# -- the communicator ---------------------------------------------------------------------------


def _reductions_and_options() -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    problems = []
    for shared_memory in (True, False):
        comm = Communicator(timeout_s=30, shared_memory=shared_memory)
        case = f"rank {rank} shared_memory={shared_memory}"
        # a slice: gloo summed the first 6 elements of its storage, wrote them over elements
        # outside the slice, and left its own last rows alone (108, 6 where 108, 112 was due)
        base = torch.arange(12.0).reshape(3, 4) + 100 * rank
        kept = base.clone()
        view = base[:, ::2]
        comm.all_reduce(view, label="slice").wait()
        want = sum(torch.arange(12.0).reshape(3, 4) + 100 * r for r in range(world))
        if not torch.equal(view, want[:, ::2]):
            problems.append(f"{case}: slice reduced to {view.tolist()}")
        if not torch.equal(base[:, 1::2], kept[:, 1::2]):
            problems.append(f"{case}: elements outside the slice changed: {base.tolist()}")
        # ranks whose strides differ: rank 1 passes a transposed view
        mine = torch.arange(6.0).reshape(2, 3) * (rank + 1)
        if rank == 1:
            mine = mine.t().contiguous().t()
        comm.all_reduce(mine, op=dist.ReduceOp.SUM, label="strides").wait()
        total = torch.arange(6.0).reshape(2, 3) * sum(range(1, world + 1))
        if not torch.equal(mine, total):
            problems.append(f"{case}: transposed on rank 1 reduced to {mine.tolist()}")
        # an expanded tensor: gloo read and wrote 4 elements of a 1-element storage
        try:
            comm.all_reduce(torch.ones(1).expand(4), label="expanded").wait()
            problems.append(f"{case}: an expanded tensor was reduced")
        except ValueError as exc:
            if "must not have elements that share memory; got shape (4,)" not in str(exc):
                problems.append(f"{case}: {exc}")
        for dtype in (torch.bool, torch.int8, torch.complex64, torch.bfloat16):
            values = [torch.arange(6.0).reshape(3, 2) * r for r in range(world)]
            x = values[rank].to(dtype).t()  # (2, 3), not contiguous
            op = dist.ReduceOp.MAX if dtype == torch.bool else dist.ReduceOp.SUM
            comm.all_reduce(x, op=op, label=str(dtype)).wait()
            reduced = torch.stack(values).amax(0) if dtype == torch.bool else sum(values)
            if not torch.equal(x, reduced.to(dtype).t()):
                problems.append(f"{case}: {dtype} gave {x.tolist()}")
        empty = torch.zeros(0, 3).t()
        comm.all_reduce(empty, label="empty").wait()
        comm.close()
    # options: a string is truthy, so shared_memory="no" turned the transport on
    for kwargs, words in [
        ({"shared_memory": "no"}, "shared_memory must be True or False or None; got 'no'"),
        ({"stage_through_host": "no"}, "stage_through_host must be True or False or None; got"),
        ({"separate_groups": 1}, "separate_groups must be True or False; got 1"),
        ({"timeout_s": 1e7}, "timeout_s must be a finite number > 0; got 10000000.0 (a number"),
    ]:
        try:
            Communicator(**{"timeout_s": 30, **kwargs})
            problems.append(f"rank {rank}: {kwargs} accepted")
        except ValueError as exc:
            if words not in str(exc):
                problems.append(f"rank {rank}: {kwargs}: {exc}")
    # get_communicator took 1e8 for a communicator that refuses it when built
    comm = tokenring.get_communicator(None)
    try:
        tokenring.get_communicator(comm, timeout_s=1e8)
        problems.append(f"rank {rank}: get_communicator took timeout_s=1e8")
    except ValueError as exc:
        if "timeout_s must be a finite number > 0; got 100000000.0" not in str(exc):
            problems.append(f"rank {rank}: {exc}")
    return problems


def test_all_reduce_of_tensors_that_are_not_contiguous_and_communicator_options() -> None:
    per_rank = tokenring.launch(_reductions_and_options, world_size=2, timeout_s=120)
    problems = [p for rank in per_rank for p in rank]
    assert not problems, "\n".join(problems)
