"""FSDP: the per-rank plan, world_size="auto", and a real 2-process gloo run against the plan.

The distributed tests launch `torch.distributed.run` with two CPU processes (gloo); they skip when
torch.distributed or gloo is missing. The planned, FSDP2-sharded model must train to the same
losses as one process on both ranks' batches, and each rank's measured peak (the CPU allocator's count
of the real run, `autoplan/verify/fsdp.py`) must be at most the plan's per-rank prediction and close to it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import autoplan
from autoplan.plan import Choice
from autoplan.errors import DistributedSetupError
from examples.llama import build
from autoplan.planned.forwards import apply_choices
from autoplan.units import Unit
from tests.fsdp_model import STEPS, qwen2_batch, rank_batch, shared_batch, shared_block, tiny_llama, tiny_qwen2
from tests.models import ALL_MODELS
from tests.two_ranks import assert_counted_to_the_byte, distributed, run_on_two_ranks


@pytest.fixture(scope="module")
def per_rank_plans():
    model, config = tiny_llama()
    batch = rank_batch(config, 0)
    plans = {n: autoplan.plan(model, "1GB", example_inputs=batch, device="cpu", reserve=0, world_size=n, profile="roofline")
             for n in (1, 2, 4)}
    return model, batch, plans


@pytest.mark.slow  # the whole pipeline
def test_world_size_one_is_the_single_gpu_plan(per_rank_plans) -> None:
    model, batch, plans = per_rank_plans
    default = autoplan.plan(model, "1GB", example_inputs=batch, device="cpu", reserve=0, profile="roofline")
    assert plans[1].prediction.peak_bytes == default.prediction.peak_bytes and plans[1].prediction.fsdp is None


def test_per_rank_breakdown_adds_up_and_shrinks_with_more_gpus(per_rank_plans) -> None:
    _, _, plans = per_rank_plans
    for n in (2, 4):
        plan = plans[n]
        assert plan.request.world_size == n and plan.prediction.fsdp.world_size == n
        assert plan.prediction.fsdp.total == plan.prediction.peak_bytes == plan.prediction.breakdown.total
        assert plan.prediction.fsdp.optimizer < plans[1].prediction.breakdown.optimizer / n + 512 * 64  # sharded, not replicated
        data = json.loads(plan.to_json())
        assert data["world_size"] == n and data["fsdp"]["total"] == plan.prediction.peak_bytes
    assert plans[4].prediction.peak_bytes < plans[2].prediction.peak_bytes < plans[1].prediction.peak_bytes
    assert plans[4].prediction.fsdp.parameters < plans[2].prediction.fsdp.parameters


@pytest.mark.slow  # the whole pipeline
def test_per_rank_budget_constrains_the_solver() -> None:
    """A budget one GPU cannot meet without checkpointing is met on 4 ranks without it."""
    model, config = tiny_llama()
    batch = rank_batch(config, 0)
    four = autoplan.plan(model, "1GB", example_inputs=batch, device="cpu", reserve=0, world_size=4, profile="roofline")
    budget = four.prediction.peak_bytes + 4096  # fits 4 ranks keeping everything
    one = autoplan.plan(model, budget, example_inputs=batch, device="cpu", reserve=0, profile="roofline")
    sharded = autoplan.plan(model, budget, example_inputs=batch, device="cpu", reserve=0, world_size=4, profile="roofline")
    assert sharded.outcome.feasible and all(u.choice.mode == "keep" for u in sharded.decisions.units)
    assert one.prediction.peak_bytes > budget or not one.outcome.feasible or any(u.choice.mode != "keep" for u in one.decisions.units)


@pytest.mark.slow  # the whole pipeline
def test_auto_finds_the_fewest_gpus_and_shows_the_curve() -> None:
    model, batch = build("tiny", 2, 32)
    plan = autoplan.plan(model, "12MB", example_inputs=batch, device="cpu", reserve=0, world_size="auto", profile="roofline")
    curve = {point.world_size: point for point in plan.prediction.world_size_curve}
    assert plan.outcome.feasible and plan.request.world_size >= 2 and curve[plan.request.world_size].fits
    assert all(not point.fits for n, point in curve.items() if n < plan.request.world_size)
    assert plan.request.world_size - 1 in curve  # the one below the answer was tried and did not fit
    # the state alone (16 bytes per parameter for AdamW with fp32 master weights) sets a floor
    assert plan.model.state_bytes / plan.model.parameter_count == pytest.approx(16, rel=0.02)
    assert plan.request.world_size >= -(-plan.model.state_bytes // plan.request.usable_bytes)
    report = plan.report()
    assert "per-rank peak against the number of ranks" in report and "← chosen" in report  # the cpu profile: ranks, not GPUs
    assert f"per rank on {plan.request.world_size} ranks" in report


@pytest.mark.slow  # the whole pipeline
def test_more_ranks_than_a_parameter_has_rows_says_what_the_padding_costs() -> None:
    """Issue 39: --world-size 65536 on a 135K-parameter model planned 278 MB per GPU without a word: FSDP pads
    each parameter to a row per rank, and gathers ranks × rows. Three Linear(16, 16): 6 parameters of 16 rows."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()) for _ in range(3)])
    batch = (torch.randn(4, 16),)
    notes = {n: [note for note in autoplan.plan(model, "1GB", example_inputs=batch, device="cpu", reserve=0, world_size=n,
                                                 profile="roofline").notes if note.startswith("FSDP pads")] for n in (16, 64)}
    assert notes[16] == []  # every rank holds a row of every parameter: no note
    note, = notes[64]
    # a row per rank of each: 3 × 16 × 4 B of weights and 3 × 4 B of biases, where an even split is 3 × 1088 B / 64
    assert "6 of 6 parameters have fewer rows (as few as 16)" in note
    assert "each rank holds 204 B of parameter shards where an even split is 51 B, 153 B of padding" in note
    assert "with at most 16 ranks every rank holds rows of every parameter" in note
    # a 10-row head over 16 ranks pads a few bytes of kilobytes: not worth a note (1% of the shards)
    model, batch = ALL_MODELS["residual_mlp"]()
    plan = autoplan.plan(model, "1GB", example_inputs=batch, device="cpu", reserve=0, world_size=16, profile="roofline")
    assert not any(note.startswith("FSDP pads") for note in plan.notes)


@pytest.mark.slow  # the whole pipeline
@pytest.mark.parametrize("bad", [0, -2, 1.5, "two", True])
def test_bad_world_size_is_a_clear_error(bad) -> None:
    model, batch = build("tiny", 1, 8)
    with pytest.raises(ValueError, match="world_size must be a whole number"):
        autoplan.plan(model, "1GB", example_inputs=batch, device="cpu", world_size=bad)


@pytest.mark.slow  # the whole pipeline
def test_optimize_without_a_process_group_says_what_to_do() -> None:
    model, batch = build("tiny", 1, 8)
    for world_size in (2, "auto"):
        with pytest.raises(DistributedSetupError, match="torchrun --nproc_per_node"):
            autoplan.optimize(model, "1GB", example_inputs=batch, device="cpu", world_size=world_size)


def one_process_losses(model: torch.nn.Module, loss_of_step) -> list[float]:
    """STEPS steps of AdamW (lr 1e-2, as the workers) on one process; the loss of each."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        loss = loss_of_step()
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    model, config = tiny_llama()
    single = autoplan.plan(model, "1GB", example_inputs=rank_batch(config, 0), device="cpu", reserve=0, world_size=2,
                           profile="roofline")
    budget = f"{single.prediction.peak_bytes - 2**20}B"  # below the all-keep peak: some unit must checkpoint
    return run_on_two_ranks("fsdp_worker.py", out, budget)


def test_a_gpu_plan_under_fsdp_says_its_reserved_memory_is_not_predicted() -> None:
    """Under FSDP the caching allocator is not replayed (FSDP2's streams), and torchtitan's published runs reserved
    15-37% above the allocated peak (docs/published.md): a plan for GPUs says so and names its reserve; one GPU
    (replayed) and the CPU (no caching allocator) do not."""
    model, batch = ALL_MODELS["residual_mlp"]()

    def notes(device: str, world_size: int) -> list[str]:
        plan = autoplan.plan(model, "1GB", example_inputs=batch, device=device, world_size=world_size, profile="roofline",
                             allow_over_device=True)
        assert plan.outcome.feasible
        return [note for note in plan.notes if "not predicted under FSDP" in note]

    note, = notes("h100-80gb", 2)
    assert "docs/published.md" in note and "the reserve of 811 MB may not cover that" in note
    assert notes("h100-80gb", 1) == [] and notes("cpu", 2) == []


@pytest.mark.slow  # the whole pipeline
@distributed
def test_fsdp_trains_like_one_process_on_both_batches(two_ranks) -> None:
    plan = two_ranks[0]["plan"]
    assert any(unit["mode"] != "keep" for unit in plan["units"])  # FSDP composed with checkpointing
    model, config = tiny_llama()
    autoplan.apply(model, autoplan.plan(model, "1GB", example_inputs=rank_batch(config, 0), device="cpu", reserve=0,
                                        checkpoint={u["name"]: u["mode"] for u in plan["units"] if u["mode"] != "keep"},
                                        precision="fp32", profile="roofline"))
    batches = [rank_batch(config, rank) for rank in (0, 1)]
    tokens, targets = (torch.cat(parts) for parts in zip(*batches))
    reference = one_process_losses(model, lambda: model(tokens, targets))
    # each rank's loss is the mean over its half; FSDP averages gradients, i.e. the full batch's mean
    sharded = [(a + b) / 2 for a, b in zip(two_ranks[0]["losses"], two_ranks[1]["losses"])]
    assert sharded == pytest.approx(reference, rel=1e-4)
    assert reference[-1] < reference[0]  # and it learns


@distributed
def test_measured_rank_peak_matches_the_plan(two_ranks) -> None:
    assert all(rank["plan"]["feasible"] and rank["plan"]["world_size"] == 2 for rank in two_ranks)
    assert_counted_to_the_byte(two_ranks)  # 1 KiB under until the count held the loop's outputs of the last step


# -- a module called several times per forward: its call sites share one FSDP group ----------------


def _run_workers(out: Path, budget: str, kind: str) -> list[dict]:
    return run_on_two_ranks("fsdp_worker.py", out, budget, kind)


@pytest.fixture(scope="module")
def shared_two_ranks(tmp_path_factory):
    model, batch = shared_block(), shared_batch(0)
    free = autoplan.plan(model, "1GB", example_inputs=batch, device="cpu", reserve=0, world_size=2, profile="roofline", precision="fp32")
    budget = (free.prediction.minimum_peak_bytes + free.prediction.peak_bytes) // 2  # per rank: some calls keep, some recompute
    return free, _run_workers(tmp_path_factory.mktemp("fsdp_shared"), f"{budget}B", "shared")


@pytest.mark.slow  # the whole pipeline
def test_call_sites_of_one_module_are_one_fsdp_group_in_the_plan(shared_two_ranks) -> None:
    free, _ = shared_two_ranks
    model = shared_block()
    assert [unit.name for unit in free.decisions.units] == ["embed", *(f"block@{k}" for k in range(6)), "head"]
    # the block's parameters count once per rank (about half of them on 2 ranks), not once per call
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert free.prediction.fsdp.parameters < parameter_bytes and free.model.parameter_count == sum(p.numel() for p in model.parameters())


@distributed
def test_fsdp_with_call_sites_trains_like_one_process_and_meets_its_prediction(shared_two_ranks) -> None:
    _, ranks = shared_two_ranks
    plan = ranks[0]["plan"]
    modes = {unit["name"]: unit["mode"] for unit in plan["units"]}
    assert "keep" in modes.values() and set(modes.values()) - {"keep"}  # FSDP composed with per-call checkpointing
    # rank 0 to the byte and rank 1 (smaller shards) 0.14% under, in most runs (2.4-2.5% under before a phase's start
    # was a moment of its own, memory.sharded.on_rank). The plan is rank 0's, whose shards are the largest, so no rank's
    # true peak is above it; a count reads above its rank's peak by the blocks freed in one of gloo's threads, which
    # its floor leaves out (assert_counted_to_the_byte)
    predicted = plan["predicted_peak_bytes"]
    assert all(rank["plan"]["feasible"] for rank in ranks)
    for rank in ranks:
        assert rank["floor_bytes"] <= predicted and 0.995 * predicted <= rank["peak_bytes"], (rank["floor_bytes"], rank["peak_bytes"], predicted)
    model = apply_choices(shared_block(), {Unit.from_name(name): Choice(mode, "fp32") for name, mode in modes.items()})
    batch = torch.cat([shared_batch(rank)[0] for rank in (0, 1)])
    reference = one_process_losses(model, lambda: model(batch).sum() / 2)  # FSDP averages the ranks' gradients of their sums
    sharded = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    assert sharded == pytest.approx(reference, rel=1e-4)


# -- reshard_after_forward=False: each unit's gathered parameters kept from its forward to its backward ---------


@pytest.fixture(scope="module")
def kept_two_ranks(tmp_path_factory, two_ranks):
    model, config = tiny_llama()
    free = autoplan.plan(model, "1GB", example_inputs=rank_batch(config, 0), device="cpu", reserve=0, world_size=2,
                         profile="roofline", reshard_after_forward=False)
    budget = f"{free.prediction.peak_bytes - 2**20}B"  # below the all-keep peak: some unit must checkpoint
    last = _run_workers(tmp_path_factory.mktemp("fsdp_last_kept"), "1GB", "llama-last-kept")  # as torchtitan's default
    return two_ranks, _run_workers(tmp_path_factory.mktemp("fsdp_kept"), budget, "llama-kept"), last


@distributed
def test_kept_gathered_parameters_are_counted_and_the_real_run_holds_them(kept_two_ranks) -> None:
    resharded, kept, last_kept = kept_two_ranks
    for rank in last_kept:  # as exact as resharding every unit: within a thousandth, never above
        assert 0.999 * rank["plan"]["predicted_peak_bytes"] <= rank["peak_bytes"] <= rank["plan"]["predicted_peak_bytes"]
    # to the byte (4.6% under it while the model counted an all-gather output in a kept unit's backward and a
    # forward's copy-out beside the phase's peak activations)
    assert_counted_to_the_byte(kept)
    assert all(rank["plan"]["reshard_after_forward"] == {"layers.3": False} for rank in last_kept)
    for rank in kept:
        plan = rank["plan"]
        assert plan["reshard_after_forward"] is False and plan["request"]["reshard_after_forward"] is False
        assert any(unit["mode"] != "keep" for unit in plan["units"]) and plan["feasible"]
        # more than every unit's gathered parameters at once is counted: the forward's, kept for backward
        assert plan["fsdp"]["gathered_parameters"] > max(r["plan"]["fsdp"]["gathered_parameters"] for r in resharded)
    sharded = [(a + b) / 2 for a, b in zip(kept[0]["losses"], kept[1]["losses"])]
    model, config = tiny_llama()
    autoplan.apply(model, autoplan.plan(model, "1GB", example_inputs=rank_batch(config, 0), device="cpu", reserve=0, precision="fp32",
                                        checkpoint={u["name"]: u["mode"] for u in kept[0]["plan"]["units"] if u["mode"] != "keep"},
                                        profile="roofline"))
    tokens, targets = (torch.cat(parts) for parts in zip(*[rank_batch(config, rank) for rank in (0, 1)]))
    assert sharded == pytest.approx(one_process_losses(model, lambda: model(tokens, targets)), rel=1e-4)


def test_reshard_after_forward_is_refused_where_it_means_nothing_or_is_not_modelled() -> None:
    model, config = tiny_llama()
    batch = rank_batch(config, 0)
    for value, said in ((2, "must be True, False or"), ("no", "must be True, False or"), ({"layers.*": 0}, "must be True, False or")):
        with pytest.raises(autoplan.errors.OptionError, match=said):
            autoplan.Planner(model, example_inputs=batch, device="cpu", world_size=2, reshard_after_forward=value)
    with pytest.raises(autoplan.errors.OptionError, match="world_size=1 nothing is sharded"):
        autoplan.Planner(model, example_inputs=batch, device="cpu", reshard_after_forward=False)
    with pytest.raises(autoplan.errors.UnitPatternError, match="matched no unit"):
        autoplan.plan(model, "1GB", example_inputs=batch, device="cpu", world_size=2, profile="roofline",
                      reshard_after_forward={"blocks.*": False})
    with pytest.raises(autoplan.errors.OptionError, match="more than once per forward"):
        autoplan.plan(shared_block(), "1GB", example_inputs=shared_batch(0), device="cpu", world_size=2, profile="roofline",
                      reshard_after_forward=False)


def test_the_command_line_keeps_units_gathered_only_with_a_world_size() -> None:
    from typer.testing import CliRunner

    from autoplan.cli.app import app

    args = ["plan", "examples/llama.py:build", "--budget", "12MB", "--device", "cpu", "--reserve", "0", "--batch-size", "2",
            "--seq-len", "32", "--no-reshard-after-forward"]
    alone = CliRunner().invoke(app, args)
    assert alone.exit_code == 2 and "world_size=1 nothing is sharded" in alone.output
    sharded = CliRunner().invoke(app, [*args, "--world-size", "2"], env={"COLUMNS": "200"})
    assert sharded.exit_code == 0, sharded.output
    assert "gathered parameters (root and every unit between its forward and backward)" in sharded.output


# -- FSDP2's MixedPrecisionPolicy: parameters gathered and computed in bf16, kept and reduced in fp32 ----------------


def bf16_compute_losses(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> list[float]:
    """One process computing as FSDP2's bf16 policy does: each step's forward on bf16 copies of the fp32 parameters
    (gradients flow back through the cast into fp32), each layer's floating inputs cast as its FSDP group casts them."""
    def cast(module, args, kwargs):
        to = lambda v: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
        return tuple(map(to, args)), {k: to(v) for k, v in kwargs.items()}

    for layer in model.layers:
        layer.register_forward_pre_hook(cast, with_kwargs=True)
    return one_process_losses(model, lambda: torch.func.functional_call(
        model, {name: p.to(torch.bfloat16) for name, p in model.named_parameters()}, (tokens, targets)))


@pytest.fixture(scope="module")
def bf16_two_ranks(tmp_path_factory):
    model, config = tiny_llama()
    free = autoplan.plan(model, "1GB", example_inputs=rank_batch(config, 0), device="cpu", reserve=0, world_size=2,
                         profile="roofline", fsdp_mixed_precision="bf16")
    budget = (free.prediction.minimum_peak_bytes + free.prediction.peak_bytes) // 2  # some unit must checkpoint
    return free, _run_workers(tmp_path_factory.mktemp("fsdp_bf16"), f"{budget}B", "llama-bf16")


@distributed
def test_a_bf16_mixed_precision_policy_is_planned_as_fsdp2_runs_it(bf16_two_ranks, two_ranks) -> None:
    free, ranks = bf16_two_ranks
    for rank in ranks:
        plan = rank["plan"]
        assert plan["fsdp_mixed_precision"] == "bf16" and plan["feasible"] and any(u["mode"] != "keep" for u in plan["units"])
    assert_counted_to_the_byte(ranks)
    # shards and optimizer state stay fp32 (as without the policy); what is gathered is half
    fp32 = two_ranks[0]["plan"]["fsdp"]
    assert (free.prediction.fsdp.parameters, free.prediction.fsdp.optimizer) == (fp32["parameters"], fp32["optimizer"])
    assert free.prediction.fsdp.gathered_parameters * 2 == pytest.approx(fp32["gathered_parameters"], rel=1e-3)
    model, config = tiny_llama()
    tokens, targets = (torch.cat(parts) for parts in zip(*[rank_batch(config, rank) for rank in (0, 1)]))
    sharded = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    assert sharded == pytest.approx(bf16_compute_losses(model, tokens, targets), rel=5e-3)  # bf16 sums in another order


@pytest.mark.slow  # the whole pipeline, five world sizes
def test_auto_finds_the_fewest_ranks_under_a_mixed_precision_policy_from_two() -> None:
    """world_size="auto" with FSDP2's MixedPrecisionPolicy: one GPU is no point of the search (nothing to shard), and
    the answer is the plan the explicit world size makes."""
    model, config = tiny_llama()
    batch = rank_batch(config, 0)
    options = dict(example_inputs=batch, device="cpu", reserve=0, profile="roofline", fsdp_mixed_precision="bf16")
    two, four = (autoplan.plan(model, "1GB", world_size=n, **options) for n in (2, 4))
    budget = (two.prediction.minimum_peak_bytes + four.prediction.minimum_peak_bytes) // 2  # 2 cannot, 4 can
    auto = autoplan.plan(model, budget, world_size="auto", **options)
    curve = {point.world_size: point for point in auto.prediction.world_size_curve}
    assert min(curve) == 2 and not curve[2].fits and curve[auto.request.world_size].fits and auto.request.world_size in (3, 4)
    explicit = autoplan.plan(model, budget, world_size=auto.request.world_size, **options)
    assert auto.prediction.peak_bytes == explicit.prediction.peak_bytes and auto.request.mesh.param_dtype == "bf16"
    assert [unit.choice for unit in auto.decisions.units] == [unit.choice for unit in explicit.decisions.units]
    assert autoplan.plan(model, "1GB", world_size="auto", **options).request.world_size == 2  # roomy: the fewest it can


def test_a_mixed_precision_policy_is_refused_where_fsdp_would_not_run_it() -> None:
    model, config = tiny_llama()
    batch = rank_batch(config, 0)
    for options, said in (({"world_size": 2, "fsdp_mixed_precision": "fp8"}, "must be \"bf16\" or \"fp16\""),
                          ({"fsdp_mixed_precision": "bf16"}, "with one GPU nothing is sharded"),
                          ({"world_size": 2, "fsdp_mixed_precision": "bf16", "precision": "bf16"}, "leave precision out")):
        with pytest.raises(autoplan.errors.OptionError, match=said):
            autoplan.Planner(model, example_inputs=batch, device="cpu", **options)
    with pytest.raises(autoplan.errors.OptionError, match="planned for fp32 parameters"):
        autoplan.plan(model.to(torch.bfloat16), "1GB", example_inputs=batch, device="cpu", world_size=2, profile="roofline",
                      fsdp_mixed_precision="bf16")


def test_the_command_line_plans_a_mixed_precision_policy_and_its_advice_says_so() -> None:
    from typer.testing import CliRunner

    from autoplan.cli.app import app

    args = ["plan", "examples/llama.py:build", "--budget", "12MB", "--device", "cpu", "--reserve", "0", "--batch-size", "2",
            "--seq-len", "32", "--world-size", "2"]
    plain = CliRunner().invoke(app, [*args, "--json", "-"], env={"COLUMNS": "200"})
    mixed = CliRunner().invoke(app, [*args, "--fsdp-mixed-precision", "bf16", "--json", "-"], env={"COLUMNS": "200"})
    assert plain.exit_code == 0 and mixed.exit_code == 0, mixed.output
    assert "computes in bf16 under FSDP2's MixedPrecisionPolicy" in mixed.output  # the advice's precision step
    document = json.loads(mixed.stdout[mixed.stdout.index("{"):])
    assert document["plan"]["fsdp_mixed_precision"] == "bf16" and document["plan"]["request"]["fsdp_mixed_precision"] == "bf16"
    assert document["plan"]["predicted_peak_bytes"] < json.loads(plain.stdout[plain.stdout.index("{"):])["plan"]["predicted_peak_bytes"]


# -- a transformers model: its outputs hold the logits, kept by the loop from one step into the next ---------


@pytest.fixture(scope="module")
def qwen2_two_ranks(tmp_path_factory):
    pytest.importorskip("transformers")
    return _run_workers(tmp_path_factory.mktemp("fsdp_qwen2"), "1GB", "qwen2")


@distributed
def test_a_transformers_model_under_fsdp_meets_its_prediction_and_trains_like_one_process(qwen2_two_ranks) -> None:
    for rank in qwen2_two_ranks:
        assert rank["plan"]["feasible"] and [unit["mode"] for unit in rank["plan"]["units"]] == ["full", "keep"]
    # the prediction to the byte: the plan's peak is the first layer's backward at its start, where FSDP2 copies the
    # layer's parameters out of its all-gather output (`memory.sharded`, `on_rank`). Before the count held the loop's
    # outputs of the last step it read 4% low: the logits it left out
    assert_counted_to_the_byte(qwen2_two_ranks)
    for rank in qwen2_two_ranks:
        assert sum(line[0] for line in rank["peak_blocks"]) == rank["peak_bytes"]
    # where the count peaks, by maker, on a rank whose count heard every free (one read high by gloo's late free
    # peaks elsewhere: in one full suite of 2026-11-29 a rank's peak moved to a forward's copy-out, "held at the mark");
    # on a loaded machine both ranks can read high (a suite run with -n 2), and the bounds above are the check
    exact = next((rank for rank in qwen2_two_ranks if rank["floor_bytes"] == rank["peak_bytes"]), None)
    if exact is not None:
        makers = " | ".join(line[3] for line in exact["peak_blocks"])  # the blocks alive at the counted peak, by maker
        assert "FSDP::post_backward_reduce (model.layers.1)" in makers and "FSDP::pre_backward (model.layers.0)" in makers
    model = tiny_qwen2()
    batch = {key: torch.cat([qwen2_batch(rank)[key] for rank in (0, 1)]) for key in ("input_ids", "labels")}
    reference = one_process_losses(model, lambda: model(**batch).loss)
    sharded = [(a + b) / 2 for a, b in zip(qwen2_two_ranks[0]["losses"], qwen2_two_ranks[1]["losses"])]
    assert sharded == pytest.approx(reference, rel=1e-4)

