"""The examples run end to end and report that they match the single-process run.

Each ``main`` spawns its own ranks, trains a couple of steps and compares with the same model in
one process (float64, within 1e-10); a mismatch makes it return 1.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import dit_tiny


def test_dit_tiny_four_ranks_matches_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert dit_tiny.main(["--steps", "2", "--image-size", "8"]) == 0
    assert "MATCHES the single-process run" in capsys.readouterr().out


def test_train_llama_tiny_matches_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip(
        "transformers",
        reason="transformers is not installed (pip install 'tokenring-attention[hf]')",
    )
    import train_llama_tiny

    argv = ["--steps", "2", "--seq-len", "32", "--world-size", "2", "--attn", "tokenring_ring"]
    assert train_llama_tiny.main(argv) == 0
    assert "MATCHES the single-process run" in capsys.readouterr().out
