"""Every strategy as a pure schedule (``tokenring.core.schedule``): ``ring`` (TokenRing, Ring,
bidirectional; :func:`build_schedule`, the entry for every one-group strategy), ``collective``
(Ulysses, all-gather K/V), ``hybrid`` (2-D mesh) and ``cached`` (KV-cache inference plans)."""

from tokenring.strategies.ring import build_schedule

__all__ = ["build_schedule"]
