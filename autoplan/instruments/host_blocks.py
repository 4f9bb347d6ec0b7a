"""Which CPU allocator blocks a GPU step would not hold: the rule the allocator's count and the CPU scratch share.

Read off torch.profiler's event tree (an allocation's parents are the records it was made inside). On a CPU the
allocator makes blocks that, the same step running on CUDA, are no device memory at all: a Python number the bindings
wrap into a 0-dim tensor, the CPU random generator's state `torch.utils.checkpoint` keeps, a scalar an operator's
CPU kernel converts to its other operand's dtype. `verify.allocator.AllocatorCount` leaves them out of its count and
`instruments.cpu_scratch` out of a kernel's scratch, by this one rule, so the simulation and the count agree block
for block; a small tensor an operator makes inside a kernel (the product of two scales inside `_scaled_mm`) counts in both.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Iterator

import torch
from torch._C._profiler import RecordScope

HOST_SCALAR_BYTES = 16  # a complex128 scalar: the largest a Python number wraps into


def records_around(node) -> Iterator[Any]:
    """The profiler records around an allocation (or a record), innermost first."""
    node = node.parent
    while node is not None:
        yield node
        node = node.parent


def enclosing_calls(node) -> list:
    """The calls around a block, innermost first, that the profiler records as functions: operators, autograd
    nodes, Python autograd Functions."""
    return [record for record in records_around(node) if getattr(record.extra_fields, "scope", None) in _OPERATOR_SCOPES]


def is_operator(node) -> bool:
    """A registered operator (`aten::mul`, `bitsandbytes::dequantize_4bit`), not an autograd node or engine frame."""
    return _OPERATOR_NAME.match(node.name) is not None and not node.name.startswith(_AUTOGRAD)


def host_only(allocation) -> bool:
    """A block that a GPU's allocator would never hold, as the step runs on CUDA:

    - a random generator's state that `torch.utils.checkpoint` keeps to replay dropout (`torch.get_rng_state()`,
      made outside every operator): a CPU tensor on CUDA too, beside the CUDA generator's own state;
    - a Python number the bindings wrap into a 0-dim CPU tensor before any operator runs (`x * 2.0`, saved for
      backward by `MulBackward0`), or in a kernel written in Python (bitsandbytes' CPU optimizers): a wrapped
      number is a CPU tensor on CUDA too, and ATen makes a tensor of one scalar only inside its own operators;
    - that scalar converted to the other operand's dtype inside an operator's CPU kernel (`aten::mul` calling
      `aten::to`): CUDA kernels take a CPU scalar as an argument and make no such tensor.
    """
    size = allocation.extra_fields.alloc_size
    if size > HOST_SCALAR_BYTES and size != _cpu_rng_state_bytes():
        return False
    makers = enclosing_calls(allocation)
    if not makers or not is_operator(makers[0]):  # made by Python code: a binding, or checkpoint saving the RNG state
        return True
    if size > HOST_SCALAR_BYTES:
        return False
    if not allocation.parent.name.startswith("aten::"):
        return True  # a number wrapped by Python code that runs inside an operator (a kernel written in Python)
    outside_conversion = [call for call in makers if call.name not in _CONVERSIONS + _ALLOCATIONS]
    converted = any(call.name in _CONVERSIONS for call in makers)
    return converted and bool(outside_conversion) and is_operator(outside_conversion[0])


def cpu_allocations(roots, marks: str | None = None) -> list:
    """The CPU allocator's allocations and frees in a profile's event tree (`experimental_event_tree()`), oldest first;
    with `marks`, the records whose names start so among them (`verify.allocator`'s marks between stretches)."""
    found, pending = [], list(roots)
    while pending:
        node = pending.pop()
        pending.extend(node.children)
        fields = node.extra_fields
        if (marks is not None and node.name.startswith(marks)) or (hasattr(fields, "alloc_size") and fields.device.type == "cpu"):
            found.append(node)
    return sorted(found, key=lambda node: (node.start_time_ns, node.id))


@functools.cache
def _cpu_rng_state_bytes() -> int:
    return torch.get_rng_state().nbytes


_OPERATOR_SCOPES = (RecordScope.FUNCTION, RecordScope.BACKWARD_FUNCTION)
_CONVERSIONS = ("aten::to", "aten::_to_copy")
_ALLOCATIONS = ("aten::empty_strided", "aten::empty", "aten::empty_like")
_OPERATOR_NAME = re.compile(r"^\w+::\w")
_AUTOGRAD = ("autograd::", "torch::autograd::")
