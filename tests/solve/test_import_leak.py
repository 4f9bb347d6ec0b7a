"""The first plan in a process frees its caller's model: pulp, imported lazily by the first plan, keeps the
tracebacks of its failed solver-library loads, and so every frame of the stack that imported it
(solve/ilp.py imports it on a thread of its own). Seen on an H100: the first model's parameters stayed
allocated through the next models' steps. Run in a fresh process, where pulp is not imported yet."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import gc, sys, weakref
import torch
sys.path.insert(0, {root!r})
assert "pulp" not in sys.modules
import autoplan
from examples.gpt import build

def first_plan():
    model, (idx,) = build(n_layer=2, n_embd=32, n_head=2, block_size=32, vocab_size=64, batch_size=2, seq_len=32)
    autoplan.plan(model, "1GB", example_inputs=(idx,), device="cpu", reserve=0)
    return weakref.ref(model)

model = first_plan()
gc.collect()
print("alive" if model() is not None else "freed")
"""


def test_the_first_plan_of_a_process_does_not_keep_its_callers_model_alive():
    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(root=root)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "freed"
