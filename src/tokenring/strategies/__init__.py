"""Every strategy as a pure schedule (``tokenring.core.schedule``): what each rank computes and
what travels, as plain data that the runtime executes and the cost model and the simulator read.

- ``ring``: TokenRing (pass-Q), Ring (pass-KV) and their bidirectional forms;
  :func:`build_schedule` is the entry for every strategy of one group (it hands the
  collective ones to ``collective``).
- ``collective``: Ulysses (all-to-all over heads) and all-gather K/V.
- ``hybrid``: Ulysses inside islands, a ring strategy across them (a 2-D mesh).
- ``cached``: the inference plans over a sharded KV cache (pass-Q, pass-KV, direct, tree).
"""

from tokenring.strategies.ring import build_schedule

__all__ = ["build_schedule"]
