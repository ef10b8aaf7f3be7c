"""Imported once by the launch zygote of a test session (Note [Zygote preload in tests] in
conftest.py): the test modules named in TOKENRING_TESTS_PRELOAD, so that a forked rank finds
them, and the transformers or diffusers models they import, loaded."""

from __future__ import annotations

import contextlib
import importlib
import os

for _name in filter(None, os.environ.get("TOKENRING_TESTS_PRELOAD", "").split(",")):
    # any failure (a skip is a BaseException) leaves it to the rank, which imports it itself
    with contextlib.suppress(BaseException):
        importlib.import_module(_name)
