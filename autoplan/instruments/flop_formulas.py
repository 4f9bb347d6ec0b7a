"""autoplan's FLOP formulas in torch's flop registry while autoplan measures, and the registry as it was after.

torch's flop counter has no formula for some kernels a simulated step runs: the CPU flash attention and
the fused attention kernels (`instruments.attention_flops`), oneDNN's LSTM layer (`instruments.rnn`),
bitsandbytes' 4-bit matmul (`instruments.quantized`); uncounted, recomputing them would look free. The
roofline (`instruments.tracker.op_roofline`) reads torch's `flop_registry`, so they go in there; but that
registry is the process's, and left in it they changed what a user's own `FlopCounterMode` counts: one
script's step read 385 GFLOP before `autoplan.plan` and 445 after (issue 39). So they are there only
while `autoplan_flop_formulas()` is entered (the tracker enters it, and so does a unit's menu
recording), and on exit the registry holds exactly what it held before. Process-wide for that time,
like the dispatcher overrides (`instruments.dispatcher`): another thread's counter would see them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from torch.utils.flop_counter import flop_registry

from autoplan.instruments.attention_flops import attention_flop_formulas, grouped_query_counting
from autoplan.instruments.quantized import quantized_flop_formulas
from autoplan.instruments.rnn import rnn_flop_formulas


def autoplan_formulas() -> dict[Any, Callable[..., int]]:
    """Every formula autoplan adds, by the key torch's registry files it under (raw: over tensors)."""
    return {**attention_flop_formulas(), **rnn_flop_formulas(), **quantized_flop_formulas()}


@contextlib.contextmanager
def autoplan_flop_formulas() -> Iterator[None]:
    """torch's flop registry with autoplan's formulas while entered; each one it added is taken out on exit.

    An op the registry counts already (torch's own formula, a user's, an enclosing entry's) keeps its
    formula and is left there on exit, so entries nest and a user's registration survives planning.
    """
    added: dict[Any, Callable[..., int]] = {}
    with grouped_query_counting():
        try:
            for key, formula in autoplan_formulas().items():
                if key not in flop_registry:
                    flop_registry[key] = added[key] = formula
            yield
        finally:
            for key, formula in added.items():
                if flop_registry.get(key) is formula:  # one set since by someone else is theirs to keep
                    del flop_registry[key]
