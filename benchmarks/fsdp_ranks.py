"""FSDP2 on 2 gloo ranks: each rank's per-rank prediction against the CPU allocator's count of its real steps.

Every kind of `tests/fsdp_worker.py` (the tiny Llama of `tests/fsdp_model.py` resharded, kept gathered, its last
block kept, under the bf16 MixedPrecisionPolicy; one block called six times; a transformers Qwen2) is planned and
trained under `torch.distributed.run --nproc_per_node=2` at the budgets docs/parallel.md quotes, and the table prints,
per kind and rank, the plan's units, its predicted peak, the count (`autoplan/verify/fsdp.py`, which shares
nothing with the simulation) and their ratio, then the machine.

    python benchmarks/fsdp_ranks.py                 # every kind (about two minutes on 2 cores)
    python benchmarks/fsdp_ranks.py llama qwen2     # those kinds
    python benchmarks/fsdp_ranks.py --blocks 8      # and the 8 largest lines of what was alive at each counted peak
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe_machine  # noqa: E402

# (kind, budget): a budget under the all-keep peak where docs/parallel.md plans one, else room for every unit kept
RUNS = (("llama", "48219136B"), ("llama", "1GB"), ("llama-kept", "1GB"), ("llama-kept", "51763200B"),
        ("llama-last-kept", "1GB"), ("llama-bf16", "40400000B"), ("shared", "1473536B"), ("qwen2", "1GB"))


def run(kind: str, budget: str, out: Path) -> list[dict]:
    """Both ranks' JSON (plan, peak_bytes, losses, peak_blocks) from one 2-rank run of the worker."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "tests" / "fsdp_worker.py"), str(out), budget, kind]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{kind} at {budget} failed:\n{done.stderr[-3000:]}")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kinds", nargs="*", help="worker kinds to run (default: all)")
    parser.add_argument("--blocks", type=int, default=0, help="print this many lines of each rank's peak listing")
    args = parser.parse_args()
    runs = [(kind, budget) for kind, budget in RUNS if not args.kinds or kind in args.kinds]
    print(f"{'kind':>16} {'budget':>10} {'rank':>4} {'units':<34} {'predicted B':>12} {'counted B':>12} {'ratio':>8}")
    for kind, budget in runs:
        with tempfile.TemporaryDirectory() as out:
            for rank, result in enumerate(run(kind, budget, Path(out))):
                plan = result["plan"]
                units = ",".join(unit["mode"] for unit in plan["units"])
                predicted, counted = plan["predicted_peak_bytes"], result["peak_bytes"]
                print(f"{kind:>16} {budget:>10} {rank:>4} {units[:34]:<34} {predicted:>12,} {counted:>12,} {counted / predicted:>8.5f}",
                      flush=True)
                for total, blocks, each, maker in result["peak_blocks"][:args.blocks]:
                    print(f"{'':>34} {total:>12,} = {blocks} × {each:,}  {maker[:90]}")
    print(f"machine: {describe_machine(libraries=('transformers',))}")


if __name__ == "__main__":
    main()
