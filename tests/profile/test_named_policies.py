"""Named checkpoint policies (profile.named_policies): a unit pinned to one takes exactly what the policy's own
code saves, and the plan's peak is what a real step checkpointed by hand with that code holds."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import autoplan
from autoplan.errors import OptionError
from autoplan.profile.menu import OpRecord
from autoplan.profile.named_policies import named_saves
from tests.handmade import measured_step, torchtitan_policy_contexts

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)


def _op(occurrence: str, savable: bool = True) -> OpRecord:
    return OpRecord(occurrence, "", 1024, 1e-6, 1, savable)


def test_torchtitan_op_saves_every_other_matmul_counted_from_one_and_attention():
    ops = tuple(_op(name) for name in ("aten.mul#0", "aten.mm#0", "aten.mm#1", "aten.mm#2", "aten.sdpa#0", "aten.mm#3",
                                       "aten.addmm#0", "aten.max#0", "aten.silu#0", "aten.mm#4"))
    assert named_saves("torchtitan-op", ops) == ("aten.mm#0", "aten.mm#2", "aten.sdpa#0", "aten.max#0", "aten.mm#4")
    # an op a policy may not save (in place, a view) is left to recompute, as torch's selective checkpointing would refuse it
    assert named_saves("torchtitan-op", (_op("aten.mm#0", savable=False), _op("aten.mm#1"))) == ()


def _torchtitan_by_hand(model: torch.nn.Module) -> torch.nn.Module:
    """Each decoder layer wrapped as torchtitan wraps a block: its op-level policy, word for word in what it decides."""
    model.config.use_cache = False  # as transformers' own checkpointing sets it: a cache would grow in the recomputation
    for layer in model.model.layers:
        forward = layer.forward
        layer.forward = (lambda forward: lambda *args, **kwargs: checkpoint(
            forward, *args, use_reentrant=False, context_fn=torchtitan_policy_contexts, **kwargs))(forward)
    return model


# q, v, gate and down projections are a Llama block's 1st, 3rd, 5th and 7th matmul; Qwen2's biased q, k, v run addmm,
# which torchtitan's rule neither counts nor saves: its o and up projections are the 1st and 3rd aten.mm
CASES = {
    "llama-sdpa": ("LlamaForCausalLM", "LlamaConfig", "sdpa", ("aten.mm#0", "aten.mm#2", "aten.sdpa#0", "aten.mm#4", "aten.mm#6")),
    "llama-eager": ("LlamaForCausalLM", "LlamaConfig", "eager", ("aten.mm#0", "aten.mm#2", "aten.mm#4", "aten.mm#6")),
    "qwen2-sdpa": ("Qwen2ForCausalLM", "Qwen2Config", "sdpa", ("aten.sdpa#0", "aten.mm#0", "aten.mm#2")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_plan_pinned_to_torchtitan_op_predicts_torchtitans_own_policy_run_by_hand(case):
    model_class, config_class, attention, expected = CASES[case]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**CONFIG, attn_implementation=attention))
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    plan = autoplan.plan(model, "1GB", example_inputs=batch, device="cpu", precision="fp32", fuse_loss=False,
                         checkpoint={"model.layers.*": "torchtitan-op"})
    assert [unit.choice.saves for unit in plan.decisions.units] == [expected] * CONFIG["num_hidden_layers"]
    assert all(unit.policy_summary.startswith("torchtitan's op-level") for unit in plan.decisions.units)
    by_hand = measured_step(_torchtitan_by_hand(copy.deepcopy(model)), batch)
    assert plan.prediction.peak_bytes == by_hand.peak_bytes
    applied = measured_step(autoplan.apply(copy.deepcopy(model), plan), batch)
    assert applied.peak_bytes == by_hand.peak_bytes


def test_an_unknown_policy_is_refused_when_the_planner_is_made():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(OptionError, match="torchtitan-op"):
        autoplan.Planner(model, example_inputs=torch.randn(2, 4), device="cpu", checkpoint={"0": "megatron"})
