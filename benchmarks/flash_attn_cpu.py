"""A CPU stand-in for the four private kernel entry points of flash-attn 2 that
ring-flash-attention imports, so that its ring functions run on CPU with PyTorch's fused CPU
flash-attention operator (the same operator tokenring's ``cpu_flash`` kernel runs).

ring-flash-attention (``ring_flash_attn``, 0.1.8) imports, from
``flash_attn.flash_attn_interface``::

    _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                        window_size_right, softcap, alibi_slopes, return_softmax)
        -> (out, softmax_lse, S_dmask, rng_state)
    _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                         softmax_scale, causal, window_size_left, window_size_right, softcap,
                         alibi_slopes, deterministic, rng_state=None) -> softmax_d
    _flash_attn_varlen_forward, _flash_attn_varlen_backward (the varlen functions)

It fills the defaults of these by ``inspect.getfullargspec`` and passes every argument by
name, so the stand-ins below keep flash-attn's parameter names. Only what the dense ring
functions use is served: no dropout, no window, no softcap, no ALiBi, ``causal`` with equal
query and key lengths only (flash-attn aligns a causal mask bottom-right, the CPU operator
top-left: the same mask only when they are square). Anything else raises
``NotImplementedError`` rather than compute something else. The varlen pair always raises.

Legend: B batch, s local seq, H heads, D head dim. Tensors are flash-attn's
``(B, s, H, D)``; lse is ``(B, H, s)`` float32.

:func:`install` puts the stand-in in ``sys.modules`` as ``flash_attn`` and
``flash_attn.flash_attn_interface`` (it refuses if a real flash-attn is importable).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

import torch

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    dropout_p: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Any,
) -> None:
    if q.device.type != "cpu":
        raise NotImplementedError(f"the CPU stand-in runs on CPU tensors; got {q.device}")
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout_p must be 0 in the CPU stand-in; got {dropout_p}")
    if (window_size_left, window_size_right) != (-1, -1):
        raise NotImplementedError(
            "window_size must be (-1, -1) in the CPU stand-in; got "
            f"({window_size_left}, {window_size_right})"
        )
    if softcap != 0.0:
        raise NotImplementedError(f"softcap must be 0 in the CPU stand-in; got {softcap}")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes must be None in the CPU stand-in")
    if causal and q.shape[1] != k.shape[1]:
        raise NotImplementedError(
            "causal=True needs equal query and key lengths in the CPU stand-in (flash-attn "
            f"aligns the mask bottom-right, the CPU operator top-left); got {q.shape[1]} "
            f"queries, {k.shape[1]} keys"
        )


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # (B, s, H, D) <-> (B, H, s, D), a view


def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    return_softmax: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, None, None]:
    """out ``(B, s, H, D)`` in q's dtype, softmax_lse ``(B, H, s)`` float32 (float64 for
    float64 inputs, which flash-attn does not take), None, None."""
    _check(
        q,
        k,
        dropout_p=dropout_p,
        causal=causal,
        window_size_left=window_size_left,
        window_size_right=window_size_right,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
    )
    if return_softmax:
        raise NotImplementedError("return_softmax must be False in the CPU stand-in")
    out, lse = _FWD(_bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, scale=softmax_scale)
    return _bhsd(out), lse, None, None


def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    rng_state: Any = None,
) -> torch.Tensor:
    """Writes dq, dk, dv (flash-attn's contract: into the given buffers); returns
    softmax_d = rowsum(dout * out), ``(B, H, s)`` float32."""
    _check(
        q,
        k,
        dropout_p=dropout_p,
        causal=causal,
        window_size_left=window_size_left,
        window_size_right=window_size_right,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
    )
    lse = softmax_lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    grads = _BWD(
        _bhsd(dout),
        _bhsd(q),
        _bhsd(k),
        _bhsd(v),
        _bhsd(out),
        lse,
        0.0,
        causal,
        scale=softmax_scale,
    )
    for buf, grad in zip((dq, dk, dv), grads, strict=True):
        buf.copy_(_bhsd(grad))
    return (dout.float() * out.float()).sum(-1).transpose(1, 2)  # (B, H, s)


def _flash_attn_varlen_forward(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("the varlen functions are not served by the CPU stand-in")


def _flash_attn_varlen_backward(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("the varlen functions are not served by the CPU stand-in")


def install() -> None:
    """Serve ``flash_attn.flash_attn_interface`` from this module (before importing
    ``ring_flash_attn``). Raises RuntimeError if a real flash-attn is installed (its GPU
    kernels would be shadowed) or another module already took the name."""
    here = sys.modules.get("flash_attn.flash_attn_interface")
    if here is not None and getattr(here, "__tokenring_stand_in__", False):
        return
    if here is not None or importlib.util.find_spec("flash_attn") is not None:
        raise RuntimeError(
            "flash_attn is installed (or already imported): the CPU stand-in would shadow it"
        )
    package = types.ModuleType("flash_attn")
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    for fn in (
        _flash_attn_forward,
        _flash_attn_backward,
        _flash_attn_varlen_forward,
        _flash_attn_varlen_backward,
    ):
        setattr(interface, fn.__name__, fn)
    interface.__tokenring_stand_in__ = True  # type: ignore[attr-defined]
    package.flash_attn_interface = interface  # type: ignore[attr-defined]
    package.__path__ = []  # a package, so "from flash_attn.x import" resolves
    sys.modules["flash_attn"] = package
    sys.modules["flash_attn.flash_attn_interface"] = interface


def check_installed() -> Any:
    """The import spec of ``ring_flash_attn``; ImportError naming the extra if absent."""
    spec = importlib.util.find_spec("ring_flash_attn")
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError(
            "ring-flash-attn is not installed: pip install 'tokenring-attention[peers]' "
            "(or pip install --no-deps ring-flash-attn)"
        )
    return spec


def load_ring_flash_attn() -> tuple[Any, str]:
    """``(ring_flash_attn.zigzag_ring_flash_attn module, its version)`` with the stand-in
    installed.

    The module is imported without running ``ring_flash_attn/__init__.py``: that file also
    imports its Hugging Face adapter, which fails against recent transformers
    (``is_flash_attn_greater_or_equal_2_10`` is gone) and which the ring functions do not
    use. Raises ImportError naming the extra when ring-flash-attn is not installed."""
    import importlib
    import importlib.metadata

    spec = check_installed()
    install()
    if "ring_flash_attn" not in sys.modules:
        package = types.ModuleType("ring_flash_attn")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules["ring_flash_attn"] = package
    module = importlib.import_module("ring_flash_attn.zigzag_ring_flash_attn")
    return module, importlib.metadata.version("ring-flash-attn")
