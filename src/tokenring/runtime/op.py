"""What the ``tokenring::attention`` custom operator carries and runs.

``tokenring.api`` registers ``tokenring::attention`` and its backward (``torch.library``), so
``torch.compile`` sees one opaque call; eager calls take the same path. Operators take only
tensors and primitives; this module owns the rest: handles for everything else
(Note [Handles]), :class:`Plan` with :func:`forward` / :func:`backward`, and the residuals' shapes
(:func:`residual_fields`) for the fake implementation.

Note [Residuals]
~~~~~~~~~~~~~~~~
An operator's backward sees only its inputs and outputs, so whatever the backward needs is an
output (hidden from the caller)::

    strategy               backward reads         residuals (padded: s_pad rows, see layout)
    every strategy         q, k, v, out, lse      none; padded: out and lse of the buffer
                                                  (Ulysses and all-gather K/V gather again;
                                                  Note [Ulysses] and Note [All-gather K/V
                                                  rounds] in tokenring.strategies.collective)

Note [Gradient of lse]
~~~~~~~~~~~~~~~~~~~~~~
lse_i = log sum_j exp(S_ij), so a loss that uses lse adds dlse_i * P_ij to dS_ij, and the
backward becomes dS_ij = P_ij * (dout_i . v_j + dlse_i - delta_i). Every strategy and
kernel computes dS = P * (dout' . v' - delta) for some (dout', v'), so an extra head channel
carries the term: q and k get 0 there (the scores do not change), v gets 1, dout gets dlse and
out 0 (delta does not change)::

    dout'_i . v'_j = dout_i . v_j + dlse_i        dout'_i . out'_i = dout_i . out_i = delta_i

dV' = P^T dout' has dV in its first D channels; dQ and dK are dS K' and dS^T Q', whose first D
channels are dQ and dK. The extra channel's gradients are dropped. A backward with dlse thus
runs with head dim D + 1 (D + 8 on CUDA where 8 divides D, so the fused kernels still take
it) and moves that much more; a loss that does not use lse gets no dlse (the autograd node
does not materialise it) and runs as before. dlse travels in dout's dtype, as dout does.
``tokenring.diffusers`` uses the same kind of channel for its text bias.

Legend: B batch, S global seq, s local seq, s_pad padded local seq, Hq query heads, Hkv kv
heads, D head dim, P world size.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tokenring.core.layout import Layout, Padding, Sharding
from tokenring.core.masks import MaskSpec
from tokenring.core.schedule import Pass, Schedule, Strategy
from tokenring.runtime.collective import collective_pass
from tokenring.runtime.comm import Communicator, FieldSpec
from tokenring.runtime.kernels import BlockKernel, accumulation_dtype, lse_channel_width, widen
from tokenring.runtime.ring import run_backward, run_forward
from tokenring.strategies.collective import ulysses_heads

__all__ = [
    "DEFAULT_GROUP",
    "UNSUPPORTED",
    "Plan",
    "Record",
    "backward",
    "forward",
    "graph_input",
    "graph_input_message",
    "group_handle",
    "object_handle",
    "pinned_handle",
    "remember_group",
    "residual_fields",
    "resolve_group",
    "resolve_object",
]

# Note [Handles]
# ~~~~~~~~~~~~~~
# Under torch.compile dynamo can read a ProcessGroup's ``group_name`` but not hand the group to
# an operator, and building a Communicator cannot be traced. So the operators get strings and
# resolve them when they run:
#
#     value              handle                   resolved from
#     group None         DEFAULT_GROUP            get_communicator(None)
#     ProcessGroup,      "group:" + group_name    _GROUPS: filled by get_communicator, the
#       1-D DeviceMesh     (of mesh.get_group())  module wrapper and every eager call;
#                                                 dist.group.WORLD is always known
#     Communicator       "<Communicator ...>"     _OBJECTS (weak: the caller holds it)
#     Record             "<Record ...>"           eager: _OBJECTS (the call and its autograd
#                                                 node hold it); compiled: _PINNED
#
# torch.compile calls ``object_handle`` / ``pinned_handle`` once while tracing
# (``assume_constant_result``) and bakes the key into the graph. A group never seen eagerly
# cannot be named: the error says to call tokenring.get_communicator(group) first.
DEFAULT_GROUP = "default"
_GROUP_PREFIX = "group:"
_GROUPS: weakref.WeakValueDictionary[str, dist.ProcessGroup] = weakref.WeakValueDictionary()
_OBJECTS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_PINNED: dict[str, Record] = {}  # records baked into compiled graphs


def remember_group(group: dist.ProcessGroup) -> None:
    """Make ``group`` known by its name, so a compiled call can name it (Note [Handles])."""
    _GROUPS[group.group_name] = group


def _key(obj: Any) -> str:
    return f"<{type(obj).__qualname__} object at 0x{id(obj):x}>"


@torch.compiler.assume_constant_result
def object_handle(obj: Any) -> str:
    """A key that :func:`resolve_object` turns back into ``obj`` while it lives."""
    key = _key(obj)
    _OBJECTS[key] = obj
    return key


class Record:
    """Argument values that are not of their primitive's type, as the caller passed them."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values


UNSUPPORTED = "unsupported under torch.compile"
"""A record's entry in place of values a compiled graph cannot keep: why (Note [Values a graph
cannot keep] in tokenring.api); the operator raises it in the rank check."""


def graph_input_message(name: str) -> str:
    """Why option ``name`` given as a tensor (or NumPy value) cannot be compiled, and what to
    pass instead (Note [Values a graph cannot keep] in tokenring.api)."""
    if name in ("cu_seqlens", "window_size"):
        instead = f"a list or tuple of ints ({name}.tolist() outside the compiled function)"
    elif name == "softmax_scale":
        instead = "a Python float (float(softmax_scale) outside the compiled function)"
    else:
        instead = f"a Python value ({name}.item() outside the compiled function)"
    return (
        f"{name} as a tensor under torch.compile (a NumPy value is traced as one): the compiled "
        f"graph would keep the value it was traced with and ignore a later one; pass {instead}"
    )


def graph_input(value: Any) -> bool:
    """Whether ``value`` is, or a list or tuple holds, a tensor or a NumPy value (dynamo hands
    a NumPy value to :func:`pinned_handle` as a tensor)."""
    items = value if isinstance(value, list | tuple) else [value]
    return any(isinstance(x, torch.Tensor) or type(x).__module__ == "numpy" for x in items)


@torch.compiler.assume_constant_result
def pinned_handle(names: tuple[str, ...], *values: Any) -> str:
    """A key for a :class:`Record` of ``names`` and ``values``, valid for the process's life.
    Values that are inputs of the graph (tensors; NumPy values) are replaced by an
    :data:`UNSUPPORTED` entry: the graph would keep their first value."""
    inputs = [n for n, x in zip(names, values, strict=True) if graph_input(x)]
    if inputs:
        names, values = (UNSUPPORTED,), (graph_input_message(inputs[0]),)
    record = Record(dict(zip(names, values, strict=True)))
    key = _key(record)
    _PINNED[key] = record
    return key


def resolve_object(value: str | None) -> Any:
    """The object behind a key of :func:`object_handle`; any other value as it is."""
    if value is None:
        return None
    found = _OBJECTS.get(value, _PINNED.get(value))
    if found is None and value.startswith("<") and value.endswith(">"):
        raise RuntimeError(
            f"{value} was passed to tokenring's attention and no longer exists (a compiled "
            "graph outlived it); keep it alive as long as the compiled function runs"
        )
    return value if found is None else found


def group_handle(group: dist.ProcessGroup) -> str:
    """The operator's name for a process group (Note [Handles]); dynamo traces this."""
    if not torch.compiler.is_compiling():
        remember_group(group)
    return _GROUP_PREFIX + group.group_name


def resolve_group(handle: str) -> Any:
    """The group (a ProcessGroup, DeviceMesh, Communicator, None, ...) behind ``handle``."""
    if handle == DEFAULT_GROUP:
        return None
    if not handle.startswith(_GROUP_PREFIX):
        return resolve_object(handle)
    name = handle[len(_GROUP_PREFIX) :]
    group = _GROUPS.get(name)
    world = dist.group.WORLD if dist.is_initialized() else None
    if group is None and world is not None and world.group_name == name:
        group = world
    if group is None:
        raise RuntimeError(
            f"process group {name!r} is not known to tokenring: a compiled call names its "
            "group, so call tokenring.get_communicator(group) once before running the "
            "compiled function (or pass a Communicator, or the group to "
            "SequenceParallelAttention)"
        )
    return group


@dataclass(frozen=True, slots=True)
class Plan:
    """One planned attention call on this rank (``tokenring.api`` validates and plans it)."""

    strategy: Strategy
    comm: Communicator
    kernel: BlockKernel
    scale: float
    layout: Layout
    causal: bool
    sharding: Sharding
    mask: MaskSpec
    schedules: tuple[Schedule, Schedule] | None
    """Forward and backward schedules of the ring strategies; None for the collectives."""
    padding: Padding
    """This rank's tokens in the padded buffer the schedules run on."""


def residual_fields(
    strategy: Strategy,
    *,
    q_shape: Sequence[int],
    heads_kv: int,
    dtype: torch.dtype,
    seq_local: int,
    padded: bool,
    world_size: int,
    rank: int,
) -> list[FieldSpec]:
    """Shapes and dtypes of the residuals :func:`forward` returns (Note [Residuals]).

    Args:
        q_shape: ``(B, s, Hq, D)``; seq_local: s_pad (s without padding).

    Raises:
        ValueError: inputs Ulysses cannot split (Hkv not dividing Hq).
    """
    b, _, hq, d = q_shape
    if strategy is Strategy.ULYSSES:  # the collectives keep none; this validates the split
        ulysses_heads(world_size=world_size, heads_q=hq, heads_kv=heads_kv)
    if not padded:
        return []
    return [((b, seq_local, hq, d), dtype), ((b, hq, seq_local), accumulation_dtype(dtype))]


def _run(plan: Plan, pass_: Pass, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """One pass of ``plan`` on the padded ``inputs`` (forward q, k, v; backward dout, q, k, v,
    out, lse): forward out and lse, backward dq, dk and dv; the rank program runs with
    autocast off (Note [Autocast] in tokenring.runtime.executor)."""
    if plan.strategy.is_collective:
        names = ("causal", "scale", "layout", "comm", "kernel", "sharding", "mask")
        options = {name: getattr(plan, name) for name in names}
        return collective_pass(plan.strategy.value, pass_, inputs, **options)
    assert plan.schedules is not None
    if pass_ is Pass.FORWARD:
        return run_forward(plan.schedules[0], plan.comm, plan.kernel, *inputs, scale=plan.scale)
    return run_backward(plan.schedules[1], plan.comm, plan.kernel, *inputs, scale=plan.scale)


def forward(
    plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Run ``call``: out ``(B, s, Hq, D)``, lse ``(B, Hq, s)`` and the residuals."""
    q, k, v = (plan.padding.pad(x).contiguous() for x in (q, k, v))  # (B, s_pad, H, D)
    out, lse = _run(plan, Pass.FORWARD, (q, k, v))
    residuals = [out, lse] if plan.padding.rows is not None else []
    return plan.padding.unpad(out), plan.padding.unpad(lse, 2), residuals


def backward(
    plan: Plan,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    residuals: Sequence[torch.Tensor],
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq ``(B, s, Hq, D)``, dk and dv ``(B, s, Hkv, D)`` of :func:`forward`'s call, for
    upstream gradients ``dout`` ``(B, s, Hq, D)`` and ``dlse`` ``(B, Hq, s)`` (None: the loss
    does not use lse; Note [Gradient of lse])."""
    if plan.padding.rows is not None:
        out, lse = residuals  # the padded buffer's
    dout, q, k, v = (plan.padding.pad(x).contiguous() for x in (dout, q, k, v))  # (B, s_pad, H, D)
    head_dim = q.shape[3]
    if dlse is not None:
        width = lse_channel_width(q)
        dlse = plan.padding.pad(dlse.transpose(1, 2).unsqueeze(-1))  # (B, s_pad, Hq, 1)
        dout = widen(dout, width, dlse.to(dout.dtype))  # (B, s_pad, Hq, D + e)
        q, k, out = (widen(x, width, 0.0) for x in (q, k, out))
        v = widen(v, width, 1.0)
    dq, dk, dv = _run(plan, Pass.BACKWARD, (dout, q, k, v, out, lse))
    if dlse is not None:  # the extra channel's gradients go
        dq, dk, dv = (x[..., :head_dim] for x in (dq, dk, dv))
    return plan.padding.unpad(dq), plan.padding.unpad(dk), plan.padding.unpad(dv)
