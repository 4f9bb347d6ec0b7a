"""Offload: autoplan's floor and step time with and without it, beside transformers' flags by hand.

For long-context Llama-style configs (the `hf:` presets, meta weights, bf16 autocast, AdamW, the
common loop) on a 24 GB and an 80 GB card, plans twice, with offload (the default on a GPU
target) and with `offload=False`, and prints for each:

- autoplan's floor (`plan.minimum_peak_bytes`: the lowest device peak any of its choices reaches)
  and, at the whole card as the budget, whether a plan fits and its predicted step time;
- what `model.activation_checkpointing_enable(every_n_layers=k, offload=...)` does by hand, run
  through the same whole-step simulation (`autoplan.verify.simulate`): decoder layer i checkpointed
  when i % k == 0 (transformers' rule), its saved inputs in host memory with offload=True
  (`save_on_cpu` around the checkpoint: the same bytes as autoplan's full/host choice). The by-hand
  step time is autoplan's roofline for those choices; with offload=True, as transformers runs the
  copies on the compute stream, all of their time is added (autoplan's own copies hide behind compute
  where they can). The loss head runs as in autoplan's plan with offload (fused where it chose to
  fuse), so the columns differ only in checkpointing and offload.

Every number is a prediction for the card named, made on this machine's CPU with fake tensors; no
GPU was used. Takes a few minutes per row on 2 cores.

    python benchmarks/offload.py            # all rows
    python benchmarks/offload.py --quick    # the first row only
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoplan  # noqa: E402
from autoplan.inputs.batch import training_batch  # noqa: E402
from autoplan.inputs.targets import load_target  # noqa: E402
from autoplan.memory.model import host_peak, predict_step_time  # noqa: E402
from autoplan.plan import Choice  # noqa: E402
from autoplan.trace.tracer import trace  # noqa: E402
from autoplan.verify.simulate import simulate_plan  # noqa: E402
from autoplan.vocabulary.formatting import format_bytes, format_seconds  # noqa: E402

ROWS = (  # preset, card, batch, sequence length
    ("qwen2.5-0.5b", "rtx-4090", 1, 32768),
    ("llama-3.2-1b", "rtx-4090", 1, 16384),
    ("llama-3.2-1b", "h100-80gb", 2, 32768),
)
BY_HAND = ((1, False), (2, False), (1, True))  # (every_n_layers, offload)


def machine() -> str:
    return f"{platform.node()} · {platform.processor() or platform.machine()} · Python {platform.python_version()} · torch {torch.__version__}"


def by_hand(traced, profile, every_n_layers: int, offload: bool) -> tuple[int, float, int]:
    """Device peak (simulated), step time and host bytes of transformers' flags on the planned units."""
    placement = "host" if offload else "device"
    choices = {unit.name: Choice("full", "bf16", placement=placement) if i % every_n_layers == 0 else Choice("keep", "bf16")
               for i, unit in enumerate(profile.units)}
    simulated = simulate_plan(traced, choices, device=profile.device, optimizer="adamw", rest_precision="bf16",
                              fused_loss=bool(profile.timeline.fused_loss))
    step = predict_step_time(profile, choices)
    if offload:  # transformers' save_on_cpu copies on the compute stream: nothing hides
        step += sum(unit.options[c].transfer_s - unit.options[c].exposed_transfer_s
                    for unit, c in zip(profile.units, choices.values()))
    return simulated.peak_bytes, step, host_peak(profile, choices)


def row(preset: str, card: str, batch_size: int, seq_len: int) -> list[str]:
    loaded = load_target(f"hf:{preset}", batch_size=batch_size, seq_len=seq_len)
    profiles: list = []
    options = dict(example_inputs=loaded.example_inputs, device=card, precision="bf16", on_profile=profiles.append)
    started = time.perf_counter()
    with_offload = autoplan.plan(loaded.model, "100%", **options)
    without = autoplan.plan(loaded.model, "100%", **options, offload=False)
    profile = profiles[0]
    traced = trace(loaded.model, training_batch(loaded.model, loaded.example_inputs, None, None),
                   unit_names=[unit.name for unit in profile.units])
    hand = {flags: by_hand(traced, profile, *flags) for flags in BY_HAND}
    seconds = time.perf_counter() - started

    def planned(plan) -> str:
        return (f"{format_bytes(plan.minimum_peak_bytes)} · " +
                (f"fits, {format_seconds(plan.predicted_step_time_s)}" if plan.feasible else "no plan fits"))

    def handmade(flags) -> str:
        peak, step, host = hand[flags]
        fits = peak <= with_offload.usable_bytes
        return f"{format_bytes(peak)} · {format_seconds(step)}" + ("" if fits else " (over)") + (f" · host {format_bytes(host)}" if host else "")

    offloaded = sum(unit.choice.offloaded for unit in with_offload.units)
    return [f"{preset} {batch_size}×{seq_len}", f"{card} ({format_bytes(with_offload.usable_bytes)} usable)",
            planned(without), planned(with_offload) + (f" · {offloaded} units offloaded, host {format_bytes(with_offload.host_peak_bytes)}"
                                                       if offloaded else ""),
            *(handmade(flags) for flags in BY_HAND), f"{seconds:.0f} s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first row only")
    args = parser.parse_args()
    print(f"Predicted on this machine's CPU (fake tensors, roofline times; no GPU): {machine()}")
    print("bf16 autocast, AdamW, outputs kept through backward; floor = lowest device peak; "
          "time = predicted step at the whole card as the budget\n")
    print("| model, batch × tokens | card | autoplan, no offload: floor · plan | autoplan with offload: floor · plan "
          "| by hand every_n_layers=1 | every_n_layers=2 | every_n_layers=1, offload=True | planning |")
    print("|---|---|---|---|---|---|---|---:|")
    for preset, card, batch_size, seq_len in ROWS[:1] if args.quick else ROWS:
        print("| " + " | ".join(row(preset, card, batch_size, seq_len)) + " |", flush=True)


if __name__ == "__main__":
    main()
