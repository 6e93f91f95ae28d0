"""Shared fixtures: one intra-op thread and a seeded RNG (``_default_model`` says whether the
embedded SmolLM2 is installed); the ``dist`` marker on every test that starts processes
(gloo ranks, pipeline stages, workers, torchrun jobs, servers, the fault cases' command runs),
so that the inner loop is ``pytest -m "not dist and not real_model"``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
DIST = ("comm", "infer/executors", "train/parallel", "serve", "robustness", "train/test_ddp.py",
        "train/test_device_script.py")
"""Test folders and files (under tests/) whose tests start processes."""

# One intra-op thread: tiny models gain nothing from more, and on a loaded 2-core machine
# (or with distributed tests spawning processes) extra OpenMP threads stall each other.
torch.set_num_threads(1)
# Every process times its runners' primitives afresh (exitlm.runtime.cost_store): tests never
# share timings through the user's cache (tests/runtime/test_cost_store.py turns it on).
os.environ["EXITLM_COST_CACHE"] = "0"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_report_header() -> str:
    """Name the kernel path (native build and ISA, or the torch fallback and why) at the top
    of every run, so that a run on the fallback is visible."""
    from exitlm.kernels import native

    return f"exitlm kernels: {native.kernel_path().describe()}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(HERE).as_posix()
        if any(rel == d or rel.startswith(d + "/") for d in DIST):
            item.add_marker(pytest.mark.dist)
