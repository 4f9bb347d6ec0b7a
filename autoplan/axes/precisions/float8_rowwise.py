"""float8-rowwise: torchao's float8 training of a unit's linears with one scale a row (its "rowwise" recipe): closer
to bf16's accuracy than one scale a tensor, at the cost of more casts. See `axes.precisions.float8`."""

from autoplan.axes.precisions.float8 import Float8

KIND = Float8(name="float8-rowwise", recipe="rowwise", order=4, words="float8 linears (torchao, one scale a row)")
