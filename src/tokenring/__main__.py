"""``python -m tokenring`` runs the CLI (works under torchrun too)."""

import sys

from tokenring.cli import main

sys.exit(main())
