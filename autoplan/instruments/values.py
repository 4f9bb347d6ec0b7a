"""Real values riding along fake tensors, where the example batch gives them.

Fake tensors have shapes and no values, so a forward that reads a value fails under them: a
vision-language model's image grid (`grid_thw.tolist()`, `torch.repeat_interleave(..., grid)`), a
CTC head's label check (`if labels.max() >= vocab_size`), a padding mask turned into indices
(`hidden[~mask] = 0`), LayerDrop's `torch.rand([]) < p`. Most such values come from the batch,
which autoplan has for real. `KnownValues` keeps, next to each fake tensor computed from values
only, its real value:

- every tensor of the real example batch of at most `VALUE_LIMIT` elements starts with its value
  (named by where it is passed: "image_grid_thw", "argument 0");
- an op whose fake tensor arguments all have values runs on the values too (after the fake op, and
  only when its outputs are small), so its outputs have values;
- ops fake tensors cannot answer (`.item()`, `.tolist()`, `nonzero`, `repeat_interleave`, a boolean
  mask as an index) are answered from the values: the exact shapes and scalars the real step sees;
- a random draw of a few elements (`torch.rand([])`) gets a value chosen by the `draws` policy:
  "high" (just below the top of its range, so `rand < p` is false: LayerDrop keeps every layer) or
  "low" (the bottom of its range). The trace stage picks the policy under which the most units
  run, the worst case (`trace.tracer`).

- an integer buffer of the model (a counter: BatchNorm's `num_batches_tracked`, which its cumulative
  average, `momentum=None`, reads every forward; a buffer of position ids) starts with its value, as
  the real step reads it (`instruments.fake.fake_copy`); its reads are not the batch's.

Values computed from the model's weights are never known (the weights are fakes), so a decision
on activations still fails with fake tensors' own error. What was read is recorded (`reads`,
`random_reads`): the plan then says it holds for batches with these values.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from typing import Any, Callable, Iterator

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensor, unset_fake_temporarily
from torch.utils._mode_utils import no_dispatch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from autoplan.vocabulary.tensors import tensors_of

VALUE_LIMIT = 1 << 20  # elements: a tensor larger than this keeps no value (T×T masks, images)
RANDOM = "a random draw"  # the source of values the draws policy chose
BUFFERS = "the model's buffers"  # the source of an integer buffer's value (a counter), read as the real step reads it
DRAWS = ("high", "low")

_RANDOM_OPS = {
    torch.ops.aten.rand.default: (0.0, 1.0),
    torch.ops.aten.rand_like.default: (0.0, 1.0),
    torch.ops.aten.uniform_.default: None,  # (from, to) in its arguments
    torch.ops.aten.uniform.default: None,
}
_DRAW_LIMIT = 64  # elements: larger draws are noise (dropout, initialisation), not decisions
SCALAR_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default)
_INDEXING = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
             torch.ops.aten._index_put_impl_.default)
# ops whose output shapes are values of one argument, by its position: CTC loss's target_lengths
_ADDRESSES_STORAGE = (torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_.default)
_SHAPED_BY_LENGTHS = {torch.ops.aten._ctc_loss.Tensor: 3, torch.ops.aten._ctc_loss_backward.Tensor: 4}


class KnownValues:
    """The values of fake tensors computed from the batch (or from draws) only, and what read them."""

    def __init__(self, draws: str = "high") -> None:
        if draws not in DRAWS:
            raise ValueError(f"draws must be one of {DRAWS}; got {draws!r}")
        self.draws = draws
        self._values: WeakIdKeyDictionary = WeakIdKeyDictionary()  # fake -> (real value, names of the batch inputs it came from)
        # the storages (by _cdata) of fakes that were given a value: a write elsewhere forgets nothing, without a
        # walk of every value (the optimizer's in-place updates are a tenth of a step's ops). Never shrinks: a
        # storage no value holds any more costs one walk
        self._storages: set[int] = set()
        self.reads: dict[str, None] = {}  # the batch inputs (and RANDOM) a read value came from, in the order first read
        self.random_reads = 0  # reads of a value computed from a random draw: random control flow

    def __len__(self) -> int:
        return len(self._values)

    # -- what is known ---------------------------------------------------------------------

    def know(self, fake: torch.Tensor, value: torch.Tensor, sources: frozenset[str]) -> None:
        if value.numel() <= VALUE_LIMIT:
            self._values[fake] = (value, sources)
            self._storages.add(fake.untyped_storage()._cdata)

    def value_of(self, tensor: Any) -> torch.Tensor | None:
        """The real value of a fake tensor (a real tensor is its own); None when unknown."""
        if not isinstance(tensor, torch.Tensor):
            return None
        if not isinstance(tensor, FakeTensor):
            return tensor
        known = self._values.get(tensor)
        return None if known is None else known[0]

    def sources_of(self, tensor: torch.Tensor) -> frozenset[str]:
        known = self._values.get(tensor) if isinstance(tensor, FakeTensor) else None
        return frozenset() if known is None else known[1]

    def real(self, tree: Any) -> Any:
        leaves, spec = tree_flatten(tree)
        return tree_unflatten([self.value_of(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)

    # -- the fake mode's dispatch ------------------------------------------------------------

    def dispatch(self, func, args, kwargs, fake_dispatch: Callable, empty_strided: Callable) -> Any:
        """Run `func` under fake tensors, answering from values what fake tensors cannot answer.

        `fake_dispatch(args, kwargs)` is the fake mode's own dispatch; `empty_strided(shape, stride, dtype)`
        makes a fake tensor. Returns `func`'s result, with values attached where they are known.
        """
        if func in _RANDOM_OPS:
            out = fake_dispatch(args, kwargs)
            self._draw(func, args, kwargs, out)
            return out
        if not len(self._values):  # the common case without a batch's values: nothing to answer from
            return fake_dispatch(args, kwargs)
        fakes = [tensor for tensor in tensors_of((args, kwargs)) if isinstance(tensor, FakeTensor)]
        known = [self._values.get(fake) for fake in fakes]
        if fakes and all(entry is not None for entry in known):
            sources = frozenset().union(*(entry[1] for entry in known))
            return self._from_values(func, args, kwargs, sources, fake_dispatch, empty_strided)
        if func in _SHAPED_BY_LENGTHS and self.value_of(args[_SHAPED_BY_LENGTHS[func]]) is not None:
            return self._ctc(func, args, empty_strided)
        if func in _INDEXING:
            args = self._masks_as_indices(args, empty_strided)
        out = fake_dispatch(args, kwargs)
        self._forget_written(func, args, kwargs)
        if not fakes and _small(out) and _has_values(func):
            # made from plain arguments and real tensors (arange, full, torch.tensor(...)): values are those of the arguments
            self._attach_all(out, self._run(func, args, kwargs), frozenset())
        return out

    def _from_values(self, func, args, kwargs, sources, fake_dispatch, empty_strided) -> Any:
        try:
            out = fake_dispatch(args, kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            real = self._run(func, args, kwargs)
            self._note_read(sources)
            if not isinstance(real, (torch.Tensor, tuple, list)):
                return real  # a scalar read: .item(), bool(), .tolist()
            return self._fakes_of(real, sources, empty_strided)
        if func in SCALAR_READS:  # fake tensors answered a constant themselves; still a read of the batch
            self._note_read(sources)
        if _small(out) and _has_values(func) and self._addressable(func, args):
            self._attach_all(out, self._run(func, args, kwargs), sources)
        else:
            self._forget_written(func, args, kwargs)
        return out

    def _addressable(self, func, args) -> bool:
        """Whether `func` reads the same elements of a value as of its fake. as_strided (what slicing
        decomposes to) addresses storage by absolute offset: on a value laid out unlike its fake (a
        batch view whose storage was too large to copy whole, a result of `_fakes_of`) it would read
        other elements, or past the end. Its result then has no value; the slice around it sets one."""
        if func not in _ADDRESSES_STORAGE:
            return True
        value = self._values.get(args[0])
        return value is not None and same_layout(args[0], value[0])

    def _run(self, func, args, kwargs) -> Any:
        """`func` on the values of its arguments, for real (the fake mode set aside)."""
        with for_real():
            return func(*self.real(args), **self.real(kwargs))

    def _fakes_of(self, real: Any, sources: frozenset[str], empty_strided: Callable) -> Any:
        leaves, spec = tree_flatten(real)
        fakes = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                fake = empty_strided(tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype)
                self.know(fake, leaf, sources)
                leaf = fake
            fakes.append(leaf)
        return tree_unflatten(fakes, spec)

    def _attach_all(self, out: Any, real: Any, sources: frozenset[str]) -> None:
        for fake, value in zip(tree_flatten(out)[0], tree_flatten(real)[0]):
            if isinstance(fake, FakeTensor) and isinstance(value, torch.Tensor):
                self.know(fake, value, sources)

    def _draw(self, func, args, kwargs, out: torch.Tensor) -> None:
        """A small random draw's value, at the end of its range the draws policy names."""
        if not isinstance(out, FakeTensor) or out.numel() > _DRAW_LIMIT or not out.is_floating_point():
            return
        low, high = _RANDOM_OPS[func] or _uniform_range(args, kwargs)
        top = math.nextafter(high, low) if self.draws == "high" else low
        with for_real():
            value = torch.full(tuple(out.shape), top, dtype=out.dtype)
        self.know(out, value, frozenset((RANDOM,)))

    def _ctc(self, func, args, empty_strided: Callable) -> Any:
        """CTC loss, whose forward keeps `log_alpha` of (batch, time, 2 × longest target + 1): its size is a
        value of `target_lengths` (known from the batch), the rest are the inputs' shapes."""
        target_lengths = args[_SHAPED_BY_LENGTHS[func]]
        self._note_read(self.sources_of(target_lengths))
        if func is torch.ops.aten._ctc_loss_backward.Tensor:  # the gradient of log_probs
            log_probs = args[1]
            return empty_strided(tuple(log_probs.shape), tuple(log_probs.stride()), log_probs.dtype)
        log_probs, lengths = args[0], self.value_of(target_lengths)
        assert lengths is not None  # dispatch checked it
        with for_real():
            longest = int(lengths.max()) if lengths.numel() else 0
        time, batch = log_probs.shape[0], (log_probs.shape[1] if log_probs.dim() == 3 else 1)
        alpha_shape = (batch, time, 2 * longest + 1)
        nll = empty_strided((batch,) if log_probs.dim() == 3 else (), (1,) if log_probs.dim() == 3 else (), log_probs.dtype)
        return nll, empty_strided(alpha_shape, (time * alpha_shape[2], alpha_shape[2], 1), log_probs.dtype)

    def _masks_as_indices(self, args: tuple, empty_strided: Callable) -> tuple:
        """Indexing by a boolean mask whose value is known, as indexing by the positions it selects.

        Fake tensors cannot index by a mask (how many elements it selects is a value); torch itself
        turns masks into `nonzero` positions the same way, so the op and its result are the same.
        """
        indices = args[1]
        if not isinstance(indices, (list, tuple)):
            return args
        rewritten = []
        for index in indices:
            value = self.value_of(index) if isinstance(index, FakeTensor) else None
            if value is not None and value.dtype in (torch.bool, torch.uint8):
                self._note_read(self.sources_of(index))
                with for_real():
                    positions = torch.nonzero(value).unbind(1)
                rewritten.extend(self._fakes_of(list(positions), self.sources_of(index), empty_strided))
            else:
                rewritten.append(index)
        return (args[0], rewritten, *args[2:])

    def _forget_written(self, func, args, kwargs) -> None:
        """An op that wrote into a tensor with a value, from what has none: its value (and its aliases') is gone."""
        schema = getattr(func, "_schema", None)
        if schema is None or not len(self._values):
            return
        for argument, value in zip(schema.arguments, args):
            if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, FakeTensor):
                storage = value.untyped_storage()._cdata
                if storage not in self._storages:
                    continue
                for fake in [f for f in list(self._values.keys()) if f.untyped_storage()._cdata == storage]:
                    del self._values[fake]

    def _note_read(self, sources: frozenset[str]) -> None:
        self.reads.update(dict.fromkeys(sources))
        if RANDOM in sources:
            self.random_reads += 1

    def batch_reads(self) -> tuple[str, ...]:
        """The batch inputs whose values the forward read, in the order first read."""
        return tuple(source for source in self.reads if source not in (RANDOM, BUFFERS))


@contextlib.contextmanager
def for_real() -> Iterator[None]:
    """Run ops on real tensors for real: outside the fake mode and every dispatch mode (the live-bytes
    tracker must not count the values, which the real step does not hold)."""
    with unset_fake_temporarily(), no_dispatch():
        yield


def known_value(tensor: torch.Tensor) -> torch.Tensor | None:
    """The value a planning fake mode knows for `tensor` (None for a real tensor, or one whose value is unknown)."""
    values = getattr(getattr(tensor, "fake_mode", None), "values", None)
    return values.value_of(tensor) if isinstance(values, KnownValues) else None


def give_value(fake: torch.Tensor, value: torch.Tensor) -> None:
    """Let the planning fake mode `fake` belongs to know its value (a copy: the simulation may write into it)."""
    values = getattr(getattr(fake, "fake_mode", None), "values", None)
    if isinstance(values, KnownValues):
        with for_real():
            copy = value.clone()
        values.know(fake, copy, frozenset(("a unit's input",)))


def copy_with_digest(value: torch.Tensor) -> tuple[torch.Tensor, str]:
    """A copy of a value, and a short digest of its bytes (equal values, equal digests)."""
    with for_real():
        copy = value.detach().clone()
        data = copy.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return copy, hashlib.sha1(data).hexdigest()[:16]


def _uniform_range(args, kwargs) -> tuple[float, float]:
    low = args[1] if len(args) > 1 else kwargs.get("from", 0.0)
    high = args[2] if len(args) > 2 else kwargs.get("to", 1.0)
    return float(low), float(high)


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors lie in their storages alike: strides, offset and the storage's size."""
    return (a.stride(), a.storage_offset(), a.untyped_storage().nbytes()) == (b.stride(), b.storage_offset(), b.untyped_storage().nbytes())


def storage_elements(tensor: torch.Tensor) -> int:
    """How many elements of its dtype the tensor's whole storage holds (a view's storage holds more than it)."""
    return tensor.untyped_storage().nbytes() // tensor.element_size()


def laid_out_like(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` over a copy of its whole storage, at its offset and strides: its fake's layout
    (`instruments.fake.StorageFakes`), so an op that addresses storage reads the same elements of both."""
    base = torch.empty(storage_elements(tensor), dtype=tensor.dtype, device=tensor.device)
    base.untyped_storage().copy_(tensor.untyped_storage())
    return base.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def _small(out: Any) -> bool:
    """Whether `out` holds tensors, none of them too large to keep a value of."""
    tensors = tensors_of(out)
    return bool(tensors) and all(tensor.numel() <= VALUE_LIMIT for tensor in tensors)


_NO_VALUES = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}  # uninitialised memory


def _has_values(func) -> bool:
    """Whether `func`'s outputs are a function of its arguments: not uninitialised memory, not a random draw."""
    return func.__name__.split(".")[0] not in _NO_VALUES and torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ())


class ValuesAsData(TorchFunctionMode):
    """`torch.tensor(data)` / `torch.as_tensor(data)` with fake tensors in `data` made of their values.

    torch reads the elements of such data from memory, which fake tensors do not have, below the
    dispatcher where `KnownValues` answers; the real step makes a tensor of their values.
    """

    def __init__(self, values: KnownValues) -> None:
        super().__init__()
        self.values = values

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FROM_DATA and args and _holds_fakes(args[0]):
            args = (self._data(args[0]), *args[1:])
        return func(*args, **kwargs)

    def _data(self, data: Any) -> Any:
        if isinstance(data, (list, tuple)):
            return type(data)(self._data(item) for item in data)
        if isinstance(data, FakeTensor):
            value = self.values.value_of(data)
            return data if value is None else value
        return data


_FROM_DATA = (torch.tensor, torch.as_tensor)


def _holds_fakes(data: Any) -> bool:
    if isinstance(data, (list, tuple)):
        return any(_holds_fakes(item) for item in data)
    return isinstance(data, FakeTensor)
