"""The parts `benchmarks/gpu_truth.py` runs, each in its own process: the CUDA context and what kernels save.

The training parts (bert-large's nine configurations, autoplan's verify) are in `gpu_training.py`.
Every part writes `<part>.json` under the output folder; `tables()` prints what they found.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.gpu_training import mib, training_tables, write_json


CONTEXT_PROBE = r"""
import json, torch, torch.nn.functional as F, pynvml
pynvml.nvmlInit(); handle = pynvml.nvmlDeviceGetHandleByIndex(0)
used = lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used
stages = [{"stage": "before CUDA is initialised", "nvml_used": used(), "reserved": 0}]
def mark(stage):
    torch.cuda.synchronize()
    stages.append({"stage": stage, "nvml_used": used(), "reserved": torch.cuda.memory_reserved()})
x = torch.ones(1, device="cuda"); mark("context and one tensor")
a = torch.randn(1024, 1024, device="cuda", requires_grad=True); (a @ a).sum().backward(); mark("fp32 matmul fwd+bwd (cuBLAS)")
with torch.autocast("cuda", torch.bfloat16):
    (a @ a).float().sum().backward()
mark("bf16 matmul under autocast")
img = torch.randn(8, 64, 56, 56, device="cuda", requires_grad=True)
F.conv2d(img, torch.randn(64, 64, 3, 3, device="cuda"), padding=1).sum().backward(); mark("conv2d fwd+bwd (cuDNN)")
q = torch.randn(4, 16, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward(); mark("SDPA bf16 fwd+bwd (flash)")
q32 = q.detach().float().requires_grad_()
F.scaled_dot_product_attention(q32, q32, q32).sum().backward(); mark("SDPA fp32 fwd+bwd (efficient)")
total = torch.cuda.get_device_properties(0).total_memory
print(json.dumps({"stages": stages, "total": total, "nvml_total": pynvml.nvmlDeviceGetMemoryInfo(handle).total,
                  "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
                  "driver": pynvml.nvmlSystemGetDriverVersion()}))
"""


def part_context(out: Path, smoke: bool) -> None:
    """NVML's used memory less torch's reserved, at each first use of a library, lazy and eager loading."""
    if not torch.cuda.is_available():
        write_json(out, "context", {"skipped": "no CUDA device"})
        return
    rows = {}
    for loading in ("LAZY", "EAGER"):
        done = subprocess.run([sys.executable, "-c", CONTEXT_PROBE], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "CUDA_MODULE_LOADING": loading})
        lines = done.stdout.strip().splitlines()
        rows[loading] = json.loads(lines[-1]) if done.returncode == 0 and lines else {"error": done.stderr[-2000:]}
        write_json(out, "context", rows)


# --- what each kernel saves for backward -----------------------------------------------------------------

def saved_by(run: Callable[[], object], known: list[torch.Tensor]) -> dict:
    """The storages autograd saves while `run()` runs, less the inputs' and parameters' own."""
    skip = {t.untyped_storage()._cdata for t in known}  # the storage itself: fake tensors' data pointers are all 0
    seen: dict[int, tuple[str, list[int], int]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in skip and storage._cdata not in seen:
            seen[storage._cdata] = (str(tensor.dtype).removeprefix("torch."), list(tensor.shape), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = run()
    del output
    return {"bytes": sum(size for *_, size in seen.values()), "tensors": sorted(seen.values(), key=lambda t: -t[2])}


def op_cases(device: torch.device, smoke: bool) -> dict[str, Callable[[], tuple[Callable[[], object], list[torch.Tensor]]]]:
    """name -> a builder of (run, known tensors); every input a leaf that requires grad."""
    b, t, d, heads, vocab, img = (2, 16, 32, 2, 100, (2, 4, 8, 8)) if smoke else (4, 512, 1024, 16, 30522, (32, 64, 56, 56))

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, requires_grad=True)

    def elementwise(fn: Callable[[torch.Tensor], torch.Tensor]):
        def build():
            x = leaf(b, t, d)
            return (lambda: fn(x)), [x]
        return build

    def module(make: Callable[[], nn.Module], *shape: int):
        def build():
            layer, x = make(), leaf(*shape)
            layer = layer if device.type == "cpu" else layer.to(device)
            return (lambda: layer(x)), [x, *layer.parameters(), *layer.buffers()]
        return build

    def attention(**kwargs):
        def build():
            q, k, v = (leaf(b, heads, t, d // heads) for _ in range(3))
            return (lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)), [q, k, v]
        return build

    def eager_attention():
        q, k, v = (leaf(b, heads, t, d // heads) for _ in range(3))
        return (lambda: F.dropout((q @ k.transpose(-1, -2)).softmax(-1), 0.1, True) @ v), [q, k, v]

    def cross_entropy():
        logits = leaf(b * t, vocab)
        target = torch.randint(0, vocab, (b * t,), device=device)
        return (lambda: F.cross_entropy(logits, target)), [logits]

    def embedding():
        table = nn.Embedding(vocab, d, device=device)
        ids = torch.randint(0, vocab, (b, t), device=device)
        return (lambda: table(ids)), [*table.parameters()]

    def rms_norm():
        x, weight = leaf(b, t, d), leaf(d)
        return (lambda: F.rms_norm(x, (d,), weight)), [x, weight]

    return {
        "dropout p=0.1": elementwise(lambda x: F.dropout(x, 0.1, True)),
        "gelu": elementwise(F.gelu),
        "gelu tanh": elementwise(lambda x: F.gelu(x, approximate="tanh")),
        "silu": elementwise(F.silu),
        "relu": elementwise(F.relu),
        "softmax": elementwise(lambda x: x.softmax(-1)),
        "layer_norm": module(lambda: nn.LayerNorm(d), b, t, d),
        "rms_norm": rms_norm,
        "linear d→4d": module(lambda: nn.Linear(d, 4 * d), b, t, d),
        "embedding": embedding,
        "cross_entropy": cross_entropy,
        "SDPA": attention(),
        "SDPA causal": attention(is_causal=True),
        "SDPA dropout 0.1": attention(dropout_p=0.1),
        "eager attention + dropout": eager_attention,
        "conv2d 3×3": module(lambda: nn.Conv2d(img[1], img[1], 3, padding=1), *img),
        "batch_norm2d": module(lambda: nn.BatchNorm2d(img[1]), *img),
        "group_norm": module(lambda: nn.GroupNorm(2, img[1]), *img),
        "max_pool2d": module(lambda: nn.MaxPool2d(3, 2, 1), *img),
        "bert layer, dropout 0.1, eager": _bert_layer(device, smoke, 0.1, "eager"),
        "bert layer, dropout 0.0, eager": _bert_layer(device, smoke, 0.0, "eager"),
        "bert layer, dropout 0.1, sdpa": _bert_layer(device, smoke, 0.1, "sdpa"),
    }


def _bert_layer(device: torch.device, smoke: bool, dropout: float, attention: str):
    def build():
        from transformers import BertConfig
        from transformers.models.bert.modeling_bert import BertLayer
        size = dict(hidden_size=32, num_attention_heads=2, intermediate_size=64) if smoke else {}
        config = BertConfig(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, **size)
        config._attn_implementation = attention
        layer = BertLayer(config)
        layer = (layer if device.type == "cpu" else layer.to(device)).train()
        x = torch.randn(2 if smoke else 4, 16 if smoke else 512, config.hidden_size, device=device, requires_grad=True)

        def run():
            result = layer(x)
            return result[0] if isinstance(result, tuple) else result
        return run, [x, *layer.parameters()]
    return build


def part_saved(out: Path, smoke: bool) -> None:
    """Saved bytes of every op case, on this CUDA device and on the CPU, fp32 and bf16 autocast."""
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    rows: dict[str, dict] = {}
    for name, build in op_cases(torch.device("cpu"), smoke).items():
        rows[name] = {}
        for device in devices:
            for precision in ("fp32", "bf16"):
                key = f"{device.type} {precision}"
                try:
                    torch.manual_seed(0)
                    run, known = op_cases(device, smoke)[name]()
                    with torch.autocast(device.type, torch.bfloat16, enabled=precision == "bf16"):
                        rows[name][key] = saved_by(run, known)
                except Exception as error:  # one op failing on one device is a finding, not the end of the part
                    rows[name][key] = {"error": f"{type(error).__name__}: {error}"[:300]}
        write_json(out, "saved", rows)
        del build


def part_tests(out: Path, smoke: bool) -> None:
    """The tests that need CUDA (they skip without it)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", "-rA", "-n", "0",
                           "tests/verify/test_real.py", "tests/inputs/test_devices.py", "-k", "cuda"],
                          capture_output=True, text=True, timeout=48)
    write_json(out, "tests", {"rc": done.returncode, "tail": (done.stdout + done.stderr)[-4000:]})


# --- the tables printed at the end ------------------------------------------------------------------------

def _load(out: Path, name: str) -> object:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def tables(out: Path) -> str:
    """Markdown tables of every part that wrote its JSON."""
    lines: list[str] = []
    context = _load(out, "context")
    if isinstance(context, dict) and "LAZY" in context:
        for loading, probe in context.items():
            if "stages" not in probe:
                lines.append(f"context {loading}: {probe}")
                continue
            lines += [f"\n### CUDA context, {loading} loading: {probe['device']}, driver {probe['driver']}, CUDA {probe['cuda']}, "
                      f"torch {probe['torch']}", "| stage | NVML used MiB | reserved MiB | used − reserved − before MiB |", "|---|---|---|---|"]
            before = probe["stages"][0]["nvml_used"]
            for stage in probe["stages"]:
                lines.append(f"| {stage['stage']} | {mib(stage['nvml_used'])} | {mib(stage['reserved'])} | "
                             f"{mib(stage['nvml_used'] - stage['reserved'] - before)} |")
    saved = _load(out, "saved")
    if isinstance(saved, dict):
        keys = sorted({key for row in saved.values() for key in row})
        lines += ["\n### Saved for backward, MiB (storages, less inputs and parameters)", "| op | " + " | ".join(keys) + " |",
                  "|---|" + "---|" * len(keys)]
        for name, row in saved.items():
            cells = [mib(row[key]["bytes"]) if "bytes" in row.get(key, {}) else "err" for key in keys]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += training_tables(out)
    from benchmarks.gpu_capped import allocator_fit_table, capped_table
    lines += capped_table(out) + allocator_fit_table(out)
    tests = _load(out, "tests")
    if isinstance(tests, dict):
        lines += [f"\n### CUDA tests: rc {tests['rc']}", tests["tail"][-1200:]]
    return "\n".join(lines)
