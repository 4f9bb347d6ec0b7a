"""One rank of tests/apply/test_torchtitan_fsdp.py: torchtitan's setup, applied by hand, against the plan pinned to it.

Run by the test with `python -m torch.distributed.run --nproc_per_node=2 tests/torchtitan_worker.py OUT`. For each
snapshot of `benchmarks/torchtitan_llama.py` (the model and loop behind docs/published.md's torchtitan rows), a small
model of that architecture is planned per rank with torchtitan's setup pinned (FSDP2 with bf16 parameters and fp32
reduction, the last block kept gathered, every block checkpointed by torchtitan's rule), then sharded and
checkpointed *by hand*, the calls torchtitan makes (`checkpoint_wrapper` with its op-level policy or without,
`fully_shard` per block, then the root): autoplan.apply is not used. Each rank trains and writes
OUT/rank<N>.json: per snapshot, its plan, the CPU allocator's count of its steady step and its losses.
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
from benchmarks.torchtitan_llama import LlamaShape, Transformer, keeps_output, loss_for  # noqa: E402
from tests.handmade import torchtitan_policy_contexts  # noqa: E402

# (shape, blocks' checkpointing): 2024-03 with full checkpointing, 2024-12 (grouped KV heads) with the op-level policy
SNAPSHOTS = {"2024-03": (LlamaShape(64, 3, 4, 4, 256, None, 32, 32), "full"),
             "2024-12": (LlamaShape(64, 3, 4, 2, 256, 1.3, 32, 32), "torchtitan-op")}
BATCH, SEQ, STEPS = 2, 32, 3


def shard_as_torchtitan(model: Transformer, checkpointing: str) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    last = len(model.layers) - 1
    for index, block in enumerate(model.layers):
        context = {"context_fn": torchtitan_policy_contexts} if checkpointing == "torchtitan-op" else {}
        wrapped = checkpoint_wrapper(block, preserve_rng_state=False, **context)
        fully_shard(wrapped, mp_policy=policy, reshard_after_forward=index < last)
        model.layers[index] = wrapped
    fully_shard(model, mp_policy=policy)


def run(snapshot: str, rank: int) -> dict:
    shape, checkpointing = SNAPSHOTS[snapshot]
    torch.manual_seed(0)
    model = Transformer(shape, snapshot).train()
    generator = torch.Generator().manual_seed(1 + rank)
    tokens, labels = (torch.randint(0, shape.vocab_size, (BATCH, SEQ), generator=generator) for _ in range(2))
    loss_fn, loop = loss_for(snapshot, labels), autoplan.TrainingLoop(keep_outputs=keeps_output(snapshot))
    plan = autoplan.plan(model, "1GB", example_inputs=(tokens,), device="cpu", reserve=0, world_size=dist.get_world_size(),
                         profile="roofline", fsdp_mixed_precision="bf16", reshard_after_forward={f"layers.{shape.n_layers - 1}": False},
                         checkpoint={"layers.*": checkpointing}, loss_fn=loss_fn, loop=loop)
    shard_as_torchtitan(model, checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    measured = measure_rank_peak(model, ((tokens,), {}), optimizer, steps=STEPS, loss_fn=loss_fn, loop=loop)
    return {"plan": plan.to_dict(), "peak_bytes": measured.peak_bytes, "floor_bytes": measured.floor_bytes, "losses": measured.losses}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {snapshot: run(snapshot, rank) for snapshot in SNAPSHOTS}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump(result, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
