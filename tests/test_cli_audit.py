"""Audit of the user-facing tools: the ``tokenring`` command line and the planner's inputs.

Every case is in-process (``main(argv)``) or a pure function; expected values come from the
library's own simulator called directly, from the functions' documented contracts, or from the
errors the contracts promise (naming the argument, the value and what was expected).
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from typing import Any

import pytest

from tokenring.cli import main
from tokenring.cli.models import KNOWN_MODELS
from tokenring.model.costmodel import PRESETS
from tokenring.model.simulate import simulate
from tokenring.strategies.hybrid import HybridSpec


def _simulate_rows(argv: list[str]) -> list[dict[str, Any]]:
    """``tokenring simulate ... --json``'s rows (status 0 asserted)."""
    out = io.StringIO()
    with redirect_stdout(out):
        status = main(["simulate", *argv, "--json"])
    assert status == 0, argv
    return [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]


# -- simulate: the hybrid's rows -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("world_size", "inner", "outer"),
    [(2, 2, "token_ring"), (4, 1, "token_ring"), (4, 1, "ring"), (8, 2, "bidir_ring")],
)
def test_simulate_reports_the_hybrid_whose_steps_outnumber_its_ranks(
    world_size: int, inner: int, outer: str
) -> None:
    """A hybrid pass has its inner all-to-alls' steps beside the outer ring's, more steps than
    ranks: ``transfer_ms`` sized its per-step list by the world size and the command ended in
    an IndexError traceback (``--world-size 2 --strategies hybrid --hybrid-inner 2``)."""
    argv = ["--world-size", str(world_size), "--seq", "64", "--strategies", "hybrid"]
    rows = _simulate_rows([*argv, "--hybrid-inner", str(inner), "--hybrid-outer", outer])
    model = KNOWN_MODELS["llama2-7b"]
    want = simulate(
        "hybrid",
        passes="forward",
        layout="zigzag",
        causal=True,
        world_size=world_size,
        seq_local=64 // world_size,
        shape=model.shape,
        hardware=PRESETS["h100-nvswitch"],
        hybrid=HybridSpec(inner=inner, outer_strategy=outer),
    )
    (row,) = rows
    first = want.passes[0]
    assert row["call_ms"] == pytest.approx(1e3 * want.call_s, rel=1e-12)
    assert len(row["step_ms"]) == len(first.step_s)
    for label, per_step in row["transfer_ms"].items():
        assert len(per_step) == len(first.step_s), label
        sends = [
            ev
            for events in first.timeline or ()
            for ev in events
            if ev.kind == "send" and ev.label == label
        ]
        longest = max(1e3 * (ev.end_s - ev.start_s) for ev in sends)
        assert max(per_step) == pytest.approx(longest, rel=1e-12)
