"""Tensor parallelism on gloo ranks: each rank's planned peak against the CPU allocator's count of torch's DTensor step.

    python benchmarks/tensor_parallel.py                      # every family, tensor parallel 2 on 2 ranks and 2 × 2 on 4
    python benchmarks/tensor_parallel.py --families qwen2 --ranks 4

For each model (examples/llama.py's plain-PyTorch Llama, and transformers' Llama, Qwen2, Gemma 2, Mistral and
GPT-NeoX built from small configs, split by their own `tp_plan`), `torchrun` launches this file on N ranks: every
rank plans the model for `world_size=N, tensor_parallel=2` halfway between its lowest per-rank peak and no plan,
applies it (torch's `parallelize_module`, the checkpointing, FSDP2 over the rest), trains 4 steps and counts its
steady peak with the CPU allocator's own reports (`autoplan.verify.fsdp.measure_rank_peak`); rank 0 trains the
model unsharded on every data-parallel rank's batch at once and compares the losses. One row per model and mesh:
the per-rank prediction, the lowest and highest count over the ranks (a free made in one of gloo's threads reaches
the count late, never early: docs/parallel.md), the units' modes and whether the losses agree; then the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ("example-llama", "llama", "qwen2", "gemma2", "mistral", "gptneox")
TP = 2


def build(family: str, data_rank: int):
    """(model, batch as (args, kwargs)) for a family, seeded alike on every rank; the batch by the data-parallel rank."""
    import torch

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(100 + data_rank)
    if family == "example-llama":
        from examples.llama import Llama, LlamaConfig, example_batch

        config = LlamaConfig(vocab_size=512, dim=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=128)
        return Llama(config), (example_batch(config, 2, 128, seed=data_rank), {})
    import transformers

    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                 max_position_embeddings=256)
    configs = {"llama": transformers.LlamaConfig(num_key_value_heads=2, **shape), "qwen2": transformers.Qwen2Config(num_key_value_heads=2, **shape),
               "gemma2": transformers.Gemma2Config(num_key_value_heads=2, head_dim=32, **shape),
               "mistral": transformers.MistralConfig(num_key_value_heads=2, **shape), "gptneox": transformers.GPTNeoXConfig(**shape)}
    model = transformers.AutoModelForCausalLM.from_config(configs[family])
    ids = torch.randint(0, 512, (2, 128), generator=generator)
    return model, ((), {"input_ids": ids, "labels": ids})


def _loss(output):
    return output if not hasattr(output, "loss") else output.loss


def unsharded_losses(family: str, data_ranks: int, steps: int) -> list[float]:
    import torch

    batches = [build(family, rank)[1] for rank in range(data_ranks)]
    model, _ = build(family, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    args = tuple(torch.cat(parts) for parts in zip(*(b[0] for b in batches)))
    kwargs = {key: torch.cat([b[1][key] for b in batches]) for key in batches[0][1]}
    losses = []
    for _ in range(steps):
        loss = _loss(model(*args, **kwargs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def rank_main(family: str, out: str, steps: int, sequence_parallel: bool) -> None:
    """One rank under torchrun: plan, apply, train, count; rank 0 adds the unsharded losses."""
    import torch
    import torch.distributed as dist

    import autoplan
    from autoplan.verify.fsdp import measure_rank_peak

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, batch = build(family, rank // TP)
    planner = autoplan.Planner(model, example_inputs=batch, device="cpu", reserve=0, profile="roofline", precision="fp32",
                               world_size=world, tensor_parallel=TP, sequence_parallel=sequence_parallel)
    roomy = planner.plan("1GB")
    plan = planner.plan((roomy.prediction.minimum_peak_bytes + roomy.prediction.baseline_peak_bytes) // 2)
    autoplan.apply(model, plan)
    measured = measure_rank_peak(model, batch, torch.optim.AdamW(model.parameters(), lr=1e-3), steps=steps, loop=plan.request.loop)
    seen = {"mesh": str(plan.request.mesh), "predicted": plan.prediction.peak_bytes, "measured": measured.peak_bytes,
            "losses": list(measured.losses), "data_rank": rank // TP, "modes": [unit.choice.mode for unit in plan.decisions.units]}
    if rank == 0:
        seen["unsharded"] = unsharded_losses(family, world // TP, steps)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump(seen, file)
    dist.destroy_process_group()


def run(family: str, ranks: int, steps: int, sequence_parallel: bool) -> str:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", __file__,
                   "--rank-of", family, "--out", out, "--steps", str(steps), *(["--sequence-parallel"] if sequence_parallel else [])]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if result.returncode:
            lines = result.stderr.strip().splitlines()
            said = next((line for line in reversed(lines) if "Error: " in line and "ChildFailedError" not in line),  # the worker's own
                        lines[-1] if lines else "")
            return f"{family:>14} {ranks} ranks: failed: {said.strip()[:160]}"
        every = [json.load(open(os.path.join(out, f"rank{rank}.json"))) for rank in range(ranks)]
    predicted = every[0]["predicted"]
    low, high = min(seen["measured"] for seen in every), max(seen["measured"] for seen in every)
    mean = [sum(next(s for s in every if s["data_rank"] == d)["losses"][k] for d in range(ranks // TP)) / (ranks // TP) for k in range(steps)]
    equal = all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(mean, every[0]["unsharded"]))
    return (f"{family:>14} {every[0]['mesh']:>14} {predicted:>12,} {low:>12,} {high:>12,} {high / predicted:>8.4f} "
            f"{'/'.join(every[0]['modes']):>26} {'equal' if equal else 'DIFFERENT':>9}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--ranks", nargs="*", type=int, default=[2, 4], help="processes: 2 = tensor parallel alone, 4 = 2 FSDP × 2 TP")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--sequence-parallel", action="store_true", help="torchtitan's sequence parallelism besides (Llama-family layouts)")
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        sys.path.insert(0, ROOT)
        return rank_main(args.rank_of, args.out, args.steps, args.sequence_parallel)
    sys.path.insert(0, ROOT)
    from benchmarks.machine import describe_machine

    print(f"{'model':>14} {'mesh':>14} {'predicted B':>12} {'lowest B':>12} {'highest B':>12} {'high/pred':>8} {'modes':>26} {'losses':>9}")
    for family in args.families:
        for ranks in args.ranks:
            print(run(family, ranks, args.steps, args.sequence_parallel), flush=True)
    print(f"machine: {describe_machine()}; {'sequence parallel; ' if args.sequence_parallel else ''}per rank, counted by the CPU allocator over {args.steps} steps (the lowest steady step)")


if __name__ == "__main__":
    main()
