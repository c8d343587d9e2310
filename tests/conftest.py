"""Shared fixtures: one LocalSwarm of 3 node processes for the tests that only submit jobs."""
from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def swarm():
    """A tracker and 3 nodes, shared by the tests that do not disturb them."""
    from fedpipe.testing import LocalSwarm

    with LocalSwarm(n_nodes=3) as s:
        yield s
