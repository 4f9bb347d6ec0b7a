"""Test session settings: under pytest-xdist each worker runs torch on one thread, so the workers
(one per core) do not oversubscribe the machine."""

import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
