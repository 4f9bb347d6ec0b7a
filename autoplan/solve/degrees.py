"""tensor_parallel="auto" (with world_size="auto"): the degree that needs the fewest GPUs in all, and what each needed.

Each degree is a model of its own (one rank's slice, `inputs.tensor_parallel`), whose fewest GPUs come from the
world-size search on its profile (`solve.worlds.fewest_gpus`: solves, no simulation); only the chosen degree is then
planned in full. The answer is the degree that fits on the fewest GPUs in all, the smaller degree on a tie (fewer
collectives in every block: tensor parallelism's all-reduces are on the critical path, FSDP's gathers are
prefetched). A degree that cannot need fewer GPUs than one already found (it needs at least its own number) is not
searched.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DegreeFit:
    """What one tensor-parallel degree needs under world_size="auto" (`tensor_parallel="auto"`)."""

    degree: int
    world_size: int = 0  # the fewest GPUs in all that fit, or the most tried when none does; 0: not searched
    fits: bool = False
    split_words: str = ""  # the mesh found, as the report says it ("5 FSDP × 4 tensor parallel")
    failed: str = ""  # its slice would not run (the error's first line); not searched again


def can_beat(degree: int, found: list[DegreeFit]) -> bool:
    """Whether `degree` could fit on fewer GPUs than the fewest a degree of `found` fits on."""
    fewest = min((fit.world_size for fit in found if fit.fits), default=None)
    return fewest is None or degree < fewest


def chosen_degree(found: list[DegreeFit]) -> DegreeFit:
    """The fitting degree on the fewest GPUs (the smaller degree on a tie), else the first (FSDP alone)."""
    fitting = [fit for fit in found if fit.fits]
    return min(fitting, key=lambda fit: (fit.world_size, fit.degree)) if fitting else found[0]


def degrees_note(found: list[DegreeFit], chosen: DegreeFit) -> str | None:
    """What every degree needed, where more than one was searched or one would not run; None otherwise."""
    searched = [fit for fit in found if fit.world_size]
    if len(searched) == 1 and (chosen.fits or not any(fit.failed for fit in found)):
        return None  # the first fits and no other could need fewer GPUs
    words = []
    for fit in found:
        name = "FSDP alone" if fit.degree == 1 else f"tensor parallel {fit.degree}"
        if fit.failed:
            words.append(f"{name}: its slice does not run ({fit.failed.split(', at ')[0]})")
        elif not fit.world_size:
            words.append(f"{name}: not searched (it cannot need fewer)")
        elif fit.fits:
            words.append(f"{name}: {fit.world_size}" + (f" ({fit.split_words})" if fit.degree > 1 else ""))
        else:
            words.append(f"{name}: does not fit on {fit.world_size}")
    chosen_name = "FSDP alone" if chosen.degree == 1 else f"tensor parallel {chosen.degree}"
    return (f"world_size=\"auto\" searched tensor parallelism too: the fewest GPUs that fit per tensor-parallel degree: "
            f"{'; '.join(words)}; chosen: {chosen_name} (tensor_parallel=1: FSDP alone; tensor_parallel=N: that degree)")
