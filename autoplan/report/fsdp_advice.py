"""The advice's FSDP step: the fewest GPUs whose per-GPU peak fits, or what the plan for N GPUs is."""

from __future__ import annotations

from autoplan.memory.model import sharded_peak
from autoplan.mesh import Mesh
from autoplan.plan import Choice, Plan, ShardedPeak
from autoplan.profile.profiler import Profile
from autoplan.report.batch_steps import Step
from autoplan.solve.worlds import fewest_ranks
from autoplan.vocabulary.formatting import format_bytes, rank_noun


def smallest_world_size(profile: Profile, choices, usable_bytes: int) -> ShardedPeak | None:
    """The per-GPU FSDP estimate on the fewest GPUs where it fits `usable_bytes` with `choices`, or None."""
    found = fewest_ranks(lambda n: sharded_peak(profile, choices, Mesh.fsdp(n)).total, usable_bytes)
    return sharded_peak(profile, choices, Mesh.fsdp(found.world_size)) if found.fits else None


def _least(plan: Plan, choices: dict[str, Choice]) -> str:
    if choices == plan.decisions.choices():
        return "with the plan's choices"
    modes = sorted({str(c) for c in choices.values()})
    return f"with every unit at the choice that keeps least ({', '.join(modes)}); more {rank_noun(plan.target.device, 2)} leave room to recompute less"


def fsdp_step(plan: Plan, profile: Profile, found: ShardedPeak | None, choices: dict[str, Choice]) -> Step:
    title = "FSDP (shard parameters, gradients, optimizer state)"
    if plan.request.world_size > 1:  # asked for: the plan is FSDP's already, whatever one GPU would do
        fits = "fits" if plan.outcome.feasible else "does not fit"
        one = f"; one {rank_noun(plan.target.device)} would fit too" if found is not None and found.world_size == 1 else ""
        return Step("fsdp", title, "chosen", f"planned for {plan.request.world_size} × {plan.target.device} under {plan.request.mesh.split_words if plan.request.mesh.tensor_parallel > 1 else 'FSDP2'}: per {rank_noun(plan.target.device)} "
                    f"{format_bytes(plan.prediction.peak_bytes)}, {fits} {format_bytes(plan.request.usable_bytes)} usable{one}")
    if found is None:
        limit = min((sharded_peak(profile, choices, Mesh.fsdp(2**k)) for k in range(13)), key=lambda peak: peak.total)
        return Step("fsdp", title, "n/a", f"sharding alone cannot fit: the unsharded part (gathered parameters "
                    f"{format_bytes(limit.gathered_parameters)}, activations {format_bytes(limit.activations)}) stays over "
                    f"{format_bytes(plan.request.usable_bytes)}; lower the batch or sequence first")
    if found.world_size == 1:
        return Step("fsdp", title, "n/a", f"not needed: the plan fits one {rank_noun(plan.target.device)}")
    n = found.world_size
    detail = (f"{n} × {plan.target.device}: per {rank_noun(plan.target.device)} {format_bytes(found.total)} ≤ {format_bytes(plan.request.usable_bytes)} usable = "
              f"1/{n} of parameters {format_bytes(found.parameters)} + gradients {format_bytes(found.gradients)} + optimizer "
              f"{format_bytes(found.optimizer)} + gathered parameters of the root, the running and the prefetched unit "
              f"{format_bytes(found.gathered_parameters)} + all-gather/reduce-scatter buffers {format_bytes(found.communication_buffers)} "
              f"+ activations {format_bytes(found.activations)} (at {found.phase}); on {n - 1} the estimate is "
              f"{format_bytes(sharded_peak(profile, choices, Mesh.fsdp(n - 1)).total)}; {_least(plan, choices)}. Estimate: the all-gathers and "
              f"reduce-scatter move about {format_bytes(3 * profile.timeline.static.parameters * (n - 1) // n)} per {rank_noun(plan.target.device)} per "
              "step, not in the step time")
    code = (f"# in every rank of torchrun --nproc_per_node={n}, after torch.distributed.init_process_group()\n"
            f"model = autoplan.optimize(model, budget, example_inputs=batch, world_size={n})  # or world_size=\"auto\"")
    return Step("fsdp", title, "try", detail, plan.prediction.peak_bytes - found.total, None, code)


def tensor_parallel_step(plan: Plan, found: ShardedPeak | None) -> Step:
    """The rung after FSDP: split the blocks' linears (and the activations between them) over N ranks. Its per-rank peak
    is planned, not estimated here: a slice of the model is a model of its own (docs/parallel.md)."""
    title, noun = "tensor parallel (split the attention and MLP linears)", rank_noun(plan.target.device)
    mesh = plan.request.mesh
    if mesh.tensor_parallel > 1:
        fits = "fits" if plan.outcome.feasible else "does not fit"
        split_more = ("" if plan.outcome.feasible or mesh.sequence_parallel else "; sequence_parallel=True (--sequence-parallel) "
                      "splits the norms' and the residual stream's activations too (torchtitan's and transformers' Llama layouts)")
        return Step("tensor-parallel", title, "chosen", f"planned for {plan.request.world_size} × {plan.target.device} under "
                    f"{mesh.split_words}: per {noun} {format_bytes(plan.prediction.peak_bytes)}, {fits} "
                    f"{format_bytes(plan.request.usable_bytes)} usable{split_more}")
    if plan.outcome.feasible:
        return Step("tensor-parallel", title, "n/a", f"not needed: the plan fits {plan.request.world_size} {rank_noun(plan.target.device, plan.request.world_size)}")
    if found is not None:
        return Step("tensor-parallel", title, "n/a", f"FSDP alone fits on {found.world_size} (above), with no all-reduce in every "
                    "block; world_size=\"auto\" tries tensor parallelism too and keeps it only where it needs fewer GPUs")
    code = ("# every rank of torchrun; world_size counts every GPU, FSDP's ranks × tensor_parallel\n"
            "model = autoplan.optimize(model, budget, example_inputs=batch, world_size=\"auto\")  # or tensor_parallel=8, world_size=N")
    return Step("tensor-parallel", title, "try", "FSDP alone leaves each rank its whole activations and gathered blocks: tensor "
                f"parallelism splits the blocks' linears and the activations between them over up to 8 {rank_noun(plan.target.device, 2)} "
                "of a node; its per-rank peak is not estimated here: plan it (world_size=\"auto\" searches degrees 2, 4 and 8 "
                "beside FSDP alone)", None, None, code)
