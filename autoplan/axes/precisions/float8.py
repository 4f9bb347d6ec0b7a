"""float8 and float8-rowwise: torchao's float8 training for a unit's linears, the rest of the unit in bf16 autocast.

Each of a float8 unit's `torch.nn.Linear`s whose features divide by 16 (what the float8 matmul takes) runs as
torchao's `Float8Linear` with the same parameters (`Float8Forward`: set when a plan is applied, or while the unit runs
where it is only measured): input, weight and gradient cast to float8 with dynamic scales, one per tensor (`float8`,
torchao's "tensorwise" recipe) or one per row (`float8-rowwise`), as `convert_to_float8_training` with a filter
naming these linears would run them. Nothing else changes: the parameters stay as they are (fp32), and the unit's
other ops run under bf16 autocast, as float8 is run in practice (torchtitan's float8 runs beside bf16 parameters): a
float8 unit is a bf16 unit whose linears are float8.

Cards with float8 tensor cores run it (H100, H200, GH200, L40S, RTX 4090, L4: the device table's "float8" rate); the
CPU runs torchao's float8 matmul too (slowly, upcast inside `_scaled_mm`), which is how a plan's float8 units are
checked against the CPU allocator's count of the real step. torchao is an optional extra (`pip install -e ".[float8]"`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from autoplan.axes import DeviceLike

if TYPE_CHECKING:
    import torch

FLOAT8_ON_A_GPU = ("float8 units: simulated with torchao's float8 linears on CPU tensors standing in for the card's, priced at "
                   "its float8 rate; checked to the byte against the CPU's real step, not yet against a GPU's (docs/float8.md)")
FLOAT8_MULTIPLE = 16  # the float8 matmul's operands: both dimensions of the weight divide by 16


@dataclass(frozen=True)
class Float8:
    """torchao's float8 training of a unit's linears, in one of its recipes ("tensorwise", "rowwise")."""

    name: str
    recipe: str
    order: int
    words: str
    dtype_name: str = "float8_e4m3fn"
    other_dtype_names: tuple[str, ...] = ("float8_e5m2",)  # the gradients' float8 (`axes.precision.flops_for`)
    rewriting: int = 2  # the unit's linears swapped while it runs: more than an autocast
    auto_preference: int | None = None  # "auto" never picks it: float8 is asked for ("auto-float8", or "float8")
    grad_scaler: bool = False  # dynamic scales per cast: no loss scaling
    around_the_model: bool = False  # the units' linears only: the loss head stays as written, as torchao's users keep it

    def unsupported(self, device: DeviceLike) -> str:
        if not _has_torchao():
            return ("float8 training runs torchao's float8 linears, and torchao is not installed (pip install torchao, or "
                    "autoplan's float8 extra)")
        if device.kind == "cpu" or "float8" in device.peak_flops:
            return ""
        return f"{device.name} has no float8 tensor cores (H100, H200, GH200, L40S, RTX 4090 and L4 have)"

    def running(self, module: torch.nn.Module, device_type: str) -> contextlib.AbstractContextManager:
        return _float8_linears(module, device_type, self.recipe)

    def prepare(self, module: torch.nn.Module) -> None:
        """A plan applied: the unit's float8 linears run as `Float8Forward` for good (`running` then swaps none)."""
        prepare(module, self.recipe)

    def flops(self, device: DeviceLike, allow_tf32: bool) -> float:
        # the CPU (and a card without a datasheet float8 rate) upcasts inside the kernel: the fp32 rate
        return device.peak_flops.get("float8", device.peak_flops["fp32"])


def _has_torchao() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchao") is not None


def float8_linears(module: torch.nn.Module) -> list[torch.nn.Linear]:
    """The linears of `module` float8 runs: plain `torch.nn.Linear`s (not a library's subclass: a quantized or
    adapter layer) whose in and out features divide by FLOAT8_MULTIPLE."""
    import torch

    return [inner for inner in module.modules() if type(inner) is torch.nn.Linear
            and inner.in_features % FLOAT8_MULTIPLE == 0 and inner.out_features % FLOAT8_MULTIPLE == 0]


def is_float8(precision: str) -> bool:
    """Whether the precision called `precision` is one of float8's recipes (the one question the other stages ask)."""
    from autoplan.axes.precision import kind

    return isinstance(kind(precision), Float8)


def check_some_run_in_float8(units: dict[str, torch.nn.Module], setting: str) -> None:
    """An OptionError when no unit holds a linear float8 runs: the plan would call bf16 units float8."""
    if not any(float8_linears(module) for module in units.values()):
        from autoplan.errors import OptionError

        names = ", ".join(list(units)[:3]) + (", ..." if len(units) > 3 else "")
        raise OptionError(f"precision={setting!r}: none of the units ({names}) holds a torch.nn.Linear whose features divide "
                          f"by {FLOAT8_MULTIPLE}, the layers torchao's float8 training runs (transformers' GPT-2 Conv1D and "
                          "quantized or adapter layers are not); plan with 'bf16' or 'auto'")


def check_one_device(setting: str, ranks: int | str, tensor_parallel: int | str) -> None:
    """float8 per unit is planned for one device: under FSDP2 its linears would be made again at every forward (FSDP
    swaps the gathered parameters in), and under tensor parallelism torchao's float8 needs parallel styles of its own."""
    from autoplan.axes.precision import AUTO, AUTO_FLOAT8

    may_be_float8 = setting == AUTO_FLOAT8 or (setting != AUTO and is_float8(setting))
    if may_be_float8 and (ranks != 1 or tensor_parallel != 1):
        from autoplan.errors import OptionError

        raise OptionError(f"precision={setting!r} is planned for one device: float8 per unit under FSDP or tensor "
                          "parallelism (world_size, tensor_parallel) is not planned yet; plan the mesh in bf16 ('auto')")


def check_converted(model: torch.nn.Module, target_kind: str, target_name: str, precision: str) -> None:
    """A model already converted by torchao (`convert_to_float8_training`) is planned as it was checked: on the CPU,
    with no autocast on top. Its simulation (the tracker follows torchao's Float8TrainingTensor inside,
    `instruments.tracker.SEEN_INSIDE`) equals the CPU allocator's count of the real step; for a GPU, or with autocast,
    plan the model as written with a float8 precision, which converts the units' linears itself."""
    from autoplan.errors import OptionError
    from autoplan.instruments.tracker import SEEN_INSIDE

    layers = [name for name, module in model.named_modules() if type(module).__module__.startswith(SEEN_INSIDE)]
    if not layers:
        return
    has = f"{type(model).__name__} has {len(layers)} torchao float8 layers (e.g. {layers[0]})"
    instead = "or plan the model before convert_to_float8_training with precision='float8' or 'auto-float8' (docs/float8.md)"
    if target_kind != "cpu":
        raise OptionError(f"{has}; a converted model is planned for the CPU only, not for {target_name}, {instead}")
    if precision != "fp32":
        raise OptionError(f"{has}: plan it with precision='fp32' (--precision fp32), not {precision!r}: its linears compute "
                          f"in float8 either way, and an autocast over them is not simulated; {instead}")


class Float8Forward:
    """A linear's forward as torchao's `Float8Linear` on the linear's own parameters, its input cast to bf16 (torchao
    casts to CUDA's autocast dtype itself, and not under the CPU's autocast: cast here, the CPU and a GPU run the same).

    Set on a float8 unit's linears for good when a plan is applied (`Float8.prepare`: made eagerly, so that
    torch.compile traces a made module, not its making, which breaks the graph), or while the unit runs (`running`: the
    profile's measurements). `original` is the forward it replaced (`planned.forwards.remove_plan` puts it back)."""

    def __init__(self, linear: torch.nn.Linear, recipe: str, original: object = None) -> None:
        self.linear, self.recipe, self.original = linear, recipe, original
        self.float8 = _float8_twin(linear, recipe)

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        import torch

        if self.float8.weight is not self.linear.weight or self.float8.bias is not self.linear.bias:
            self.float8 = _float8_twin(self.linear, self.recipe)  # FSDP (or a load) replaced the parameters since
        return self.float8(input.to(torch.bfloat16) if input.is_floating_point() else input)


def _float8_twin(linear: torch.nn.Linear, recipe: str) -> torch.nn.Module:
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear.from_float(linear, config=Float8LinearConfig.from_recipe_name(recipe))


def prepare(module: torch.nn.Module, recipe: str) -> None:
    """Set `Float8Forward` on `module`'s float8 linears for good (a plan applied)."""
    for linear in float8_linears(module):
        if not isinstance(linear.__dict__.get("forward"), Float8Forward):
            linear.forward = Float8Forward(linear, recipe, linear.__dict__.get("forward"))  # type: ignore[method-assign]


@contextlib.contextmanager
def _float8_linears(module: torch.nn.Module, device_type: str, recipe: str) -> Iterator[None]:
    import torch

    # those a plan has not prepared, swapped while the unit runs
    swapped = [linear for linear in float8_linears(module) if not isinstance(linear.__dict__.get("forward"), Float8Forward)]
    prepare(module, recipe)
    try:
        # the weight cache would keep bf16 weight copies alive until the outermost autocast exits (as `Autocast`)
        with torch.autocast(device_type, dtype=torch.bfloat16, cache_enabled=False):
            yield
    finally:
        for linear in swapped:
            before = linear.__dict__["forward"].original
            if before is None:
                del linear.forward
            else:
                linear.forward = before  # type: ignore[method-assign]


KIND = Float8(name="float8", recipe="tensorwise", order=3, words="float8 linears (torchao, one scale a tensor)")
