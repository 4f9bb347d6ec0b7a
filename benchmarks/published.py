"""GPU peak memory other people measured and published, next to autoplan's prediction of the same number.

Each row is a published training run with its whole configuration: the model (built here from its config,
random weights: nothing is downloaded), batch, sequence, precision, checkpointing, optimizer and loop,
the card, and which number was published (allocated, reserved, or what nvidia-smi shows: reserved plus
the CUDA context). autoplan plans the run as published (every block pinned to the run's checkpointing and
precision, the run's optimizer and loop, the run's card, no reserve) and predicts that number:

- "nvidia-smi": the caching allocator's reserved peak (`plan.prediction.reserved_peak_bytes`) plus the CUDA
  context the source measured itself;
- "reserved": the reserved peak alone; "allocated": the allocated peak (`plan.prediction.peak_bytes`).

    python benchmarks/published.py                  # every row, then the same model on today's stack (about 5 minutes)
    python benchmarks/published.py --rows 1,4,10    # some published rows only
    python benchmarks/published.py --today          # the H100 table only

Prints the table of published bert-large rows (transformers' docs), the table of torchtitan's published FSDP2 runs
(its own Llama, `benchmarks/torchtitan_llama.py`), then the same bert-large runs as benchmarks/gpu_truth.py
measured them on an H100 with today's torch and transformers (benchmarks/results/h100_2026-11-27/bert.json:
allocated and reserved, steps 2-3) against autoplan's prediction for that stack, and the machine it ran on.
docs/published.md holds its last run.

With FSDP (world size > 1) autoplan predicts each rank's allocated peak but not the caching allocator's reserved
one (`plan.prediction.reserved_peak_bytes` is 0 there: FSDP's gathers and reductions run on their own streams,
whose cached blocks the allocator model does not replay); a published reserved figure for an FSDP run is then
printed against the allocated prediction, a lower bound, and left out of the ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoplan  # noqa: E402
from autoplan.inputs.hf_trainer import trainer_loop  # noqa: E402
from benchmarks.machine import describe_machine  # noqa: E402
from benchmarks.torchtitan_llama import LLAMA2_7B, LLAMA3_8B, build  # noqa: E402

MIB, GIB = 2**20, 2**30
TRANSFORMERS_PAGE = ("transformers docs, \"Efficient Training on a Single GPU\" (docs/source/en/perf_train_gpu_one.mdx, "
                     "January 2022): bert-large-uncased, sequence 512, Trainer, V100-SXM2 16 GB, driver 460.91.03, "
                     "CUDA 11.2; `GPU memory occupied` (NVML used) after training; the page measured the context at 1343 MB")


@dataclass(frozen=True)
class Row:
    label: str
    source: str
    number: str  # "nvidia-smi", "reserved" or "allocated"
    published_mib: float
    context_mib: float  # the CUDA context the source measured (nvidia-smi rows)
    batch: int
    accumulation: int
    checkpointing: bool
    fp16: bool
    optimizer: str


def _bert_rows() -> list[Row]:
    # (label, batch, accumulation, gradient checkpointing, fp16, optimizer, published MB as the page printed it)
    runs = [
        ("batch 4", 4, 1, False, False, "adamw", 14949),
        ("batch 1, accumulation 4", 1, 4, False, False, "adamw", 8681),
        ("batch 1, accumulation 4, checkpointing", 1, 4, True, False, "adamw", 6775),
        ("batch 4, fp16", 4, 1, False, True, "adamw", 13939),
        ("batch 1, accumulation 4, checkpointing, fp16", 1, 4, True, True, "adamw", 7275),
        ("batch 4, Adafactor", 4, 1, False, False, "adafactor", 12295),
        ("batch 1, accumulation 4, checkpointing, fp16, Adafactor", 1, 4, True, True, "adafactor", 4847),
        ("batch 4, 8-bit Adam", 4, 1, False, False, "adam8bit", 13085),
        ("batch 1, accumulation 4, checkpointing, fp16, 8-bit Adam", 1, 4, True, True, "adam8bit", 5363),
    ]
    return [Row(f"bert-large: {label}", TRANSFORMERS_PAGE, "nvidia-smi", mib, 1343, batch, accumulation, ckpt, fp16, opt)
            for label, batch, accumulation, ckpt, fp16, opt, mib in runs]


ROWS = _bert_rows()
BERT_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)  # bert-large-uncased's config


def _optimizer(name: str):
    if name == "adafactor":  # Trainer's optim="adafactor" (transformers.Adafactor, scale_parameter=False, relative_step=False)
        from transformers.optimization import Adafactor
        return Adafactor([torch.nn.Parameter(torch.zeros(1))], lr=5e-5, scale_parameter=False, relative_step=False,
                         warmup_init=False)
    return name


def _bert_large(batch_size: int, token_ids: tuple[int, int], **config) -> tuple[torch.nn.Module, dict]:
    """bert-large for two labels on the meta device, and a batch of `batch_size` × 512 tokens drawn from `token_ids`."""
    from transformers import BertConfig, BertForSequenceClassification

    with torch.device("meta"):
        model = BertForSequenceClassification(BertConfig(num_labels=2, **BERT_LARGE, **config)).train()
    ids = torch.randint(*token_ids, (batch_size, 512), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": torch.zeros(batch_size, dtype=torch.long)}


def predict(row: Row) -> tuple[float, float]:
    """autoplan's prediction of the row's published number (MiB), and the seconds planning took."""
    # the page's tokens; 2022's BertModel wrote attention out op by op: the eager kernels
    model, batch = _bert_large(row.batch, (100, 30000), attn_implementation="eager")
    precision = "fp16" if row.fp16 else "fp32"
    began = time.perf_counter()
    plan = autoplan.plan(
        model, "16GB", example_inputs=batch, device="v100-16gb", reserve=0, allow_over_device=True, precision=precision,
        checkpoint={"bert.encoder.layer.*": "full" if row.checkpointing else "keep"}, optimizer=_optimizer(row.optimizer),
        loop=trainer_loop(row.accumulation, "for-loop", precision, labelled=True, device="v100-16gb"), fuse_loss=False,
    )
    seconds = time.perf_counter() - began
    prediction = plan.prediction
    if row.number == "allocated":
        return prediction.peak_bytes / MIB, seconds
    reserved = prediction.reserved_peak_bytes / MIB
    return (reserved + row.context_mib if row.number == "nvidia-smi" else reserved), seconds


H100_RUN = Path(__file__).resolve().parent / "results" / "h100_2026-11-27" / "bert.json"  # benchmarks/gpu_truth.py --parts bert


def predict_today(label: str, config: tuple) -> tuple[float, float]:
    """autoplan's allocated and reserved peaks (MiB) for one of the bert-large runs benchmarks/gpu_training.py made on
    an H100 (torch 2.11, transformers 5.17: sdpa attention, torch's AdamW, its own loop), as that loop ran them."""
    batch_size, accumulation, checkpointing, fp16, optimizer = config
    model, batch = _bert_large(batch_size, (0, 30522))  # as benchmarks/gpu_training.py draws them
    loop = autoplan.TrainingLoop(keep_outputs=False, accumulation_steps=accumulation, grad_scaler=fp16, loss_in_model=True)
    plan = autoplan.plan(model, "80GB", example_inputs=batch, device="h100-80gb", reserve=0, precision="fp16" if fp16 else "fp32",
                         checkpoint={"bert.encoder.layer.*": "full" if checkpointing else "keep"},
                         optimizer=_optimizer(optimizer), loop=loop, fuse_loss=False)
    return plan.prediction.peak_bytes / MIB, plan.prediction.reserved_peak_bytes / MIB


def today_table() -> None:
    """The same model on today's stack: autoplan against what an H100 measured (allocated and reserved, steps 2-3)."""
    import json

    from benchmarks.gpu_training import BERT_CONFIGS

    measured = json.loads(H100_RUN.read_text())
    print("\n| run (H100, torch 2.11) | measured allocated MiB | predicted | ratio | measured reserved MiB | predicted | ratio |")
    print("|---|---|---|---|---|---|---|")
    for label, config in BERT_CONFIGS.items():
        allocated, reserved = max(measured[label]["allocated_by_step"][1:]) / MIB, max(measured[label]["reserved_by_step"]) / MIB
        predicted_allocated, predicted_reserved = predict_today(label, config)
        print(f"| bert-large: {label} | {allocated:,.0f} | {predicted_allocated:,.0f} | {predicted_allocated / allocated:.3f} | "
              f"{reserved:,.0f} | {predicted_reserved:,.0f} | {predicted_reserved / reserved:.3f} |", flush=True)


TORCHTITAN_PR = ("torchtitan PR 165, \"Used per-parameter FSDP\" (March 2024, its description's eager FSDP2 rows): "
                 "torchtrain's Llama \"7B\" with the Llama 2 tokenizer (32,000 words), 8 H100 of 95.04 GiB, local batch 8 "
                 "× 2048, FSDP2 with bf16 parameters and fp32 reduce-scatter, AdamW (foreach), full checkpointing (AC) or "
                 "torchtrain's op-level selective one (SAC); peak active and peak reserved as % of 95.0396 GiB")
TORCHTITAN_DOCS = ("torchtitan's performance page (performance.md in its docs), Tables 1 and 3, \"FSDP\" rows (versions: torch 1963fc8, torchtitan "
                   "9dec370, December 2024): Llama 3.1 8B, H100 96 GB HBM2e, local batch 2, sequence 8192 (llama3_8b.toml's "
                   "default; the tables do not state it), FSDP2 with bf16 parameters and fp32 reduce, selective op "
                   "checkpointing, AdamW (foreach), no compile, no float8; `memory` is max_memory_reserved, GiB")


@dataclass(frozen=True)
class TitanRow:
    """One of torchtitan's published FSDP2 runs: its model snapshot (`benchmarks/torchtitan_llama.py`), ranks,
    local batch × sequence, the blocks' checkpointing (autoplan's pin) and the published figure in GiB."""
    label: str
    source: str
    number: str  # "active" (compared with the allocated peak) or "reserved"
    published_gib: float
    snapshot: str
    ranks: int
    batch: int
    seq: int
    checkpointing: str  # "full" or "torchtitan-op"


def _titan_rows() -> list[TitanRow]:
    card = 95.0396 / 100  # PR 165 logged percentages of this capacity
    pr = [("7B, 8 ranks, full AC", "active", 23.92, "full"), ("7B, 8 ranks, full AC", "reserved", 32.64, "full"),
          ("7B, 8 ranks, SAC", "active", 52.13, "torchtitan-op"), ("7B, 8 ranks, SAC", "reserved", 62.51, "torchtitan-op")]
    rows = [TitanRow(f"torchtitan {label}", TORCHTITAN_PR, number, percent * card, "2024-03", 8, 8, 2048, mode)
            for label, number, percent, mode in pr]
    return rows + [TitanRow(f"torchtitan Llama 3.1 8B, {ranks} ranks, selective op AC", TORCHTITAN_DOCS, "reserved", gib,
                            "2024-12", ranks, 2, 8192, "torchtitan-op") for ranks, gib in ((8, 82.4), (128, 67.0))]


TITAN_ROWS = _titan_rows()
# the H100 the runs used: 96 GB of HBM2e, 95.04 GiB as torch reports it (PR 165); otherwise the h100-80gb profile
H100_96GB = dataclasses.replace(autoplan.get_device("h100-80gb"), name="h100-96gb", memory_bytes=int(95.0396 * GIB),
                                description="NVIDIA H100 96GB HBM2e (torchtitan's runs)")


@functools.lru_cache(maxsize=None)
def _titan_plan(snapshot: str, ranks: int, batch: int, seq: int, checkpointing: str) -> tuple[autoplan.Plan, float]:
    shape = LLAMA2_7B if snapshot == "2024-03" else LLAMA3_8B
    model, tokens, loss_fn, keeps_output = build(shape, snapshot, batch, seq)
    began = time.perf_counter()
    plan = autoplan.plan(
        model, "95GiB", example_inputs=(tokens,), device=H100_96GB, reserve=0, allow_over_device=True, world_size=ranks,
        fsdp_mixed_precision="bf16", reshard_after_forward={f"layers.{shape.n_layers - 1}": False},  # torchtitan keeps the last block
        checkpoint={"layers.*": checkpointing}, loss_fn=loss_fn, loop=autoplan.TrainingLoop(keep_outputs=keeps_output),
        fuse_loss=False,
    )
    return plan, time.perf_counter() - began


def predict_titan(row: TitanRow) -> tuple[float, float | None, float]:
    """autoplan's allocated peak (GiB), its reserved peak where it predicts one (None under FSDP), and the seconds
    planning took (0 for a run already planned for another row)."""
    first = _titan_plan.cache_info().currsize
    plan, seconds = _titan_plan(row.snapshot, row.ranks, row.batch, row.seq, row.checkpointing)
    reserved = plan.prediction.reserved_peak_bytes
    return (plan.prediction.peak_bytes / GIB, reserved / GIB if reserved else None,
            seconds if _titan_plan.cache_info().currsize > first else 0.0)


def titan_table(chosen: list[TitanRow]) -> list[float]:
    """Print the torchtitan rows; return the ratios of the rows autoplan predicts."""
    print("\n| # | run | number | published GiB | predicted GiB | predicted / published | plan s |")
    print("|---|---|---|---|---|---|---|")
    ratios = []
    for row in chosen:
        allocated, reserved, seconds = predict_titan(row)
        predicted = allocated if row.number == "active" else reserved
        number = len(ROWS) + TITAN_ROWS.index(row) + 1
        if predicted is None:
            shown, ratio = f"not predicted (allocated {allocated:.2f}, a lower bound)", f"({allocated / row.published_gib:.3f})"
        else:
            ratios.append(predicted / row.published_gib)
            shown, ratio = f"{predicted:.2f}", f"{predicted / row.published_gib:.3f}"
        print(f"| {number} | {row.label} | {row.number} | {row.published_gib:.2f} | {shown} | {ratio} | {seconds:.0f} |",
              flush=True)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", help="comma-separated row numbers (from 1: bert-large 1-9, torchtitan 10-15); default: every row")
    parser.add_argument("--today", action="store_true", help="only the H100 table: the same bert-large on an H100 today")
    args = parser.parse_args()
    print(f"machine: {describe_machine()}")
    if args.today:
        today_table()
        return
    numbers = [int(n) for n in args.rows.split(",")] if args.rows else list(range(1, len(ROWS) + len(TITAN_ROWS) + 1))
    if any(not 1 <= n <= len(ROWS) + len(TITAN_ROWS) for n in numbers):
        parser.error(f"rows are numbered 1 to {len(ROWS) + len(TITAN_ROWS)}")
    bert = [ROWS[n - 1] for n in numbers if n <= len(ROWS)]
    titan = [TITAN_ROWS[n - len(ROWS) - 1] for n in numbers if n > len(ROWS)]
    ratios = bert_table(bert) if bert else []
    if titan:
        ratios += titan_table(titan)
    if ratios:
        print(f"\npredicted rows: {len(ratios)}; ratio median {statistics.median(ratios):.3f}, lowest {min(ratios):.3f}, "
              f"highest {max(ratios):.3f}")
    sources = dict.fromkeys(row.source for row in [*bert, *titan])
    print("\nsources:\n" + "\n".join(f"- {source}" for source in sources))
    if not args.rows:
        today_table()


def bert_table(chosen: list[Row]) -> list[float]:
    """Print the transformers-docs rows; return their ratios."""
    print("| # | run | number | published MiB | predicted MiB | predicted / published | plan s |")
    print("|---|---|---|---|---|---|---|")
    ratios = []
    for row in chosen:
        predicted, seconds = predict(row)
        ratios.append(predicted / row.published_mib)
        print(f"| {ROWS.index(row) + 1} | {row.label} | {row.number} | {row.published_mib:,.0f} | {predicted:,.0f} | "
              f"{predicted / row.published_mib:.3f} | {seconds:.0f} |", flush=True)
    return ratios


if __name__ == "__main__":
    main()
