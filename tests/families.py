"""The Hugging Face model families autoplan is tested on, the checks run on each, and the README table.

`FAMILIES` is what `tests/hf/test_models.py` parametrizes over; `check_*` are the checks those tests run.
Run as a script, it runs the same checks on every family and prints the markdown table the README
shows, so the table cannot claim more than the tests prove:

    python -m tests.families
"""

from __future__ import annotations

import copy
import functools
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

import autoplan
from autoplan.inputs.batch import training_batch
from autoplan.inputs.hf_models import example_inputs_for

BATCH, SEQ = 4, 64
_COMMON = dict(vocab_size=64)


@dataclass(frozen=True)
class Family:
    """A tiny (2-layer, narrow) model of one architecture, built from its config with random weights."""

    name: str  # what the README calls it
    config_class: str  # transformers config class
    model_class: str  # transformers model class
    config: dict[str, Any] = field(default_factory=dict)  # tiny values (2 layers, small hidden)
    generates: bool = True  # has a generate() worth testing

    def build(self) -> torch.nn.Module:
        import transformers

        torch.manual_seed(0)
        config = getattr(transformers, self.config_class)(**self.config)
        return getattr(transformers, self.model_class)(config)

    def inputs(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return example_inputs_for(model, BATCH, SEQ)


_DECODER = dict(
    **_COMMON, hidden_size=32, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128,
)
FAMILIES: tuple[Family, ...] = (
    Family("GPT-2", "GPT2Config", "GPT2LMHeadModel", dict(**_COMMON, n_embd=32, n_layer=4, n_head=2, n_positions=128, bos_token_id=0, eos_token_id=0)),
    Family("Llama", "LlamaConfig", "LlamaForCausalLM", _DECODER),
    Family("Mistral", "MistralConfig", "MistralForCausalLM", dict(_DECODER, sliding_window=8)),
    Family("Qwen2", "Qwen2Config", "Qwen2ForCausalLM", _DECODER),
    Family("Gemma", "GemmaConfig", "GemmaForCausalLM", dict(_DECODER, head_dim=8)),
    Family("Phi", "PhiConfig", "PhiForCausalLM", dict(_DECODER, partial_rotary_factor=0.5)),
    Family("BERT", "BertConfig", "BertForMaskedLM", dict(
        **_COMMON, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=128), generates=False),
    Family("RoBERTa", "RobertaConfig", "RobertaForMaskedLM", dict(
        **_COMMON, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=128, pad_token_id=1), generates=False),
    Family("T5", "T5Config", "T5ForConditionalGeneration", dict(
        **_COMMON, d_model=32, d_kv=8, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0)),
    Family("ViT", "ViTConfig", "ViTForImageClassification", dict(
        hidden_size=32, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, image_size=64,
        patch_size=8, num_labels=5), generates=False),
    Family("Whisper", "WhisperConfig", "WhisperForConditionalGeneration", dict(
        **_COMMON, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=8,
        max_source_positions=64, max_target_positions=128, decoder_start_token_id=1, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, begin_suppress_tokens=None, suppress_tokens=None)),
)
BY_NAME = {family.name: family for family in FAMILIES}


# -- the checks ------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlanCheck:
    plan: autoplan.Plan
    budget: int  # static memory + half the no-plan activation memory
    seconds: float  # wall time of autoplan.plan at that budget


def half_activation_budget(family: Family, precision: str = "fp32", loop: autoplan.TrainingLoop | None = None) -> int:
    """Static memory (parameters, gradients, AdamW state) plus half the no-plan activation memory of `loop`."""
    from autoplan.inputs.devices import get_device
    from autoplan.profile.simulation import run_timeline
    from autoplan.trace.tracer import trace

    model = family.build()
    traced = trace(model, training_batch(model, None, BATCH, SEQ), None)
    keep = {unit: autoplan.Choice("keep", precision) for unit in traced.units}
    timeline = run_timeline(traced, keep, device=get_device("cpu"), optimizer="adamw", loop=loop)
    static = timeline.static.parameters + timeline.static.gradients + timeline.static.optimizer
    return static + (timeline.peak_bytes - static) // 2


def plan_at_half_activations(family: Family, precision: str = "fp32", loop: autoplan.TrainingLoop | None = None) -> PlanCheck:
    """autoplan.plan, inputs inferred from the config, at `half_activation_budget` of `loop`."""
    model = family.build()
    budget = half_activation_budget(family, precision, loop)
    start = time.perf_counter()
    plan = autoplan.plan(
        model, budget, batch_size=BATCH, seq_len=SEQ, device="cpu", precision=precision, reserve=0, loop=loop
    )
    return PlanCheck(plan, budget, time.perf_counter() - start)


@functools.cache
def planned(name: str) -> PlanCheck:
    """The family's fp32 plan for the common loop (outputs kept), made once per test session."""
    return plan_at_half_activations(BY_NAME[name])


def _train_step(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, dict, dict, dict]:
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)  # the same dropout masks in both models
    loss = model(**inputs).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return loss.detach(), grads, params, buffers


@dataclass(frozen=True)
class TrainCheck:
    loss: torch.Tensor
    rewritten_loss: torch.Tensor
    grads: tuple[dict, dict]
    params: tuple[dict, dict]
    buffers: tuple[dict, dict]
    modes: tuple[str, ...]  # the checkpoint mode the rewritten model ran each unit with
    state_dict_keys: tuple[list, list]


def train_original_and_rewritten(family: Family, plan: autoplan.Plan) -> TrainCheck:
    """One AdamW step of the original and of a copy rewritten with `plan`, from the same weights."""
    original = family.build()
    inputs = family.inputs(original)
    rewritten = autoplan.apply(copy.deepcopy(original), plan)
    modes = tuple(choice.mode for choice in autoplan.planned_choices(rewritten).values())
    keys = (list(original.state_dict()), list(rewritten.state_dict()))
    loss, grads, params, buffers = _train_step(original, inputs)
    loss2, grads2, params2, buffers2 = _train_step(rewritten, inputs)
    return TrainCheck(loss, loss2, (grads, grads2), (params, params2), (buffers, buffers2), modes, keys)


def generate_after_rewrite(family: Family, plan: autoplan.Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy generate() of the original and the rewritten model (cache on, no grad): the tokens."""
    original = family.build().eval()
    rewritten = autoplan.apply(copy.deepcopy(original), plan)
    inputs = family.inputs(original)
    prompt = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask", "input_features")}
    options = dict(max_new_tokens=4, do_sample=False, use_cache=True)
    return original.generate(**prompt, **options), rewritten.generate(**prompt, **options)


def save_and_reload(family: Family, plan: autoplan.Plan) -> tuple[dict, dict]:
    """save_pretrained of a rewritten model, from_pretrained of the directory: both state dicts."""
    rewritten = autoplan.apply(family.build(), plan)
    with tempfile.TemporaryDirectory() as directory:
        rewritten.save_pretrained(directory)
        reloaded = type(rewritten).from_pretrained(directory)
    return rewritten.state_dict(), reloaded.state_dict()


# -- the README table ------------------------------------------------------------------------

def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)


def family_row(family: Family) -> str:
    checked = plan_at_half_activations(family)
    plan = checked.plan
    trained = train_original_and_rewritten(family, plan)
    trains = (
        torch.allclose(trained.loss, trained.rewritten_loss, rtol=1e-5)
        and all(_same(*pair) for pair in (trained.grads, trained.params, trained.buffers))
    )
    generated = "n/a"
    if family.generates:
        before, after = generate_after_rewrite(family, plan)
        generated = "yes" if torch.equal(before, after) else "NO"
    saved, reloaded = save_and_reload(family, plan)
    error = abs(plan.prediction.peak_bytes - plan.prediction.simulated_peak_bytes) / plan.prediction.simulated_peak_bytes
    modes = ", ".join(f"{u.choice.mode}" for u in plan.decisions.units)
    return (
        f"| {family.name} | `{family.model_class}` | {len(plan.decisions.units)} | {plan.model.trace_method} | "
        f"{'yes' if plan.outcome.feasible else 'NO'} | {modes} | {100 * error:.1f}% | {'yes' if trains else 'NO'} | "
        f"{generated} | {'yes' if _same(saved, reloaded) else 'NO'} |"
    )


def main(names: list[str]) -> None:
    import transformers

    chosen = [BY_NAME[n] for n in names] if names else FAMILIES
    print(f"<!-- python -m tests.families · transformers {transformers.__version__} · torch {torch.__version__} -->")
    print("| family | model class | units | traced by | fits 50% of activations | modes chosen "
          "| predicted vs simulated peak | trains like the original | generate | save_pretrained round-trip |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for family in chosen:
        print(family_row(family), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
