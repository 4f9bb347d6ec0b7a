"""Two gloo ranks for the FSDP tests: a torchrun worker launched on two CPU processes, and the check of their counts.

Used by tests/apply/test_sharding.py (tests/fsdp_worker.py) and tests/apply/test_torchtitan_fsdp.py
(tests/torchtitan_worker.py); each worker writes OUT/rank<N>.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
distributed = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with the gloo backend",
)


def torchrun(script: Path, ranks: int, *args: str, timeout_s: int = 300) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc_per_node=RANKS SCRIPT ARGS...` on the CPU, the repository importable;
    fails the test (with the processes' last output) on a non-zero exit."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", str(script), *args]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def run_on_two_ranks(worker: str, out: Path, *args: str) -> list[dict]:
    """`python -m torch.distributed.run --nproc_per_node=2 tests/WORKER OUT ARGS...`; each rank's JSON, rank 0 first."""
    torchrun(ROOT / "tests" / worker, 2, str(out), *args)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def assert_counted_to_the_byte(ranks: list[dict]) -> None:
    """The ranks' counts (the allocator's, gloo's own staging buffers left out as a GPU's NCCL holds none:
    verify/allocator.py) against the per-rank prediction. A count reads high, never low: a block freed in one of
    gloo's threads (an all-gather output the collective's work held last, on a loaded machine) is learnt only when
    its address is handed out again. Its `floor_bytes` leaves such blocks out, so each rank's true peak lies between
    floor and count, and the prediction must too: to the byte on a rank whose count heard every free (the usual case),
    within the blocks freed unheard on another."""
    predicted = ranks[0]["plan"]["predicted_peak_bytes"]
    assert all(rank["plan"]["predicted_peak_bytes"] == predicted for rank in ranks)
    for rank in ranks:
        assert rank["floor_bytes"] <= predicted <= rank["peak_bytes"], (rank["floor_bytes"], predicted, rank["peak_bytes"])
