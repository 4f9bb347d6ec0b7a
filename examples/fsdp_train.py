"""Train a Llama-style model sharded over N processes with FSDP2, planned by autoplan for a per-GPU budget.

    torchrun --nproc_per_node=2 examples/fsdp_train.py                    # CPU, gloo
    torchrun --nproc_per_node=8 examples/fsdp_train.py --budget 20GB       # GPUs, nccl

Every rank plans the same model (the plan is deterministic); `autoplan.apply` of a plan with
world_size=N checkpoints and casts the units the plan chose and shards each unit and the root with
`fully_shard`; then each rank trains on its own batch. Rank 0 prints the plan and, per step, the
loss averaged over ranks and the peak live bytes of its own step against the plan's per-rank peak.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a clone

import autoplan  # noqa: E402
from autoplan.vocabulary.formatting import format_bytes
from autoplan.verify.fsdp import measure_rank_peak
from examples.llama import Llama, LlamaConfig, example_batch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default=None, help="per-GPU budget (default: 12MB on the CPU, 80%% of the GPU)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=2, help="per rank")
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # every rank starts from the same weights; fully_shard keeps its shard of them
    config = LlamaConfig()
    model = Llama(config).to(device)
    batch = tuple(t.to(device) for t in example_batch(config, args.batch_size, args.seq_len, seed=1 + rank))
    budget = args.budget or ("80%" if cuda else "12MB")
    plan = autoplan.plan(
        model, budget, example_inputs=batch, world_size=world, device=None if cuda else "cpu",
        reserve=None if cuda else 0, profile="roofline",
    )
    if not plan.outcome.feasible:
        raise SystemExit(f"rank {rank}: no plan fits {budget} per GPU on {world} ranks:\n{plan.report()}")
    model = autoplan.apply(model, plan)  # checkpoint/precision per unit, then fully_shard each unit and the root
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if rank == 0:
        print(plan.report())
        print(f"{world} ranks, backend {dist.get_backend()}; the plan's per-rank peak: {format_bytes(plan.prediction.peak_bytes)} "
              "(step 0 also creates the optimizer state; steps from 1 on are the steady state planned for)")
    for step in range(args.steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            loss = model(*batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            peak, value = torch.cuda.max_memory_allocated(), loss.detach()
        else:
            measured = measure_rank_peak(model, (batch, {}), optimizer, steps=1, loop=plan.request.loop)
            peak, value = measured.peak_bytes, torch.tensor(measured.losses[-1])
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        if rank == 0:
            print(f"step {step}: loss {value.item() / world:.4f}, rank 0 peak {format_bytes(peak)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
