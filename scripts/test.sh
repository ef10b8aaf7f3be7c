#!/usr/bin/env bash
# The project's test command: installs what it needs, then lint, types and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch is the one required dependency; take the CPU build (2.13.0 is on disk on the project's
# CI machines) only when no torch is installed, so a GPU build already present is kept.
python -c "import torch" 2>/dev/null || python -m pip install --quiet "torch==2.13.0"
# The distribution was called "tokenring" before it became "tokenring-attention": an old
# editable install of this project under that name would shadow this checkout, so drop it
# (only when it is ours: PyPI's "tokenring" is an unrelated project).
old_summary=$(python -m pip show tokenring 2>/dev/null | sed -n 's/^Summary: //p' || true)
if [[ "$old_summary" == "Sequence-parallel attention"* ]]; then
  python -m pip uninstall --quiet --yes tokenring
fi
# peers: ring-flash-attention (no dependencies of its own), so tests/test_peers.py runs its
# checks against float64 instead of skipping them on a fresh machine
python -m pip install --quiet -e ".[test,hf,peers]"
ruff check src tests
ruff format --check src tests
mypy
python -m pytest -q "$@"
# The one-shot GPU check, run on the CPU so it cannot rot (issue 12; ~1 min).
bash scripts/device_check.sh --device cpu
