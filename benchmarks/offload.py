"""Offload: autoplan's floor and step time with and without it, beside transformers' flags by hand.

For long-context Llama-style configs (transformers' LlamaConfig with the sizes of TinyLlama-1.1B and
OpenLLaMA-3B, whose 32k-token vocabularies keep the logits from deciding the peak; meta weights,
bf16 autocast, AdamW, the common loop) on a 24 GB and an 80 GB card, plans twice, with offload (the default on a GPU
target) and with `offload=False`, and prints for each:

- autoplan's floor (`plan.prediction.minimum_peak_bytes`: the lowest device peak any of its choices reaches)
  and, at the whole card as the budget, whether a plan fits and its predicted step time;
- what `model.activation_checkpointing_enable(every_n_layers=k, offload=...)` does by hand, run
  through the same whole-step simulation (`autoplan.verify.simulate`): decoder layer i checkpointed
  when i % k == 0 (transformers' rule), its saved inputs in host memory with offload=True
  (`save_on_cpu` around the checkpoint: the same bytes as autoplan's full/host choice). The by-hand
  step time is autoplan's roofline for those choices; with offload=True, as transformers runs the
  copies on the compute stream, all of their time is added (autoplan's own copies hide behind compute
  where they can). The loss head runs as in autoplan's plan with offload (fused where it chose to
  fuse), so the columns differ only in checkpointing and offload. The host budget is 128GB (a
  training machine's pinned memory, not this one's).

Every number is a prediction for the card named, made on this machine's CPU with fake tensors; no
GPU was used. Takes a few minutes per row on 2 cores.

    python benchmarks/offload.py            # all rows
    python benchmarks/offload.py --quick    # the first row only
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoplan  # noqa: E402
from benchmarks.machine import describe_machine  # noqa: E402
from autoplan.inputs.batch import training_batch  # noqa: E402
from autoplan.memory.model import host_peak, predict_step_time  # noqa: E402
from autoplan.plan import Choice  # noqa: E402
from autoplan.trace.tracer import trace  # noqa: E402
from autoplan.verify.simulate import simulate_plan  # noqa: E402
from autoplan.vocabulary.formatting import format_bytes, format_seconds  # noqa: E402
from autoplan.memory.segment_terms import choices_by_unit  # noqa: E402

CONFIGS = {  # LlamaConfig sizes of two open Llama-style models
    "TinyLlama-1.1B": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=32000),
    "OpenLLaMA-3B": dict(hidden_size=3200, intermediate_size=8640, num_hidden_layers=26, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32000),
}
ROWS = (  # config, card, batch, sequence length
    ("TinyLlama-1.1B", "rtx-4090", 1, 16384),
    ("TinyLlama-1.1B", "rtx-4090", 1, 24576),
    ("TinyLlama-1.1B", "rtx-4090", 1, 32768),
    ("OpenLLaMA-3B", "h100-80gb", 1, 32768),
    ("OpenLLaMA-3B", "h100-80gb", 2, 32768),
)
BY_HAND = ((1, False), (2, False), (1, True))  # (every_n_layers, offload)
HOST_BUDGET = "128GB"  # pinned host memory of the machine planned for, not of the one planning (the default: half its RAM)


def by_hand(traced, profile, every_n_layers: int, offload: bool) -> tuple[int, float, int]:
    """Device peak (simulated), step time and host bytes of transformers' flags on the planned units."""
    placement = "host" if offload else "device"
    choices = {unit.name: Choice("full", "bf16", placement=placement) if i % every_n_layers == 0 else Choice("keep", "bf16")
               for i, unit in enumerate(profile.units)}
    simulated = simulate_plan(traced, choices_by_unit(profile, choices), device=profile.device, optimizer="adamw", rest_precision="bf16",
                              fused_loss=profile.timeline.fused_loss)
    step = predict_step_time(profile, choices)
    if offload:  # transformers' save_on_cpu copies on the compute stream: nothing hides
        step += sum(unit.options[c].transfer_s - unit.options[c].exposed_transfer_s
                    for unit, c in zip(profile.units, choices.values()))
    return simulated.peak_bytes, step, host_peak(profile, choices)


def llama(name: str, seq_len: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**CONFIGS[name], max_position_embeddings=seq_len, tie_word_embeddings=False)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def row(name: str, card: str, batch_size: int, seq_len: int) -> list[str]:
    model = llama(name, seq_len)
    profiles: list = []
    options = dict(batch_size=batch_size, seq_len=seq_len, device=card, precision="bf16", on_profile=profiles.append,
                   host_budget=HOST_BUDGET)
    started = time.perf_counter()
    with_offload = autoplan.plan(model, "100%", **options)
    without = autoplan.plan(model, "100%", **options, offload=False)
    profile = profiles[0]
    traced = trace(model, training_batch(model, None, batch_size, seq_len), unit_names=tuple(unit.unit for unit in profile.units))
    hand = {flags: by_hand(traced, profile, *flags) for flags in BY_HAND}
    seconds = time.perf_counter() - started

    def planned(plan) -> str:
        return (f"{format_bytes(plan.prediction.minimum_peak_bytes)} · " +
                (f"fits, {format_seconds(plan.prediction.step_time_s)}" if plan.outcome.feasible else "no plan fits"))

    def handmade(flags) -> str:
        peak, step, host = hand[flags]
        fits = peak <= with_offload.request.usable_bytes
        over_host = " (over the host budget)" if host > with_offload.request.host_budget_bytes else ""
        return f"{format_bytes(peak)} · {format_seconds(step)}" + ("" if fits else " (over)") + (f" · host {format_bytes(host)}{over_host}" if host else "")

    offloaded = sum(unit.choice.offloaded for unit in with_offload.decisions.units)
    return [f"{name}-style {batch_size}×{seq_len}", f"{card} ({format_bytes(with_offload.request.usable_bytes)} usable)",
            planned(without), planned(with_offload) + (f" · {offloaded} units offloaded, host {format_bytes(with_offload.prediction.host_peak_bytes)}"
                                                       if offloaded else ""),
            *(handmade(flags) for flags in BY_HAND), f"{seconds:.0f} s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first row only")
    args = parser.parse_args()
    print(f"Predicted on this machine's CPU (fake tensors, roofline times; no GPU): {describe_machine()}")
    print(f"bf16 autocast, AdamW, outputs kept through backward, host budget {HOST_BUDGET}; floor = lowest device peak; "
          "time = predicted step at the whole card as the budget\n")
    print("| model, batch × tokens | card | autoplan, no offload: floor · plan | autoplan with offload: floor · plan "
          "| by hand every_n_layers=1 | every_n_layers=2 | every_n_layers=1, offload=True | planning |")
    print("|---|---|---|---|---|---|---|---:|")
    for name, card, batch_size, seq_len in ROWS[:1] if args.quick else ROWS:
        print("| " + " | ".join(row(name, card, batch_size, seq_len)) + " |", flush=True)


if __name__ == "__main__":
    main()
