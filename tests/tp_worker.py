"""One rank of tests/apply/test_tensor_parallel.py: a transformers Qwen2 planned for tensor parallelism by its own
`tp_plan`, applied (torch's parallelize_module), trained; writes what it saw as JSON.

Run by the test with `python -m torch.distributed.run --nproc_per_node=2 tests/tp_worker.py OUT` (each rank writes
OUT/rank<N>.json: its plan, its measured peak and its losses). Both ranks are one tensor-parallel group: they train
the same batch.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

# The repository root replaces this script's folder (sys.path[0]): tests/ holds packages named like
# the standard library's `trace` and `profile`, which must not shadow them.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import autoplan  # noqa: E402
from autoplan.verify.fsdp import measure_rank_peak  # noqa: E402
from tests.fsdp_model import qwen2_batch, tiny_qwen2  # noqa: E402

STEPS = 4  # the lowest steady step is counted: a free gloo's threads report late shows in one step, not in all


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, batch = tiny_qwen2(), qwen2_batch(0)
    planner = autoplan.Planner(model, example_inputs=batch, device="cpu", reserve=0, profile="roofline", precision="fp32",
                               tensor_parallel=world)
    roomy = planner.plan("1GB")
    plan = planner.plan((roomy.prediction.minimum_peak_bytes + roomy.prediction.baseline_peak_bytes) // 2)
    autoplan.apply(model, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    measured = measure_rank_peak(model, ((), batch), optimizer, steps=STEPS, loop=plan.request.loop)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump({"plan": plan.to_dict(), "peak_bytes": measured.peak_bytes, "losses": measured.losses}, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
