"""Quantized bases (bitsandbytes 4-bit and 8-bit) with peft LoRA adapters: planned, measured, trained.

A tiny Llama is saved and loaded back through transformers' BitsAndBytesConfig, as a person loads a
QLoRA base; bitsandbytes runs real training steps on the CPU, so every prediction here is checked
against the live tensor bytes of real steps.
"""

from __future__ import annotations

import copy

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import autoplan  # noqa: E402
from tests import halfway  # noqa: E402
from autoplan.instruments.fake import fake_copy, new_fake_mode  # noqa: E402
from autoplan.instruments.quantized import quantization_state_tensors, resident_tensors  # noqa: E402
from autoplan.vocabulary.tensors import rounded_bytes, unique_storage_bytes  # noqa: E402
from autoplan.instruments.tracker import LiveBytesTracker  # noqa: E402
from autoplan.errors import ProfileError  # noqa: E402
from autoplan.inputs.devices import get_device  # noqa: E402

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).save_pretrained(path)
    return path


def quantized(path, quantization: str, *, lora: bool = True, compute=torch.bfloat16):
    configs = {
        "nf4-double": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute),
        "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False, bnb_4bit_compute_dtype=compute),
        "int8": dict(load_in_8bit=True),
    }
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.BitsAndBytesConfig(**configs[quantization]), device_map="cpu")
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    return model


def batch(tokens: int = 48):
    ids = torch.randint(0, CONFIG["vocab_size"], (2, tokens), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def wide_nf4_plan(saved_llama):
    """The double-quantized 4-bit LoRA Llama's plan at 1GB (nothing checkpointed), made once for the
    tests that read it (a Plan is frozen; each test loads its own model)."""
    return autoplan.plan(quantized(saved_llama, "nf4-double"), "1GB", example_inputs=batch(), device="cpu")


def halfway_plan(model, inputs, wide=None):
    """A plan at a budget halfway between the lowest peak and no plan: some units checkpointed, some not.
    `wide`: the model's plan at 1GB where a test already has it."""
    if wide is None:  # one profile for both solves
        return halfway.halfway_plan(model, example_inputs=inputs, device="cpu", reserve=0)
    return autoplan.plan(model, halfway.halfway_budget(wide), example_inputs=inputs, device="cpu", reserve=0)


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("quantization", ["nf4-double", "fp4"])
def test_4bit_lora_prediction_equals_real_steps_in_the_common_loop(saved_llama, quantization, request):
    model, inputs = quantized(saved_llama, quantization), batch()
    plan = halfway_plan(model, inputs, request.getfixturevalue("wide_nf4_plan") if quantization == "nf4-double" else None)
    assert plan.outcome.feasible
    assert len({u.choice.mode for u in plan.decisions.units}) > 1, "a halfway budget should mix checkpointed and kept units"
    result = autoplan.verify(model, plan, example_inputs=inputs)
    assert result.held
    assert result.measured_peak_bytes <= plan.prediction.peak_bytes <= result.measured_peak_bytes * 1.01


@pytest.mark.slow  # the whole pipeline
def test_8bit_base_prediction_equals_real_steps_in_the_common_loop(saved_llama):
    """LLM.int8()'s training matmul keeps its input as an attribute of its autograd node, which backward
    does not free: the graph the loop's `loss` still holds keeps it through the next forward, and how
    much depends on each unit's precision (the memory model's `spent_bytes`)."""
    model, inputs = quantized(saved_llama, "int8"), batch()
    plan = halfway_plan(model, inputs)
    result = autoplan.verify(model, plan, example_inputs=inputs)
    assert result.held
    assert result.measured_peak_bytes <= plan.prediction.peak_bytes <= result.measured_peak_bytes * 1.01


@pytest.mark.slow  # the whole pipeline
@pytest.mark.slow  # ten plans of one profile
@pytest.mark.parametrize("adapter", ["lora", "ia3"])
def test_an_8bit_base_fits_every_budget_above_one_it_fits(saved_llama, adapter):
    """At 1.8 MB this 8-bit base planned FITS and at 2.1 MB DOES NOT FIT: every solved plan simulated over the
    budget, the re-solves (each tightened by a MiB) ran below the floor, and the lowest-peak choices, which fit, were
    never checked. Walked over ten budgets from the floor to no plan, a budget that fits stays fitting."""
    model = quantized(saved_llama, "int8", lora=adapter == "lora")
    if adapter == "ia3":
        model = peft.get_peft_model(model, peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                                          feedforward_modules=["down_proj"]))
    planner = autoplan.Planner(model, example_inputs=batch(64), device="cpu", reserve=0)
    wide = planner.plan("100%")
    floor, none = wide.prediction.minimum_peak_bytes, wide.prediction.baseline_peak_bytes
    budgets = sorted({1_800_000, 2_100_000} | {floor + (none - floor) * step // 9 for step in range(1, 10)})
    plans = [planner.plan(budget) for budget in budgets]
    fitting = [plan.outcome.feasible for plan in plans]
    assert fitting == sorted(fitting), list(zip(budgets, fitting))  # once it fits, it fits every larger budget
    assert all(plan.prediction.peak_bytes <= plan.request.usable_bytes for plan in plans if plan.outcome.feasible)


def test_packed_weights_and_quant_state_count_as_parameters(saved_llama, wide_nf4_plan):
    model = quantized(saved_llama, "nf4-double")
    state = quantization_state_tensors(model)
    assert state, "a double-quantized 4-bit base holds absmax, codes and offsets beside its packed weights"
    plan = wide_nf4_plan  # this model's plan at 1GB
    assert plan.prediction.breakdown.parameters == unique_storage_bytes(resident_tensors(model))
    assert plan.prediction.breakdown.parameters > unique_storage_bytes(list(model.parameters()) + list(model.buffers()))
    # AdamW's state is the adapters' alone: two fp32 tensors and a step count per trainable (LoRA) weight
    adapters = [p for p in model.parameters() if p.requires_grad]
    assert adapters and all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)
    assert plan.prediction.breakdown.optimizer == sum(2 * rounded_bytes(p.numel() * 4) + rounded_bytes(4) for p in adapters)


def test_fake_twin_keeps_quant_state_and_int8_aliasing(saved_llama):
    mode = new_fake_mode()
    four = fake_copy(quantized(saved_llama, "nf4-double", lora=False), mode)
    layer = four.model.layers[0].self_attn.q_proj
    assert layer.weight.dtype == torch.uint8 and layer.weight.quant_state.nested
    assert type(layer.weight.quant_state.absmax).__name__ == "FakeTensor"
    assert type(layer.weight.quant_state.state2.absmax).__name__ == "FakeTensor"
    eight = fake_copy(quantized(saved_llama, "int8", lora=False), mode)
    weight = eight.model.layers[0].mlp.up_proj.weight
    assert weight.dtype == torch.int8
    assert weight.CB.untyped_storage()._cdata == weight.untyped_storage()._cdata  # one storage, as in the real layer


def test_a_deep_copied_4bit_model_counts_the_original_layers_it_keeps_alive(saved_llama):
    """bitsandbytes' Params4bit.__deepcopy__ points the copy's weight at the original's layer (`.module`) and copies the
    weight's quant state outside deepcopy's memo: the copy holds the original layers and a second quant state per layer.
    The CPU allocator's walk (verify.allocator, which shares no code with instruments.quantized) sees that memory;
    the plan's resident bytes and the fake twin's must too."""
    from autoplan.verify.allocator import resident_bytes
    original = quantized(saved_llama, "nf4-double")
    copied = copy.deepcopy(original)
    assert unique_storage_bytes(resident_tensors(original)) == resident_bytes(original)
    assert resident_bytes(copied) > resident_bytes(original)  # the copy keeps the original's 4-bit layers alive
    assert unique_storage_bytes(resident_tensors(copied)) == resident_bytes(copied)
    assert unique_storage_bytes(resident_tensors(fake_copy(copied, new_fake_mode()))) == resident_bytes(copied)


@pytest.mark.slow  # the whole pipeline
def test_a_deep_copied_4bit_model_predicts_its_real_steps_and_says_why_it_holds_more(saved_llama):
    copied = copy.deepcopy(quantized(saved_llama, "nf4-double"))
    inputs = batch()
    plan = halfway_plan(copied, inputs)
    assert any("Params4bit.__deepcopy__" in note for note in plan.notes)
    run = autoplan.verify(copied, plan, example_inputs=inputs, steps=3)
    assert run.held and plan.prediction.peak_bytes * 0.99 <= run.measured_peak_bytes <= plan.prediction.peak_bytes


def test_4bit_matmul_peaks_like_its_dequantize_then_linear(saved_llama):
    """The tracker's rule for the fused op's hidden temporary equals running its two steps in the open, as a GPU target
    counts them (no CPU kernel's scratch)."""
    layer = quantized(saved_llama, "nf4-double", lora=False).model.layers[0].mlp.up_proj
    x = torch.randn(2, 48, CONFIG["hidden_size"], dtype=torch.bfloat16)
    device = get_device("h100-80gb")
    fused = LiveBytesTracker(device)
    with fused, torch.no_grad():
        out = bnb.matmul_4bit(x, layer.weight, quant_state=layer.weight.quant_state)
    del out
    state = layer.weight.quant_state
    opened = LiveBytesTracker(device)
    with opened, torch.no_grad():
        absmax = torch.ops.bitsandbytes.dequantize_blockwise.default(state.absmax, state.state2.absmax, state.state2.code, 256, torch.float32)
        scaled = absmax + state.offset
        weight = torch.ops.bitsandbytes.dequantize_4bit.default(layer.weight, scaled, state.blocksize, state.quant_type, state.shape, x.dtype)
        out = torch.nn.functional.linear(x, weight)
    assert fused.phases()[0].peak_bytes == opened.phases()[0].peak_bytes > 0


def test_4bit_matmul_on_a_cpu_target_holds_what_the_real_call_holds(saved_llama):
    """On a CPU target the fused op's real call is read (instruments.cpu_scratch): its matmul may pack its operands
    (an AVX512-BF16 CPU's oneDNN held 4× the dequantized weight), which the rule alone misses. The tracker's peak is the
    real call's as torch's profiler counts the CPU allocator's blocks, and never below the rule's."""
    layer = quantized(saved_llama, "nf4-double", lora=False).model.layers[0].mlp.up_proj
    x = torch.randn(2, 48, CONFIG["hidden_size"], dtype=torch.bfloat16)
    state = layer.weight.quant_state
    on_cpu, on_gpu = LiveBytesTracker(get_device("cpu")), LiveBytesTracker(get_device("h100-80gb"))
    for tracker in (on_cpu, on_gpu):
        with tracker, torch.no_grad():
            out = bnb.matmul_4bit(x, layer.weight, quant_state=state)
        del out
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with profiler, torch.no_grad():
        out = bnb.matmul_4bit(x, layer.weight, quant_state=state)
    held = real_peak = 0
    for event in sorted((e for e in profiler.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        blocks = -(-abs(event.nbytes()) // 512)  # each block as the CPU allocator's is rounded, up to 512 bytes
        held += blocks * 512 if event.nbytes() > 0 else -blocks * 512
        real_peak = max(real_peak, held)
    assert on_cpu.phases()[0].peak_bytes == max(real_peak, on_gpu.phases()[0].peak_bytes) > 0


def test_4bit_matmul_flops_are_counted(saved_llama):
    layer = quantized(saved_llama, "fp4", lora=False).model.layers[0].mlp.down_proj
    x = torch.randn(3, 5, CONFIG["intermediate_size"], dtype=torch.bfloat16)
    tracker = LiveBytesTracker(get_device("cpu"))
    with tracker, torch.no_grad():
        bnb.matmul_4bit(x, layer.weight, quant_state=layer.weight.quant_state)
    assert tracker.phases()[0].flops == 2 * 15 * CONFIG["intermediate_size"] * CONFIG["hidden_size"]


@pytest.mark.slow  # the whole pipeline
def test_planned_qlora_trains_as_the_unplanned_model(saved_llama):
    inputs = batch()
    model = quantized(saved_llama, "nf4-double", compute=torch.float32)
    twin = copy.deepcopy(model)
    plan = autoplan.plan(model, "1GB", example_inputs=inputs, device="cpu", precision="fp32",
                         checkpoint=["*layers.0", "*layers.2"])
    assert {u.choice.mode for u in plan.decisions.units} >= {"full", "keep"}
    autoplan.apply(model, plan)

    def losses(m):
        torch.manual_seed(3)
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        out = []
        m.train()
        for _ in range(3):
            loss = m(**inputs).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out, [p.detach().clone() for p in m.parameters() if p.requires_grad]

    (planned, planned_weights), (plain, plain_weights) = losses(model), losses(twin)
    assert planned == pytest.approx(plain, rel=1e-5)
    for a, b in zip(planned_weights, plain_weights, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)  # Adam normalises tiny gradient differences


@pytest.mark.slow  # the whole pipeline
def test_4bit_base_plans_for_a_gpu_and_8bit_says_it_cannot(saved_llama):
    plan = autoplan.plan(quantized(saved_llama, "nf4-double"), "24GB", example_inputs=batch(), device="rtx-4090")
    assert plan.outcome.feasible and plan.target.device == "rtx-4090"
    with pytest.raises(ProfileError, match="8-bit layers .* for the CPU only.*load_in_4bit"):
        autoplan.plan(quantized(saved_llama, "int8"), "24GB", example_inputs=batch(), device="rtx-4090")


def test_selective_rule_keeps_the_4bit_matmul_outputs():
    """The fixed selective rule keeps matmul outputs; a 4-bit base's matmuls are one fused op of their own."""
    from torch.utils.checkpoint import CheckpointPolicy

    from autoplan.axes.checkpoint import OccurrencePolicy

    policy = OccurrencePolicy(None)

    class Ctx:
        pass

    gemm = torch.ops.bitsandbytes.gemm_4bit.default
    assert policy(Ctx(), gemm) == CheckpointPolicy.MUST_SAVE and policy.asked == ("bitsandbytes.gemm_4bit#0", gemm)
    assert policy(Ctx(), torch.ops.aten.add.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE


FAMILIES = {
    "qwen2": ("Qwen2Config", dict(CONFIG)),
    "mistral": ("MistralConfig", dict(CONFIG)),
    "phi3": ("Phi3Config", {k: v for k, v in CONFIG.items()} | dict(pad_token_id=0)),
}


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("family,quant_type,double,compute,rank,targets,kbit_checkpointing", [
    ("qwen2", "nf4", False, torch.float16, 4, ["q_proj", "v_proj"], False),
    ("mistral", "fp4", True, torch.float32, 16, "all-linear", True),  # kbit's input-grad hook and HF checkpointing on
    ("phi3", "nf4", True, torch.bfloat16, 32, ["qkv_proj", "o_proj", "gate_up_proj"], False),  # fused projections
])
def test_other_bases_and_adapters_predict_real_steps(tmp_path, family, quant_type, double, compute, rank, targets, kbit_checkpointing):
    config_class, sizes = FAMILIES[family]
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**sizes)).save_pretrained(tmp_path)
    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                                   bnb_4bit_use_double_quant=double, bnb_4bit_compute_dtype=compute)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantization, device_map="cpu")
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=kbit_checkpointing)
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, task_type="CAUSAL_LM"))
    inputs = batch()
    plan = halfway_plan(model, inputs)
    assert plan.outcome.feasible and len({u.choice.mode for u in plan.decisions.units}) > 1
    result = autoplan.verify(model, plan, example_inputs=inputs)
    assert result.held
    assert result.measured_peak_bytes <= plan.prediction.peak_bytes <= result.measured_peak_bytes * 1.01


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("adapter", ["dora", "lora-with-trained-head", "ia3"])
def test_other_peft_adapters_on_a_4bit_base_predict_real_steps(saved_llama, adapter):
    """DoRA dequantizes each 4-bit weight for its norm (peft reads the weight's class name to know how);
    modules_to_save trains a full copy of the head; IA3 scales activations."""
    configs = {
        "dora": lambda: peft.LoraConfig(r=8, target_modules="all-linear", use_dora=True, task_type="CAUSAL_LM"),
        "lora-with-trained-head": lambda: peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"],
                                                          task_type="CAUSAL_LM"),
        "ia3": lambda: peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"],
                                      task_type="CAUSAL_LM"),
    }
    model = peft.get_peft_model(quantized(saved_llama, "nf4-double", lora=False), configs[adapter]())
    inputs = batch()
    plan = halfway_plan(model, inputs)
    assert plan.outcome.feasible and len({u.choice.mode for u in plan.decisions.units}) > 1
    result = autoplan.verify(model, plan, example_inputs=inputs)
    assert result.held
    assert result.measured_peak_bytes <= plan.prediction.peak_bytes <= result.measured_peak_bytes * 1.01
