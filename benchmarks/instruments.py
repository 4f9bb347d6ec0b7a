"""What the instruments cost per op: one simulated training step against the same step under plain fake tensors.

    python benchmarks/instruments.py                # tiny transformers Llama, examples/gpt.py's GPT, both for cpu and a100-80gb
    python benchmarks/instruments.py --repeat 10

A simulated step (`profile.simulation.run_timeline`: a fake copy of the model, the values table, the
live-bytes tracker, the recorder's hooks, warm-up and the recorded step) is timed against the same
forward, backward and optimizer step run under a bare `FakeTensorMode` (the floor no instrument can
go below), and the ops the tracker saw are counted, and those on data among them (the rest are a fake
tensor asking its mode for its device or layout). Prints, per model and target, the median of
`--repeat` steps of each, the ops per step, the instruments' microseconds per op, and the machine.
"""

from __future__ import annotations

import argparse
import collections
import copy
import statistics
import sys
import time
from typing import Callable

from scale import ROOT  # benchmarks/ is on the path when this script runs

sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode  # noqa: E402

from benchmarks.machine import describe_machine  # noqa: E402


def _tiny_llama():
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    return transformers.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}


def _gpt():
    from examples.gpt import build

    model, batch = build()
    return model, batch


MODELS: dict[str, Callable] = {"llama (transformers)": _tiny_llama, "gpt (examples/gpt.py)": _gpt}


def _median_ms(run: Callable[[], None], repeat: int) -> float:
    run()  # warm: first calls fill torch's caches
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def _plain_fake_step(model: torch.nn.Module, batch) -> Callable[[], None]:
    """The step with no instrument: a fake copy, forward, backward, AdamW step and zero_grad under FakeTensorMode."""
    from autoplan.training.step_parts import default_loss

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with FakeCopyMode(mode):
        fake = copy.deepcopy(model)
    args, kwargs = ((), batch) if isinstance(batch, dict) else ((batch,), {}) if isinstance(batch, torch.Tensor) else (tuple(batch), {})
    optimizer = torch.optim.AdamW(p for p in fake.parameters() if p.requires_grad)

    def step() -> None:
        with mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            fake_kwargs = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            default_loss(fake(*fake_args, **fake_kwargs)).backward()
            optimizer.step()
            optimizer.zero_grad()
    return step


def _simulated_step(model: torch.nn.Module, batch, device: str) -> tuple[Callable[[], None], Callable[[], int]]:
    """autoplan's simulated step (every unit kept in fp32), and a counter of the ops its tracker saw."""
    from autoplan.inputs.devices import get_device
    from autoplan.instruments import tracker
    from autoplan.plan import Choice
    from autoplan.profile.simulation import run_timeline
    from autoplan.trace.tracer import trace

    traced = trace(model, batch)
    choices = {unit: Choice("keep", "fp32") for unit in traced.units}
    target = get_device(device)
    seen = collections.Counter()
    dispatch = tracker.LiveBytesTracker.__torch_dispatch__
    asks = (torch.ops.prim.device.default, torch.ops.prim.layout.default)  # a question about a tensor, not an op on data

    def counted(self, func, types, args=(), kwargs=None):
        seen["ops"] += 1
        seen["asks"] += func in asks
        return dispatch(self, func, types, args, kwargs)

    def step() -> None:
        run_timeline(traced, choices, device=target, optimizer="adamw")

    def ops() -> tuple[int, int]:
        seen.clear()
        tracker.LiveBytesTracker.__torch_dispatch__ = counted
        try:
            step()
        finally:
            tracker.LiveBytesTracker.__torch_dispatch__ = dispatch
        return seen["ops"], seen["asks"]
    return step, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--devices", nargs="+", default=["cpu", "a100-80gb"])
    args = parser.parse_args()
    print(f"machine: {describe_machine()}; median of {args.repeat} steps each")
    print(f"{'model':>22} {'target':>10} {'ops':>6} {'on data':>8} {'simulated ms':>13} {'plain fake ms':>14} {'ratio':>6} {'µs/op over fake':>16}")
    for name, build in MODELS.items():
        model, batch = build()
        plain = _median_ms(_plain_fake_step(model, batch), args.repeat)
        for device in args.devices:
            step, ops = _simulated_step(model, batch, device)
            simulated = _median_ms(step, args.repeat)
            count, asks = ops()
            print(f"{name:>22} {device:>10} {count:>6} {count - asks:>8} {simulated:>13.0f} {plain:>14.0f} {simulated / plain:>5.1f}× "
                  f"{(simulated - plain) * 1000 / count:>16.1f}")


if __name__ == "__main__":
    main()
