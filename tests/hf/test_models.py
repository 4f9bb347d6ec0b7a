"""Hugging Face models: every family in tests/families.py plans, rewrites, trains, generates, saves.

Models are built from tiny configs with random weights (no downloads). Each family is planned
once (cached) at a budget of its static memory plus half its no-plan activation memory, and the
tests share that plan.
"""

from __future__ import annotations

import copy
import functools
import json
import sys

import pytest
import torch

pytest.importorskip("transformers")

import autoplan  # noqa: E402
import autoplan.planned.wrappers  # noqa: E402
from autoplan.inputs.hf_models import PRESETS, default_seq_len, example_inputs_for, model_from_config, training_inputs
from tests import families  # noqa: E402
from tests.families import BATCH, FAMILIES, SEQ  # noqa: E402
from tests.handmade import enable_transformers_checkpointing  # noqa: E402

NAMES = [family.name for family in FAMILIES]


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


_planned = families.planned  # one plan per family, shared with tests/inputs/test_loop.py


def _layer_names(model: torch.nn.Module) -> list[str]:
    return [
        n for n, m in model.named_modules()
        if any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__[1:])
    ]


# -- every family ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_plans_at_half_the_activation_memory_with_its_layers_as_units(name: str) -> None:
    checked = _planned(name)
    plan = checked.plan
    model = families.BY_NAME[name].build()
    assert plan.outcome.feasible
    assert plan.prediction.simulated_peak_bytes <= checked.budget
    assert plan.model.trace_method == "hooks"
    assert [name for u in plan.decisions.units for name in u.members or (u.name,)] == _layer_names(model)  # a segment: its layers
    assert any(u.choice.mode != "keep" for u in plan.decisions.units)


@pytest.mark.parametrize("name", NAMES)
def test_predicted_peak_is_within_5_percent_of_the_simulated_peak(name: str) -> None:
    plan = _planned(name).plan
    assert abs(plan.prediction.peak_bytes - plan.prediction.simulated_peak_bytes) <= 0.05 * plan.prediction.simulated_peak_bytes


@pytest.mark.parametrize("name", NAMES)
def test_rewritten_model_trains_one_step_like_the_original(name: str) -> None:
    plan = _planned(name).plan
    trained = families.train_original_and_rewritten(families.BY_NAME[name], plan)
    assert any(mode != "keep" for mode in trained.modes)  # something is recomputed
    assert trained.state_dict_keys[0] == trained.state_dict_keys[1]
    # a fused loss head (chosen where it is the faster plan that fits) sums its gradients chunk by chunk:
    # equal to float rounding, not to the last bit; AdamW's first step is about lr·sign(gradient), so
    # the rounding of a near-zero gradient can move a parameter by up to lr (1e-2) in either model
    fused = plan.decisions.fused_loss
    tolerances = [dict(atol=1e-4, rtol=1e-4), dict(atol=1e-3, rtol=1e-4), {}] if fused else [{}, {}, {}]
    torch.testing.assert_close(trained.rewritten_loss, trained.loss, **tolerances[0])
    for (original, rewritten), tolerance in zip((trained.grads, trained.params, trained.buffers), tolerances):
        assert original.keys() == rewritten.keys()
        torch.testing.assert_close(rewritten, original, **tolerance)
    assert trained.grads[0], "no gradients were compared"


@pytest.mark.parametrize("name", [f.name for f in FAMILIES if f.generates])
def test_generate_after_rewrite_gives_the_same_tokens_and_recomputes_nothing(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    real_checkpoint = autoplan.planned.wrappers.checkpoint
    monkeypatch.setattr(autoplan.planned.wrappers, "checkpoint", lambda *a, **k: calls.append(1) or real_checkpoint(*a, **k))
    before, after = families.generate_after_rewrite(families.BY_NAME[name], _planned(name).plan)
    assert after.shape[-1] > 1
    assert torch.equal(before, after)
    assert calls == []


@pytest.mark.parametrize("name", NAMES)
def test_save_pretrained_round_trips(name: str) -> None:
    saved, reloaded = families.save_and_reload(families.BY_NAME[name], _planned(name).plan)
    assert saved.keys() == reloaded.keys()
    torch.testing.assert_close(reloaded, saved)


# -- gradient_checkpointing_enable() ----------------------------------------------------------

def _count_hf_checkpointing(model: torch.nn.Module) -> list:
    calls: list = []
    for module in model.modules():
        function = module.__dict__.get("_gradient_checkpointing_func")
        if function is not None:
            module._gradient_checkpointing_func = functools.partial(
                lambda f, *a, **k: calls.append(1) or f(*a, **k), function
            )
    return calls



@pytest.mark.parametrize("when", ["before", "after"])
def test_the_plan_wins_over_gradient_checkpointing_enable(when: str, monkeypatch: pytest.MonkeyPatch) -> None:
    family = families.BY_NAME["Llama"]
    plan = _planned("Llama").plan
    original = family.build()
    inputs = family.inputs(original)
    rewritten = copy.deepcopy(original)
    if when == "before":
        enable_transformers_checkpointing(rewritten)
        with pytest.warns(UserWarning, match="gradient checkpointing"):
            autoplan.apply(rewritten, plan)
    else:
        autoplan.apply(rewritten, plan)
        enable_transformers_checkpointing(rewritten)
    hf_calls = _count_hf_checkpointing(rewritten)
    ours = []
    real_checkpoint = autoplan.planned.wrappers.checkpoint
    monkeypatch.setattr(autoplan.planned.wrappers, "checkpoint", lambda *a, **k: ours.append(1) or real_checkpoint(*a, **k))
    loss, grads, _, _ = families._train_step(original, inputs)
    loss2, grads2, _, _ = families._train_step(rewritten, inputs)
    assert hf_calls == []  # never checkpointed twice
    # one checkpoint call per checkpointed layer on its own (a segment's region is planned.segments')
    assert len(ours) == sum(u.choice.mode != "keep" and not u.members for u in plan.decisions.units)
    torch.testing.assert_close(loss2, loss)
    torch.testing.assert_close(grads2, grads)


# -- inferred inputs, loss ------------------------------------------------------------------

@pytest.mark.parametrize(
    "name, expected",
    [
        ("Llama", {"input_ids": (BATCH, SEQ), "attention_mask": (BATCH, SEQ), "labels": (BATCH, SEQ)}),
        ("T5", {"input_ids": (BATCH, SEQ), "attention_mask": (BATCH, SEQ), "labels": (BATCH, SEQ)}),
        ("ViT", {"pixel_values": (BATCH, 3, 64, 64), "labels": (BATCH,)}),
        ("Whisper", {"input_features": (BATCH, 8, 128), "labels": (BATCH, SEQ)}),
    ],
)
def test_example_inputs_follow_the_config(name: str, expected: dict) -> None:
    model = families.BY_NAME[name].build()
    inputs = example_inputs_for(model, BATCH, SEQ)
    assert {k: tuple(v.shape) for k, v in inputs.items()} == expected
    if "input_ids" in inputs:
        assert inputs["input_ids"].dtype == torch.long and int(inputs["input_ids"].max()) < model.config.vocab_size
    assert model(**inputs).loss is not None  # the model computes its own loss from them


def test_training_inputs_turn_the_cache_off_unless_the_caller_set_it() -> None:
    model = families.BY_NAME["Llama"].build()
    assert training_inputs(model, ((), {"input_ids": 1}))[1]["use_cache"] is False
    assert training_inputs(model, ((), {"input_ids": 1, "use_cache": True}))[1]["use_cache"] is True
    vit = families.BY_NAME["ViT"].build()
    assert "use_cache" not in training_inputs(vit, ((), {"pixel_values": 1}))[1]


@pytest.mark.slow  # the whole pipeline, twice
def test_a_plan_that_fits_fits_the_loop_that_leaves_the_cache_at_the_configs_default() -> None:
    """`model(**batch)` with use_cache left at the config's True (transformers' default for causal LMs):
    plans count no KV cache, so apply turns the config's off and the loop measures what was predicted.
    Without it the layers planned `full` kept their keys and values in the cache: 32 KB over here."""
    import transformers

    from tests.handmade import measured_step

    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    model = transformers.Qwen3ForCausalLM(config)
    ids = torch.randint(0, 256, (2, 64))
    batch = {"input_ids": ids, "labels": ids.clone()}  # no use_cache: the config decides
    assert model.config.use_cache is True
    options: dict = dict(example_inputs=batch, device="cpu", precision="fp32", reserve=0)
    floor = autoplan.plan(model, "100%", **options).prediction.minimum_peak_bytes
    plan = autoplan.plan(model, floor, **options)
    assert plan.feasible and "full" in {u.choice.mode for u in plan.decisions.units}
    assert any("without a KV cache" in note and "config.use_cache" in note for note in plan.notes)
    planned = autoplan.apply(model, plan)
    assert planned.config.use_cache is False
    assert measured_step(planned, batch).peak_bytes == plan.prediction.peak_bytes


def test_default_seq_len_is_the_config_maximum_capped() -> None:
    assert default_seq_len(families.BY_NAME["Llama"].build()) == 128
    assert default_seq_len(model_from_config("llama-3-8b")) == 2048
    assert default_seq_len(model_from_config("gpt2")) == 1024


@pytest.mark.slow  # the whole pipeline
def test_plan_without_inputs_needs_a_hf_model_and_not_both_ways() -> None:
    with pytest.raises(ValueError, match="example_inputs is required"):
        autoplan.plan(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)), "1GB", batch_size=2)
    model = families.BY_NAME["Llama"].build()
    with pytest.raises(ValueError, match="not both"):
        autoplan.plan(model, "1GB", example_inputs=example_inputs_for(model, 1, 8), seq_len=8)


@pytest.mark.slow  # the whole pipeline
def test_a_model_without_labels_backpropagates_the_sum_of_its_outputs_and_loss_fn_overrides() -> None:
    import transformers

    config = transformers.BertConfig(**families.BY_NAME["BERT"].config)
    model = transformers.BertModel(config)  # no head, no labels: no loss of its own
    assert "labels" not in example_inputs_for(model, 2, 16)
    plan = autoplan.plan(model, "1GB", batch_size=2, seq_len=16, device="cpu", precision="fp32")
    assert plan.outcome.feasible
    seen = []
    autoplan.plan(model, "1GB", batch_size=2, seq_len=16, device="cpu", precision="fp32", loss_fn=lambda out: seen.append(type(out)) or out.last_hidden_state.mean())
    assert seen and all(issubclass(t, transformers.modeling_outputs.ModelOutput) for t in seen)


# -- presets, configs, meta models ------------------------------------------------------------

PUBLISHED_PARAMETERS = {  # the checkpoints' own parameter counts
    "gpt2": 124_439_808, "gpt2-xl": 1_557_611_200, "qwen2.5-0.5b": 494_032_768, "llama-3.2-1b": 1_235_814_400, "llama-3-8b": 8_030_261_248, "llama-3-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096, "qwen2-7b": 7_615_616_512, "bert-base": 109_514_298, "t5-base": 222_903_552,
    "vit-base": 86_567_656,
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_build_on_meta_with_the_published_parameter_count(preset: str) -> None:
    model = model_from_config(preset)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMETERS[preset]


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="llama-3-8b"):
        model_from_config("llama-9")


def test_missing_transformers_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"autoplan\[hf\]"):
        model_from_config("gpt2")


def _tiny_llama_json(tmp_path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], **families.BY_NAME["Llama"].config}))
    return str(path)


@pytest.mark.slow  # the whole pipeline
def test_a_meta_model_plans_exactly_like_the_same_model_with_weights(tmp_path) -> None:
    spec = _tiny_llama_json(tmp_path)
    meta, real = model_from_config(spec), model_from_config(spec, meta=False)
    assert type(meta).__name__ == "LlamaForCausalLM" and all(p.is_meta for p in meta.parameters())
    plans = [autoplan.plan(m, "1GB", batch_size=BATCH, seq_len=SEQ, device="h100-80gb", precision="bf16") for m in (meta, real)]
    assert plans[0].to_dict() | {"solve_time_s": 0} == plans[1].to_dict() | {"solve_time_s": 0}
    with pytest.raises(ValueError, match="meta device"):
        autoplan.optimize(meta, "1GB", batch_size=BATCH, seq_len=SEQ)
    with pytest.raises(ValueError, match="meta device"):
        autoplan.apply(meta, plans[0])


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_loop_that_leaves_the_cache_on_trains_as_the_original(mode: str) -> None:
    """`model(**batch)` in training, use_cache left at the config's True: a checkpointed layer must not
    write the cache (transformers ≥ 5.24 passes it as `cache=`), or its recompute sees twice the keys."""
    family = families.BY_NAME["Llama"]
    model = family.build()
    original = copy.deepcopy(model)
    inputs = family.inputs(model)
    plan = autoplan.plan(model, "1GB", example_inputs=inputs, device="cpu", precision="fp32", checkpoint={"*": mode})
    autoplan.apply(model, plan)
    assert {u.choice.mode for u in plan.decisions.units} == {mode}
    for m in (model, original):
        m.train()
        for _ in range(2):  # the second step too: nothing of the first step's cache may linger
            m.zero_grad()
            loss = m(**inputs, use_cache=True).loss
            loss.backward()
        m.final_loss = loss.detach()
    torch.testing.assert_close(model.final_loss, original.final_loss)
    grads = dict(original.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, msg=name)
