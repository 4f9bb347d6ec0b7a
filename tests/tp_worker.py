"""One rank of tests/apply/test_tensor_parallel.py: a transformers model planned for tensor parallelism by its own
`tp_plan`, applied (torch's parallelize_module), trained; writes what it saw as JSON.

Run by the test with `python -m torch.distributed.run --nproc_per_node=2 tests/tp_worker.py OUT [MODEL]` (each rank
writes OUT/rank<N>.json: its plan, its measured peak and its losses). MODEL: `qwen2` (default), planned halfway
between its lowest peak and none; `qwen2-sp`, the same with sequence parallelism (torchtitan's styles on the norms, the
attention's and MLP's inputs, the head's); or `gptneox-full`, a GPT-NeoX with every layer pinned to full checkpointing (its
attention output is added only after the MLP runs: a recomputation stopped early leaves that all-reduce unwaited).
Both ranks are one tensor-parallel group: they train the same batch.
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


def tiny_gptneox():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=64)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    return transformers.AutoModelForCausalLM.from_config(config), {"input_ids": ids, "labels": ids}


def main(out: str, which: str = "qwen2") -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, batch = (tiny_qwen2(), qwen2_batch(0)) if which.startswith("qwen2") else tiny_gptneox()
    if which == "qwen2-sp":  # longer: activations, not the optimizer step, set the peak, so halfway recomputes some layer
        ids = torch.randint(0, model.config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(1))
        batch = {"input_ids": ids, "labels": ids}
    options = dict(example_inputs=batch, device="cpu", reserve=0, profile="roofline", precision="fp32", tensor_parallel=world,
                   sequence_parallel=which == "qwen2-sp")
    if which == "gptneox-full":
        plan = autoplan.plan(model, "1GB", checkpoint={"*": "full"}, **options)
    else:
        planner = autoplan.Planner(model, **options)
        roomy = planner.plan("1GB")
        plan = planner.plan((roomy.prediction.minimum_peak_bytes + roomy.prediction.baseline_peak_bytes) // 2)
    autoplan.apply(model, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    measured = measure_rank_peak(model, ((), batch), optimizer, steps=STEPS, loop=plan.request.loop)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump({"plan": plan.to_dict(), "peak_bytes": measured.peak_bytes, "floor_bytes": measured.floor_bytes, "losses": measured.losses}, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
