"""Shared fixtures: a one-rank gloo process group in the pytest process for in-process tests."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))  # workers import test modules and the oracle


@pytest.fixture(scope="session")
def single_rank_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Initialise a world of one gloo rank (FileStore in a temp dir; no ports)."""
    if dist.is_initialized():
        yield
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
