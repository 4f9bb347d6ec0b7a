"""bf16: bfloat16 autocast, fp32's range in half the bytes; cards from Ampere (compute capability 8.0) on, and the CPU."""

from autoplan.axes import DeviceLike
from autoplan.axes.precisions import Autocast


def _missing(device: DeviceLike) -> str:
    # a datasheet that rates bf16 is a card that has it (`inputs.devices`: none before Ampere)
    return "" if "bf16" in device.peak_flops else f"{device.name} has no bf16"


KIND = Autocast(name="bf16", dtype_name="bfloat16", order=1, auto_preference=0, grad_scaler=False, words="bf16 autocast",
                missing=_missing)
