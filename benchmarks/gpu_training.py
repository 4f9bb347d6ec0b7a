"""The training parts of `benchmarks/gpu_truth.py`: bert-large as the transformers docs train it, and verify.

``part_bert`` trains bert-large (sequence 512, random tokens, two labels) in nine configurations of the
transformers page "Methods and tools for efficient training on a single GPU" and writes, for each, the
steady-state allocated peak, the reserved peak and NVML's used memory after training, plus the caching
allocator's trace of every allocation and free (``torch.cuda.memory._record_memory_history``) so that a
model of the allocator can be checked against it offline. ``part_verify`` plans models with autoplan on
this GPU and runs ``autoplan.verify``.
"""

from __future__ import annotations

import gc
import gzip
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

# name: (batch, accumulation steps, gradient checkpointing, fp16 autocast + GradScaler, optimizer)
BERT_CONFIGS = {
    "batch 4": (4, 1, False, False, "adamw"),
    "batch 1, accumulation 4": (1, 4, False, False, "adamw"),
    "batch 1, accumulation 4, checkpointing": (1, 4, True, False, "adamw"),
    "batch 4, checkpointing": (4, 1, True, False, "adamw"),
    "batch 4, fp16": (4, 1, False, True, "adamw"),
    "batch 4, checkpointing, fp16": (4, 1, True, True, "adamw"),
    "batch 4, Adafactor": (4, 1, False, False, "adafactor"),
    "batch 4, checkpointing, fp16, Adafactor": (4, 1, True, True, "adafactor"),
    "batch 4, 8-bit AdamW": (4, 1, False, False, "adamw8bit"),
}


def write_json(out: Path, name: str, data: object) -> None:
    """`<out>/<name>.json`: every part's figures, written as they come so a part cut off keeps what it had."""
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))


def _device(smoke: bool) -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")


def _nvml_used() -> int | None:
    try:
        import pynvml
        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    except Exception:  # no NVML (the CPU smoke run): the figure is absent, not invented
        return None


def _optimizer(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if name == "adafactor":  # as Trainer's optim="adafactor" makes it
        from transformers.optimization import Adafactor
        return Adafactor(params, lr=5e-5, scale_parameter=False, relative_step=False, warmup_init=False)
    if name == "adamw8bit":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(params, lr=5e-5)
    return torch.optim.AdamW(params, lr=5e-5)


class _Trace:
    """The caching allocator's events while it runs: (action, address, size, stream) each."""

    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cuda"
        self.events: list[tuple[str, int, int, int]] = []
        self.error = ""

    def __enter__(self) -> "_Trace":
        if self.enabled:
            try:
                torch.cuda.memory._record_memory_history(max_entries=2_000_000, context=None, stacks="python")
            except Exception as error:  # a torch without this private API: the figures stand without a trace
                self.enabled, self.error = False, repr(error)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        try:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(None)
            for trace in snapshot.get("device_traces", [])[:1]:
                self.events = [(e["action"], e["addr"], e["size"], e.get("stream", 0)) for e in trace]
        except Exception as error:
            self.error = repr(error)


def _bert_run(config: tuple, device: torch.device, smoke: bool) -> dict:
    from transformers import BertConfig, BertForSequenceClassification

    batch, accumulation, checkpointing, fp16, optimizer_name = config
    seq = 32 if smoke else 512
    size = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64) if smoke else \
        dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
    torch.manual_seed(0)
    with torch.device(device):
        model = BertForSequenceClassification(BertConfig(num_labels=2, **size)).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    optimizer = _optimizer(optimizer_name, list(model.parameters()))
    scaler = torch.amp.GradScaler(device.type) if fp16 else None
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    labels = torch.randint(0, 2, (batch,), device=device)
    peaks, times = [], []
    for step in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        for _ in range(accumulation):
            with torch.autocast(device.type, torch.float16, enabled=fp16):
                loss = model(input_ids=ids, labels=labels).loss / accumulation
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
            peaks.append((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))
        times.append(time.perf_counter() - began)
    result = {"allocated_by_step": [p[0] for p in peaks], "reserved_by_step": [p[1] for p in peaks],
              "allocated_after": torch.cuda.memory_allocated() if device.type == "cuda" else None,
              "reserved_after": torch.cuda.memory_reserved() if device.type == "cuda" else None,
              "nvml_used_after": _nvml_used(), "step_s": times, "loss": float(loss) * accumulation}
    del model, optimizer, scaler, loss
    return result


def _bert_configs(out: Path, smoke: bool, name: str, only: tuple[str, ...] | None) -> None:
    device = _device(smoke)
    rows: dict[str, Any] = {"nvml_used_start": _nvml_used()}
    traces: dict[str, list] = {}
    for label, config in BERT_CONFIGS.items():
        if only and label not in only:
            continue
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            with _Trace(device) as trace:
                rows[label] = _bert_run(config, device, smoke)
            traces[label] = trace.events
        except Exception as error:  # 8-bit AdamW without bitsandbytes, say: written down, the rest goes on
            rows[label] = {"error": f"{type(error).__name__}: {error}"[:400]}
        write_json(out, name, rows)
    with gzip.open(out / f"{name}_traces.json.gz", "wt") as file:
        json.dump(traces, file)


def part_bert(out: Path, smoke: bool) -> None:
    _bert_configs(out, smoke, "bert", None)


def part_bert_expandable(out: Path, smoke: bool) -> None:
    """Three of the configurations again with `expandable_segments` (set before CUDA starts)."""
    assert "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "run with expandable_segments"
    _bert_configs(out, smoke, "bert_expandable", ("batch 4", "batch 4, checkpointing, fp16", "batch 4, Adafactor"))


# --- autoplan on this GPU ---------------------------------------------------------------------------------

def _gpt(device: torch.device, smoke: bool):
    from examples.gpt import build
    sizes = dict(n_layer=2, n_embd=64, n_head=2, block_size=64, vocab_size=128, batch_size=2, seq_len=64) if smoke else \
        dict(n_layer=12, n_embd=768, n_head=12, block_size=1024, vocab_size=50304, batch_size=8, seq_len=1024)
    model, (idx,) = build(**sizes)
    return model.to(device), (idx.to(device),), {}


def _llama_config(smoke: bool):
    from transformers import LlamaConfig
    if smoke:
        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128), (2, 64)
    return LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                       num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048), (2, 2048)


def _llama(device: torch.device, smoke: bool):
    from transformers import LlamaForCausalLM
    config, (batch, seq) = _llama_config(smoke)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    return model, {"input_ids": ids, "labels": ids.clone()}, {"precision": "bf16"}


def _qlora(device: torch.device, smoke: bool):
    import peft
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaForCausalLM
    config, (batch, seq) = _llama_config(smoke)
    torch.manual_seed(0)
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(config).save_pretrained(folder)
        base = AutoModelForCausalLM.from_pretrained(folder, quantization_config=nf4,
                                                    device_map={"": device.index or 0} if device.type == "cuda" else "cpu")
    base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    model = peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    return model, {"input_ids": ids, "labels": ids.clone()}, {}


def _resnet(device: torch.device, smoke: bool):
    if smoke:
        from tests.models import SmallResNet
        model, images = SmallResNet(), torch.randn(4, 3, 16, 16)
    else:
        import torchvision
        torch.manual_seed(0)
        model, images = torchvision.models.resnet50(), torch.randn(64, 3, 224, 224)
    return model.to(device), (images.to(device),), {}


MODELS: dict[str, Callable] = {"transformers Llama 2×2048 bf16": _llama, "example GPT (GPT-2 small) 8×1024": _gpt,
                               "4-bit QLoRA Llama 2×2048": _qlora, "ResNet-50 batch 64": _resnet}


def chosen_models(smoke: bool) -> dict[str, Callable]:
    """MODELS less those GPU_TRUTH_MODELS (name prefixes, comma-separated) leaves out, to rerun a few;
    the smoke run leaves out 4-bit, which bitsandbytes plans on a CPU target only in the CPU suite."""
    only = [name for name in os.environ.get("GPU_TRUTH_MODELS", "").split(",") if name]
    return {name: build for name, build in MODELS.items()
            if not (smoke and name.startswith("4-bit")) and (not only or any(name.startswith(p) for p in only))}


def _verify_one(build: Callable, device: torch.device, smoke: bool) -> dict:
    import autoplan
    model, batch, options = build(device, smoke)
    target = None if device.type == "cuda" else "cpu"
    began = time.perf_counter()
    planner = autoplan.Planner(model, example_inputs=batch, device=target, reserve=0, **options)
    roomy = planner.plan("90%")
    low, high = roomy.prediction.minimum_peak_bytes, roomy.prediction.baseline_peak_bytes
    halfway = planner.plan((low + high) // 2)
    planning_s = time.perf_counter() - began
    with _Trace(device) as trace:
        held = autoplan.verify(model, halfway, example_inputs=batch, steps=4, enforce_budget=False)
    free = autoplan.verify(model, roomy, example_inputs=batch, steps=4, enforce_budget=False)
    row = {"planning_s": planning_s, "floor": low, "no_plan": high, "budget": halfway.request.budget_bytes,
           "feasible": halfway.feasible, "trace_events": len(trace.events)}
    for name, plan, result in (("halfway", halfway, held), ("roomy", roomy, free)):
        row[name] = {"predicted": plan.prediction.peak_bytes, "simulated": result.simulated_peak_bytes,
                     "measured": result.measured_peak_bytes, "reserved": result.measured_reserved_bytes,
                     "predicted_reserved": plan.prediction.reserved_peak_bytes,
                     "predicted_step_s": result.predicted_step_time_s, "measured_step_s": result.measured_step_time_s,
                     "time_source": result.predicted_time_source, "modes": _modes(plan)}
    return row, trace.events


def _modes(plan: Any) -> str:
    counts: dict[str, int] = {}
    for choice in plan.decisions.choices().values():
        key = f"{choice.mode}/{choice.precision}" + (f"/{choice.placement}" if getattr(choice, "placement", "device") != "device" else "")
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n}× {key}" for key, n in sorted(counts.items()))


def part_verify(out: Path, smoke: bool, name: str = "verify") -> None:
    device = _device(smoke)
    rows: dict[str, Any] = {}
    traces: dict[str, list] = {}
    for model_name, build in chosen_models(smoke).items():
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            rows[model_name], traces[model_name] = _verify_one(build, device, smoke)
        except Exception as error:
            import traceback
            rows[model_name] = {"error": f"{type(error).__name__}: {error}"[:600], "where": traceback.format_exc()[-1500:]}
        write_json(out, name, rows)
        with gzip.open(out / f"{name}_traces.json.gz", "wt") as file:
            json.dump(traces, file)


def part_verify_expandable(out: Path, smoke: bool) -> None:
    """The verify part again with expandable segments (gpu_truth sets PYTORCH_CUDA_ALLOC_CONF for it)."""
    part_verify(out, smoke, name="verify_expandable")


# --- tables -----------------------------------------------------------------------------------------------

def mib(value: object) -> str:
    """Bytes in MiB for a table; '-' where there is no figure."""
    return f"{value / 2**20:,.1f}" if isinstance(value, (int, float)) else "-"


def training_tables(out: Path) -> list[str]:
    lines: list[str] = []
    for name in ("bert", "bert_expandable"):
        path = out / f"{name}.json"
        if not path.exists():
            continue
        rows = json.loads(path.read_text())
        lines += [f"\n### {name}: bert-large, seq 512 (MiB; NVML used at start {mib(rows.get('nvml_used_start'))})",
                  "| configuration | allocated step 1 | allocated steps 2–3 | reserved | NVML used after | step s |",
                  "|---|---|---|---|---|---|"]
        for label, row in rows.items():
            if not isinstance(row, dict):
                continue
            if "error" in row:
                lines.append(f"| {label} | {row['error'][:120]} |")
                continue
            alloc = row["allocated_by_step"] or [None]
            lines.append(f"| {label} | {mib(alloc[0])} | {mib(max(alloc[1:] or [None], key=lambda v: v or 0))} | "
                         f"{mib(max(row['reserved_by_step'] or [None], key=lambda v: v or 0))} | "
                         f"{mib(row['nvml_used_after'])} | {row['step_s'][-1]:.3f} |")
    for verify in ("verify", "verify_expandable"):
        lines += _verify_table(out, verify)
    return lines


def _verify_table(out: Path, verify: str) -> list[str]:
    lines: list[str] = []
    path = out / f"{verify}.json"
    if path.exists():
        lines += [f"\n### autoplan.verify on this device, {verify} (MiB, reserve=0, budget halfway floor–no plan)",
                  "| model | plan | predicted | measured allocated | error | predicted reserved | reserved | error | predicted s | measured s | modes |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, row in json.loads(path.read_text()).items():
            if "error" in row:
                lines.append(f"| {name} | error: {row['error'][:200]} |")
                continue
            for which in ("halfway", "roomy"):
                r = row[which]
                error = f"{(r['measured'] - r['predicted']) / r['predicted']:+.2%}" if r["measured"] else "-"
                guess = r.get("predicted_reserved")  # runs before the allocator model have none
                missed = f"{(r['reserved'] - guess) / guess:+.2%}" if guess and r["reserved"] else "-"
                lines.append(f"| {name} | {which} | {mib(r['predicted'])} | {mib(r['measured'])} | {error} | {mib(guess)} | "
                             f"{mib(r['reserved'])} | {missed} | {r['predicted_step_s']:.4f} | {r['measured_step_s'] or 0:.4f} | {r['modes']} |")
    return lines
