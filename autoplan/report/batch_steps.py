"""One step of the advice (`Step`) and the advice they make up (`Advice`), and the steps that change the batch: gradient accumulation and
shorter sequences, each estimated from this model's profile and the memory model; and the T×T attention
bytes a plan holds, which the fused-attention and shorter-sequence steps both read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from autoplan.inputs.loop import TrainingLoop
from autoplan.memory.model import PhaseBytes, unit_windows
from autoplan.plan import Choice, Plan, ShardedPeak
from autoplan.profile.profiler import Profile
from autoplan.vocabulary.formatting import format_bytes, format_seconds


@dataclass(frozen=True)
class Step:
    """One piece of advice."""

    key: str  # stable identifier: bf16/fp16, tf32, sdpa, compile, checkpointing, grad_accumulation, ...
    title: str
    status: str  # "chosen" (the plan already does it), "try" (would help), "n/a" (does not apply here)
    detail: str  # what it does for this model, with the numbers, or why it does not apply
    saves_bytes: int | None = None  # estimated drop of the peak (negative: it costs memory); None: not predicted
    time_change_s: float | None = None  # estimated change of the step time (positive: slower); None: not predicted
    code: str = ""  # how to do it



@dataclass(frozen=True)
class Advice:
    """Everything `report.advice.advise` found, in the order a person should try it."""

    fits: bool
    peak_bytes: int  # the plan's predicted peak (the lowest reachable one when it does not fit)
    usable_bytes: int
    steps: tuple[Step, ...]
    first_fix: str | None  # key of the first "try" step whose estimate alone fits the budget
    fsdp: ShardedPeak | None  # per-GPU estimate on the smallest GPU count that fits, if any
    requested: ShardedPeak | None  # per-GPU estimate for the world size the person asked about
    ladder: Any = None  # report.ladder.Ladder when the toolbox ladder was planned (--ladder), else None

    @property
    def over_bytes(self) -> int:
        return max(0, self.peak_bytes - self.usable_bytes)

    def step(self, key: str) -> Step:
        return next(s for s in self.steps if s.key == key)

    def to_dict(self) -> dict[str, Any]:
        def sharded(peak: ShardedPeak | None):
            return None if peak is None else dataclasses.asdict(peak) | {"total": peak.total}

        return {
            "fits": self.fits,
            "peak_bytes": self.peak_bytes,
            "usable_bytes": self.usable_bytes,
            "over_bytes": self.over_bytes,
            "first_fix": self.first_fix,
            "steps": [dataclasses.asdict(step) for step in self.steps],
            "fsdp": sharded(self.fsdp),
            "requested_world_size": sharded(self.requested),
            "ladder": None if self.ladder is None else self.ladder.to_dict(),
        }


ACTIVATION_SIDE = ("bf16", "fp16", "tf32", "sdpa", "float8", "compile", "checkpointing", "offload")  # what changes activations or speed


def scaled_peak(phases: list[PhaseBytes], scale: Callable[[int, PhaseBytes], float]) -> int:
    """Peak if each phase's batch-dependent bytes were scaled; optimizer.step() does not scale."""
    return max(p.static_bytes + (p.activation_bytes if p.kind == "step" else int(scale(i, p))) for i, p in enumerate(phases))



def optimizer_time(profile: Profile) -> float:
    return sum(phase.time_s for phase in profile.timeline.phases if phase.kind == "step")



def accumulation_peak(profile: Profile, phases: list[PhaseBytes], fraction: float, loop: TrainingLoop) -> int:
    """Peak of a micro-batch `fraction` of the batch in `loop`: activations scale linearly, and when the
    loop accumulates every gradient is alive through forward and backward; optimizer.step() does not scale."""
    peak = 0
    for sample, phase in zip(profile.timeline.phases, phases):
        if phase.kind == "step":
            peak = max(peak, phase.live_bytes)
            continue
        missing_grads = profile.timeline.static.gradients - sample.grad_bytes if loop.gradients_alive_in_forward else 0
        peak = max(peak, phase.static_bytes + missing_grads + int(phase.activation_bytes * fraction))
    return peak



def accumulation_code(loop: TrainingLoop, micro: int, steps: int, inputs: tuple[tuple[str, str], ...] = ()) -> str:
    """The loop the advice is for, as code: the planned loop with the batch split into `steps` micro-batches.

    `inputs`: the batch's tensors by where they were passed (`Fingerprint.batch`): keywords are a dict
    batch (`model(**batch)`), split key by key; several positional tensors are split together.
    """
    names = [name for name, _ in inputs]
    positional = {name.split("[")[0] for name in names if name.startswith("argument ")}
    counted = f"  # {steps} micro-batches of {micro}"
    if (names and not positional) or (positional == {"argument 0"} and all("[" in name for name in names)):
        call = "model(**micro)" if not positional else "model(micro)"  # a dict, as keywords or as the one argument
        loop_head = (f"for start in range(0, {micro * steps}, {micro}):{counted}\n"
                     f"    micro = {{name: value[start:start + {micro}] for name, value in batch.items()}}")
    elif len(positional) > 1:
        call, loop_head = "model(*micro)", f"for micro in zip(*(part.split({micro}) for part in batch)):{counted}"
    else:
        call, loop_head = "model(micro)", f"for micro in batch.split({micro}):{counted}"
    backward = (f"    outputs = {call}\n    (outputs.loss / {steps}).backward()" if loop.keep_outputs
                else f"    ({call}.loss / {steps}).backward()")
    return f"{loop_head}\n{backward}\noptimizer.step(); optimizer.zero_grad(set_to_none={loop.zero_grad_set_to_none})"



def grad_accumulation_step(plan: Plan, profile: Profile, phases, batch_size, replan) -> Step:
    title, key = "gradient accumulation", "grad_accumulation"
    if plan.outcome.feasible:
        return Step(key, title, "n/a", f"not needed: batch {batch_size or '(as given)'} fits")
    if not batch_size or batch_size < 2:
        return Step(key, title, "n/a", "batch size unknown or 1: pass --batch-size to a factory that takes batch_size")
    divisors = [b for b in range(batch_size - 1, 0, -1) if batch_size % b == 0]
    loops = {b: profile.loop.accumulating(batch_size // b) for b in divisors}
    estimate = {b: accumulation_peak(profile, phases, b / batch_size, loops[b]) for b in divisors}
    fitting = [b for b in divisors if estimate[b] <= plan.request.usable_bytes]
    if not fitting:
        return Step(key, title, "n/a", f"even a micro-batch of 1 would peak at about {format_bytes(estimate[1])} "
                    f"(activations scaled linearly, gradients alive between micro-batches): parameters, gradients and "
                    "optimizer state alone do not fit")
    micro, how = fitting[0], "estimated: activations scale linearly with the batch, gradients stay alive between micro-batches"
    peak, micro_time = estimate[micro], None
    for candidate in fitting[:2] if replan else []:
        checked = replan(candidate, loops[candidate])
        micro, peak, micro_time = candidate, checked.prediction.peak_bytes, checked.prediction.step_time_s
        how = f"verified by planning batch {candidate} again in that loop: {'fits' if checked.feasible else 'does not fit'}"
        if checked.feasible:
            break
    steps = batch_size // micro
    optimizer_s = optimizer_time(profile)
    if micro_time is None:
        micro_time = (plan.prediction.step_time_s - optimizer_s) * micro / batch_size + optimizer_s
    global_time = steps * (micro_time - optimizer_s) + optimizer_s
    detail = (f"micro-batch {micro} × {steps} accumulation steps keeps the global batch of {batch_size}; peak about "
              f"{format_bytes(peak)} ({how}); {format_seconds(global_time)} per global batch vs {format_seconds(plan.prediction.step_time_s)}")
    return Step(key, title, "try", detail, plan.prediction.peak_bytes - peak, global_time - plan.prediction.step_time_s,
                accumulation_code(profile.loop, micro, steps, plan.model.fingerprint.batch if plan.model.fingerprint else ()))



def shorter_sequences_step(plan: Plan, profile: Profile, phases, seq_len, choices) -> Step:
    title, key = "shorter sequences", "shorter_sequences"
    if not seq_len:
        return Step(key, title, "n/a", "sequence length unknown: pass --seq-len (to hf: targets or a factory taking seq_len)")
    if plan.outcome.feasible:
        return Step(key, title, "n/a", f"not needed: sequences of {seq_len} fit")
    optimizer_s = optimizer_time(profile)
    for shorter in (seq_len // 2, seq_len // 4, seq_len // 8):
        if shorter < 1:
            break
        r = shorter / seq_len
        # Activations scale with T, the T×T attention matrices with T².
        peak = scaled_peak(phases, lambda i, p: (p.activation_bytes - (a := held_attention(profile, choices, i))) * r + a * r * r)
        if peak <= plan.request.usable_bytes:
            step_time = (plan.prediction.step_time_s - optimizer_s) * r + optimizer_s
            detail = (f"sequences of {shorter} instead of {seq_len}: peak about {format_bytes(peak)} (activations ∝ T, "
                      f"attention matrices ∝ T²); {format_seconds(step_time)} per step for {r:.0%} of the tokens; the model sees less context")
            return Step(key, title, "try", detail, plan.prediction.peak_bytes - peak, step_time - plan.prediction.step_time_s)
    return Step(key, title, "n/a", f"even sequences of {max(1, seq_len // 8)} would not fit: the peak is not in the activations")


def held_attention(profile: Profile, choices: dict[str, Choice], phase_index: int) -> int:
    """Bytes of T×T attention matrices that keep-mode units hold at a phase of the step."""
    total = 0
    for unit, (forward, backward) in zip(profile.units, unit_windows(profile)):
        choice = choices.get(unit.name)  # None inside a segment: it keeps nothing of its own until recomputed
        if choice is not None and choice.mode == "keep" and forward < phase_index <= backward:
            total += unit.options[choice].attention_bytes
    return total
