"""Offload on models it was not written for: the transformers families and zoo structures of the tests.

For each (tiny configs from `tests/families.py`, structures from `tests/structures.py`), planned for
an RTX 4090 in fp32 with AdamW in the common loop: the floor without offload and with it; then a
plan at the budget halfway between (where only offloading fits), its predicted device peak against
its whole-step simulation, its host bytes (predicted, simulated), how many units it offloads, and
whether the rewritten model (applied to a copy of the real model, on this CPU) trains as the
original: same loss and gradients over two AdamW steps, to 1e-5.

    python benchmarks/offload_families.py
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoplan  # noqa: E402
from benchmarks.machine import describe_machine  # noqa: E402
from autoplan.inputs.batch import training_batch  # noqa: E402
from tests.families import BATCH, FAMILIES, SEQ  # noqa: E402
from tests.structures import STRUCTURES  # noqa: E402

OPTIONS = dict(device="rtx-4090", precision="fp32", reserve=0)


def cases():
    for family in FAMILIES:
        model = family.build()
        yield family.name, model, training_batch(model, None, BATCH, SEQ)
    for structure in STRUCTURES:
        model, inputs = structure.build()
        yield structure.name, model, training_batch(model, inputs, None, None)


def _loss(output) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    tensors = [t for t in (output.values() if isinstance(output, dict) else [getattr(output, "logits", output)]) if isinstance(t, torch.Tensor)]
    return sum(t.float().pow(2).mean() for t in tensors)


def trains_as_original(model, plan, batch) -> bool:
    original, planned = copy.deepcopy(model), copy.deepcopy(model)
    autoplan.apply(planned, plan)
    args, kwargs = batch
    results = []
    for net in (original, planned):
        torch.manual_seed(0)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        record = []
        for _ in range(2):
            loss = _loss(net(*args, **kwargs))
            loss.backward()
            record.append((loss.detach(), [p.grad.clone() for p in net.parameters() if p.grad is not None]))
            optimizer.step()
            optimizer.zero_grad()
        results.append(record)
    return all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) and all(torch.allclose(x, y, atol=1e-5, rtol=1e-5) for x, y in zip(ga, gb))
               for (a, ga), (b, gb) in zip(*results))


def main() -> None:
    print(f"CPU, this machine: {describe_machine()}; planned for rtx-4090, fp32, AdamW, common loop\n")
    print("| model | floor, no offload | floor, offload | plan between: predicted = simulated | host: predicted = simulated | units offloaded | trains as original |")
    print("|---|---:|---:|---|---|---:|---|")
    for name, model, batch in cases():
        try:
            args, kwargs = batch
            inputs = (args, kwargs) if kwargs else args
            without = autoplan.plan(model, 1, example_inputs=inputs, offload=False, **OPTIONS)
            with_offload = autoplan.plan(model, 1, example_inputs=inputs, **OPTIONS)
            low, high = with_offload.prediction.minimum_peak_bytes, without.prediction.minimum_peak_bytes
            if low >= high:
                print(f"| {name} | {high:,} | {low:,} | offload lowers nothing here | | | |", flush=True)
                continue
            plan = autoplan.plan(model, (low + high) // 2, example_inputs=inputs, **OPTIONS)
            same = plan.prediction.peak_bytes == plan.prediction.simulated_peak_bytes
            host = plan.prediction.host_peak_bytes == plan.prediction.simulated_host_peak_bytes
            offloaded = sum(unit.choice.offloaded for unit in plan.decisions.units)
            print(f"| {name} | {high:,} | {low:,} | {'FITS' if plan.outcome.feasible else 'no plan'}: {plan.prediction.peak_bytes:,} "
                  f"{'=' if same else '≠'} {plan.prediction.simulated_peak_bytes:,} | {plan.prediction.host_peak_bytes:,} {'=' if host else '≠'} "
                  f"{plan.prediction.simulated_host_peak_bytes:,} | {offloaded} of {len(plan.decisions.units)} | "
                  f"{'yes' if trains_as_original(model, plan, batch) else 'NO'} |", flush=True)
        except Exception as error:  # noqa: BLE001 - a case that fails is a row that says so
            print(f"| {name} | failed: {type(error).__name__}: {str(error).splitlines()[0][:150]} | | | | | |", flush=True)


if __name__ == "__main__":
    main()
