"""Shared fixtures: a one-rank gloo process group in the pytest process for in-process tests."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))  # workers import test modules and the oracle

# Note [One intra-op thread in the pytest process]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The in-process tests call thousands of ops on tensors of a few hundred elements. With
# torch's default of one thread per core, some CPU kernels (softmax, the autograd engine's)
# open a parallel region even then, and each one waits for the second thread to be
# scheduled: on a 2-core box shared with other work a (2, 4, 6, 6) softmax took 1.1 ms with
# 2 threads and 6 us with 1 (test_attention's one-rank grid: 8.1 s -> 1.8 s). Launched ranks
# set their own count (threads_per_rank in tokenring.launch); tests that are about threads
# set theirs (test_sketch_of_values).
torch.set_num_threads(1)


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


# Note [Zygote preload in tests]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A forked rank imports the test module its function lives in (Note [Rank start] in
# tokenring.launch). For the modules below that means transformers' or diffusers' models:
# 1-5 s of CPU per rank, paid again by every rank of every launch. When one of them is
# collected, the session starts the zygote at once with those modules imported
# (tests/_zygote_preload.py): once, beside collection and the in-process tests. Python 3.11's
# fork server ignores the sys.path it is sent, so this directory reaches it through
# PYTHONPATH, set only while it starts. Without tokenring.launch's zygote (not Linux, or
# renamed) nothing changes: ranks import the modules themselves, as before; nor with CUDA,
# where an import that probes the devices would leave the zygote unfit to fork CUDA ranks.
_HEAVY_RANK_MODULES = frozenset(
    {"test_diffusers", "test_hf", "test_hf_architectures", "test_hf_audit", "test_hf_generate"}
    | {"test_hf_keywords_audit", "test_hf_sweep_audit", "test_hf_trainer"}
    | {"test_diffusers_audit", "test_hf_generate_audit", "test_hf_trainer_audit"}
    | {"test_compose_audit", "test_trainer_today_audit", "test_coverage_audit2"}
    | {"test_coverage_audit3", "test_hf_usage_audit", "test_diffusers_usage_audit"}
    | {"test_hf_generate_usage_audit", "test_diffusers_audit3", "test_hf_audit3"}
    | {"test_readme_snippets", "test_compile_audit2", "test_hf_heads_audit"}
    | {"test_review_audit", "test_hf_left_audit", "test_review_audit2"}
)


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    modules = {getattr(item, "module", None) for item in session.items}
    wanted = sorted(_HEAVY_RANK_MODULES & {m.__name__ for m in modules if m is not None})
    if wanted:
        _start_zygote(wanted)


def _start_zygote(test_modules: list[str]) -> None:
    import importlib
    import multiprocessing
    import multiprocessing.forkserver

    launch = importlib.import_module("tokenring.launch")  # the package's `launch` is the function
    preload = getattr(launch, "_ZYGOTE_PRELOAD", None)
    can_fork = getattr(launch, "_zygote_can_fork", lambda: False)
    if not isinstance(preload, list) or not can_fork() or torch.cuda.is_available():
        return
    here = os.path.dirname(os.path.abspath(__file__))
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", "TOKENRING_TESTS_PRELOAD")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, saved["PYTHONPATH"]) if p)
    os.environ["TOKENRING_TESTS_PRELOAD"] = ",".join(test_modules)
    try:
        multiprocessing.get_context("forkserver").set_forkserver_preload(
            [*preload, "_zygote_preload"]
        )
        multiprocessing.forkserver.ensure_running()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
