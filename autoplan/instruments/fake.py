"""Fake twins of models and inputs: FakeTensors with the shapes, dtypes and ties of the real ones
and no data, so a 70B-parameter model is simulated on a laptop; and a GradScaler that runs on them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from autoplan.instruments.quantized import fake_quantized_entries
from autoplan.instruments.rnn import MKLDNN_RNN_LAYER, with_real_workspace
from autoplan.instruments.routing import NOT_ANSWERED, WORST_CASE, MoeRoutingBound, RoutingTracker
from autoplan.instruments.values import BUFFERS, VALUE_LIMIT, KnownValues, ValuesAsData, for_real, laid_out_like, storage_elements
from autoplan.vocabulary.fingerprint import input_names
from autoplan.vocabulary.tensors import DEVICE_ASK, METADATA_OPS, fake_device_answer, tensors_of


def _fake_like(tensor: torch.Tensor, fake_mode: FakeTensorMode) -> torch.Tensor:
    with fake_mode:
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")


def fake_copy(model: torch.nn.Module, fake_mode: FakeTensorMode, leave_out: frozenset[str] = frozenset()) -> torch.nn.Module:
    """A twin of `model` whose parameters and buffers are FakeTensors on the CPU.

    Tied parameters stay tied (deepcopy's memo maps each original tensor to one fake), and no
    parameter data is copied, so this works for meta-device models of any size. A quantized base
    (bitsandbytes 4-bit or 8-bit layers) gets fakes of its packed weights and their quantization
    state too (`instruments.quantized`), sharing storage where the real ones do. `leave_out`: submodules, by
    name, the twin goes without (taken out of their container, nothing of theirs copied: a shortened stack).
    """
    storage_fakes = StorageFakes(fake_mode)
    memo: dict[int, Any] = fake_quantized_entries(model, storage_fakes.fake_of)
    buffers = {id(buffer) for buffer in model.buffers()}
    for name in leave_out:
        memo[id(model.get_submodule(name))] = None
    for tensor in _tensors_outside(model, leave_out):
        if id(tensor) in memo:
            continue
        fake = _fake_like(tensor, fake_mode)
        if isinstance(tensor, torch.nn.Parameter):
            fake = torch.nn.Parameter(fake, requires_grad=tensor.requires_grad)
        elif id(tensor) in buffers:
            _know_counter(tensor, fake, getattr(fake_mode, "values", None))
        memo[id(tensor)] = fake
    twin = copy.deepcopy(model, memo)
    for name in leave_out:
        container, _, key = name.rpartition(".")
        del twin.get_submodule(container)._modules[key]
    return twin


def _tensors_outside(model: torch.nn.Module, leave_out: frozenset[str]) -> list[torch.Tensor]:
    """The parameters and buffers of `model` that some submodule not named in `leave_out` (nor under one) holds."""
    if not leave_out:
        return list(model.parameters()) + list(model.buffers())
    held = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    kept = {id(tensor): tensor for name, tensor in held.items() if not any(name.startswith(f"{out}.") for out in leave_out)}
    return list(kept.values())


def _know_counter(buffer: torch.Tensor, fake: torch.Tensor, values: KnownValues | None) -> None:
    """An integer buffer's value rides along its fake: a counter the forward reads (BatchNorm's momentum=None divides
    by `num_batches_tracked`) is not computed from the weights, and the real step reads what the model holds now."""
    if values is None or not has_values(buffer) or buffer.is_floating_point() or buffer.is_complex() or buffer.numel() > VALUE_LIMIT:
        return
    with for_real():  # laid out as its fake (`_fake_like`), so ops that address storage read the same elements
        value = torch.empty_strided(buffer.shape, buffer.stride(), dtype=buffer.dtype).copy_(buffer.detach())
    values.know(fake, value, frozenset((BUFFERS,)))


class StorageFakes:
    """Fakes of real tensors with one fake storage per real storage: views and aliases stay aliases."""

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        self.fake_mode = fake_mode
        self._bases: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # (storage, dtype) -> a fake over all its bytes

    def fake_of(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = (storage._cdata, tensor.dtype)
        with self.fake_mode:
            if key not in self._bases:
                self._bases[key] = torch.empty(storage_elements(tensor), dtype=tensor.dtype, device="cpu")
            return self._bases[key].as_strided(tensor.shape, tensor.stride(), tensor.storage_offset()).detach()


def fake_tree(tree: Any, fake_mode: FakeTensorMode) -> Any:
    """Replace every tensor in a pytree of inputs by a fake of the same shape, dtype and grad flag.

    Tensors that share storage in the batch share it in the fakes too (`labels=input_ids` is one
    tensor passed twice; a batch may hold views of one buffer), so the simulated step counts the
    batch's bytes once, as the real step holds them.
    """
    storage_fakes = StorageFakes(fake_mode)
    values: KnownValues | None = getattr(fake_mode, "values", None)
    clones: dict[int, torch.Tensor] = {}

    def to_fake(name: str, tensor: torch.Tensor) -> torch.Tensor:
        fake = storage_fakes.fake_of(tensor)
        if values is not None and has_values(tensor) and tensor.numel() <= VALUE_LIMIT:
            # a copy: ops the simulation runs on values must not write into the user's batch; laid out as the
            # fake is where its storage is small enough to copy whole (slicing addresses storage by offset)
            if id(tensor) not in clones:
                with for_real():
                    whole = storage_elements(tensor) <= VALUE_LIMIT
                    clones[id(tensor)] = laid_out_like(tensor.detach()) if whole else tensor.detach().clone()
            value = clones[id(tensor)]
            values.know(fake, value, frozenset((name,)))
        return fake.requires_grad_(tensor.requires_grad) if fake.is_floating_point() else fake

    leaves, spec = tree_flatten_with_path(tree)
    names = input_names(leaves) if isinstance(tree, tuple) and len(tree) == 2 else [keystr(path) for path, _ in leaves]
    fakes = [to_fake(name, leaf) if isinstance(leaf, torch.Tensor) else leaf for name, (_, leaf) in zip(names, leaves)]
    return tree_unflatten(fakes, spec)


def has_values(tensor: torch.Tensor) -> bool:
    """Whether a tensor holds data we can read: not a fake, not on the meta device."""
    return not isinstance(tensor, FakeTensor) and tensor.device.type != "meta"


class PlanningFakeMode(FakeTensorMode):
    """torch's FakeTensorMode, plus the ops fake tensors cannot answer the way a training step needs.

    `aten._grouped_mm` (mixture-of-experts layers: transformers runs every expert's tokens as one
    grouped matmul) has a meta kernel that checks CUDA's dtype rule (bf16 only), while the CPU
    runs it in fp32 too. Under this mode such a call is shaped in bf16 and cast back: same shapes,
    the caller's dtype, no values. The shapes of a grouped matmul do not depend on routing (tokens
    × experts per token rows, however they are spread over the experts), so nothing is assumed
    about which expert gets which token.

    Routing written as a per-expert loop (`torch.where(expert_mask[e])`) has shapes that depend on
    the data: `routing` answers those with a bound (`instruments.routing`: the worst case, or a capacity).
    """

    grouped_matmuls = 0  # grouped matmuls shaped under this mode: the model routes tokens to experts
    # torch registers FlexAttention's fake kernels for FakeTensorMode itself, not its subclasses: take them in here
    supports_higher_order_operators = True

    def __init__(self, routing: MoeRoutingBound = WORST_CASE, draws: str = "high", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.values = KnownValues(draws)
        self.routing = RoutingTracker(routing, self.values)
        self._data_modes: list[ValuesAsData | None] = []

    # torch.tensor([t, ...]) of fake tensors reads their memory, below dispatch: a torch-function
    # mode, entered with this one, hands it their values instead (`instruments.values`)
    def __enter__(self):
        entered = super().__enter__()
        data_mode = ValuesAsData(self.values) if not self._data_modes else None  # the outermost entry only
        if data_mode is not None:
            data_mode.__enter__()
        self._data_modes.append(data_mode)
        return entered

    def __exit__(self, *exc):
        data_mode = self._data_modes.pop()
        if data_mode is not None:
            data_mode.__exit__(*exc)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE_ASK and (device := fake_device_answer(args)) is not None:
            return device
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator) or func in METADATA_OPS:
            return super().__torch_dispatch__(func, types, args, kwargs)
        if func in _SAME_DTYPE_OPS:
            check_same_dtype(func, args)
        dispatch = super().__torch_dispatch__
        if func is torch.ops.aten._grouped_mm.default:
            self.grouped_matmuls += 1
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16 and kwargs.get("out_dtype") is None:
            cast = torch.ops.aten._to_copy.default
            low = [dispatch(cast, types, (tensor,), {"dtype": torch.bfloat16}) for tensor in args[:2]]
            out = dispatch(func, types, (*low, *args[2:]), kwargs)
            return dispatch(cast, types, (out,), {"dtype": args[0].dtype})

        device = next((tensor.device for tensor in tensors_of((args, kwargs))), "cpu")

        def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return dispatch(torch.ops.aten.empty.memory_format, types, (list(shape),), {"dtype": dtype, "device": device})

        def empty_strided(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return dispatch(torch.ops.aten.empty_strided.default, types, (list(shape), list(stride)), {"dtype": dtype, "device": device})

        if func is MKLDNN_RNN_LAYER:  # its fake kernel leaves out the workspace backward reads (`instruments.rnn`)
            return with_real_workspace(args, dispatch(func, types, args, kwargs), empty)

        def fake_dispatch(args, kwargs):
            answer = self.routing.before(func, args, kwargs, empty)
            if answer is not NOT_ANSWERED:
                return answer
            out = dispatch(func, types, args, kwargs)
            self.routing.after(func, args, kwargs, out)
            return out

        return self.values.dispatch(func, args, kwargs, fake_dispatch, empty_strided)

    def routing_note(self) -> str:
        """How routing was profiled under this mode, for the plan's notes ("" when the model routes nothing)."""
        return self.routing.note() or (ROUTING_NOTE if self.grouped_matmuls else "")

    def unused_capacity_note(self, routing: MoeRoutingBound) -> str:
        """A note when a capacity was given but no routing under this mode decided a shape ("" otherwise)."""
        if routing.capacity is None or self.routing_assumed():  # it applied, or the routing note says why not
            return ""
        return (f"moe_capacity={routing.capacity:g} was given, but no routing in this model decides a shape (no per-expert "
                "torch.where/nonzero after a router): it changed nothing")

    def routing_assumed(self) -> str:
        """The same in a word (`Plan.moe_routing`): "worst case", "capacity 1.25", "any" (grouped matmuls), ""."""
        return self.routing.assumed or ("any" if self.grouped_matmuls else "")


# Matmuls and convolutions whose CPU and CUDA kernels refuse operands of different dtypes, while
# their meta kernels (all fake tensors run) accept them: an integer batch fed to a float Linear
# would plan as fitting and fail on the first real step.
_SAME_DTYPE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.convolution.default,
}


def check_same_dtype(func, args) -> None:
    """Raise the error the real kernel raises when `func`'s tensor operands differ in dtype."""
    tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
    if any(is_traceable_wrapper_subclass(tensor) for tensor in tensors):
        return  # a subclass's dtype is what it stands for (torchao's float8 tensors: their bf16 or fp32 origin), not its kernel's
    dtypes = [tensor.dtype for tensor in tensors]
    if len(set(dtypes)) > 1:
        names = " and ".join(str(dtype).removeprefix("torch.") for dtype in dict.fromkeys(dtypes))
        hint = " (an integer batch into a float layer: convert it with .float(), or embed token ids first)" if any(
            not dtype.is_floating_point for dtype in dtypes) else ""
        raise RuntimeError(f"{func.overloadpacket.__name__} got operands of different dtypes, {names}, which the real kernel refuses{hint}")


ROUTING_NOTE = (
    "mixture of experts: each expert layer runs as grouped matmuls over tokens × experts-per-token rows, "
    "whose shapes do not depend on which expert gets which token; the profile holds for any routing "
    "(no worst case or capacity assumed)"
)


def new_fake_mode(routing: MoeRoutingBound = WORST_CASE, draws: str = "high") -> PlanningFakeMode:
    """The fake-tensor mode every simulation runs under (real tensors allowed as inputs); `draws`: the
    value small random draws take (`instruments.values`)."""
    return PlanningFakeMode(routing, draws, allow_non_fake_inputs=True)


class FakeGradScaler:
    """torch.amp.GradScaler's tensors and ops under fake tensors, without its host reads (`.item()` has no value there).

    Allocates what the real scaler does around a step: the scale and growth tracker, the scaled
    loss, the inverse scale, the found-inf flag kept until the scale is updated.
    """

    def __init__(self) -> None:
        self.scale_tensor = torch.full((), 2.0**16)
        self.growth_tracker = torch.zeros((), dtype=torch.int32)
        self.found_inf: torch.Tensor | None = None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_tensor

    def step(self, opt: torch.optim.Optimizer) -> None:
        # GradScaler.unscale_: the inverse scale in double then float, a found-inf flag kept until update()
        inverse = self.scale_tensor.double().reciprocal().float()
        self.found_inf = torch.full((), 0.0)
        grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
        torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, inverse)
        del inverse
        opt.step()

    def update(self) -> None:
        if self.found_inf is None:  # as torch.amp.GradScaler.update: the step found no inf to say about
            raise RuntimeError("the simulated GradScaler was updated before a step")
        torch._amp_update_scale_(self.scale_tensor, self.growth_tracker, self.found_inf, 2.0, 0.5, 2000)
        self.found_inf = None
