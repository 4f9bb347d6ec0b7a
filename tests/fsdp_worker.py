"""One rank of tests/apply/test_sharding.py: plan per rank, apply FSDP2, train, write what it saw as JSON.

Run by the test with `python -m torch.distributed.run --nproc_per_node=2 tests/fsdp_worker.py OUT BUDGET [MODEL]`
(each rank writes OUT/rank<N>.json: its plan, measured peak, losses, and the blocks alive at the peak by maker),
MODEL "llama" (default: tests/fsdp_model.tiny_llama), "llama-kept" (the same, FSDP's reshard_after_forward=False),
"llama-last-kept" (False for its last block only), "llama-bf16" (FSDP2's MixedPrecisionPolicy, bf16 gathered, fp32
reduced), "shared" (one block called six times per forward) or "qwen2" (tests/fsdp_model.tiny_qwen2, a transformers
model whose outputs hold its logits, its first layer checkpointed).
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
from autoplan.verify.fsdp import measure_rank_peak
from tests.fsdp_model import BATCH, SEQ, STEPS, qwen2_batch, rank_batch, shared_batch, shared_block, tiny_llama, tiny_qwen2  # noqa: E402


RESHARD = {"llama-kept": False, "llama-last-kept": {"layers.3": False}}  # as torchtitan keeps its last block gathered


def main(out: str, budget: str, kind: str = "llama") -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    precision, pins = "auto", {}
    if kind == "shared":  # compared with one process in fp32
        model, batch, precision = shared_block(), shared_batch(rank), "fp32"
    elif kind == "qwen2":
        model, batch, precision, pins = tiny_qwen2(), qwen2_batch(rank), "fp32", {"checkpoint": {"model.layers.0": "full"}}
    else:
        model, config = tiny_llama()
        batch = rank_batch(config, rank)
    plan = autoplan.plan(model, budget, example_inputs=batch, device="cpu", reserve=0, world_size=world, profile="roofline",
                         precision=precision, reshard_after_forward=RESHARD.get(kind, True),
                         fsdp_mixed_precision="bf16" if kind == "llama-bf16" else None, **pins)
    autoplan.apply(model, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    args, kwargs = ((), batch) if isinstance(batch, dict) else (batch, {})
    measured = measure_rank_peak(model, (args, kwargs), optimizer, steps=STEPS, loop=plan.request.loop, keep_peak_blocks=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump({"plan": plan.to_dict(), "peak_bytes": measured.peak_bytes, "floor_bytes": measured.floor_bytes, "losses": measured.losses,
                   "batch": [BATCH, SEQ], "peak_blocks": measured.peak_blocks}, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
