"""The placement axis: where what a unit saves for backward waits: on the device, or in pinned host memory.

- `device`: as torch keeps it;
- `host` (offload): copied to pinned host memory as it is saved and back for the unit's backward, for
  keep and full units (selective checkpointing keeps its ops' outputs out of reach of saved-tensor hooks),
  on a device with a host link (`Device.host_bandwidth`), planned for one GPU.

Offload is allowed for a plan as one value, `HostMemory`: the host link's rate and the pinned memory the
offloaded units may hold at once; no HostMemory, no offload. Each unit's host twins are measured like
any choice (`profile.profiler`), the hooks below making the host copies, so their device bytes are
exact; the copies' time is priced here from the host link (`priced`):

- device to host: the copies run on a side stream while the unit's forward goes on; what takes
  longer than its forward is exposed (the forward's end waits for them);
- host to device: fetched when the unit's backward begins. A full unit's recomputation needs its
  inputs first, so their copy is exposed whole; a keep unit's copies overlap its backward, and what
  takes longer than the backward is exposed.

A model of overlap, not a measurement: copies share the link with nothing else here, at the
link's datasheet rate, and no copy hides behind another unit's compute.

How it runs (`OffloadSaved`, a `saved_tensors_hooks` context around one call of the unit): every tensor the
unit's ops save (keep mode), or the inputs checkpointing saves (full mode), is copied to pinned host
memory as it is saved; parameters and buffers stay where they are, and a tensor saved twice is copied
once. On CUDA the device-to-host copies run on a side stream, in the order the tensors were saved,
while the unit's later ops run; when the unit's forward returns, the compute stream waits for them (a
stream wait, not a host synchronize) and the device tensors are let go. The bytes are therefore on the
device exactly as long as keep mode has them during the unit's forward, and off it from then until the
unit's backward. When the unit's backward begins (a pre-hook on its output's autograd node), every copy
is brought back on the side stream at once, last saved first, into memory allocated on the compute
stream, and each saved tensor's unpack waits for its own copy. Without CUDA the same copies are made
synchronously, in the same order, so a simulated step allocates what a GPU step allocates, op for op
(`instruments.host` tells the tracker which allocations are host memory).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

import torch

from autoplan.axes import DeviceLike
from autoplan.errors import OptionError
from autoplan.instruments.host import on_host, over_the_link
from autoplan.vocabulary.tensors import tensors_of

Placement = Literal["device", "host"]

PLACEMENTS: tuple[Placement, ...] = ("device", "host")
OFFLOADABLE: frozenset[str] = frozenset({"keep", "full"})  # selective checkpointing keeps its ops' outputs out of reach of saved-tensor hooks


class PlacementAxis:
    """The `ChoiceAxis` of placements (`Choice.placement`)."""

    field = "placement"

    def values(self) -> tuple[Placement, ...]:
        return PLACEMENTS

    def check(self, value: object) -> Placement:
        if value not in PLACEMENTS:
            raise OptionError(f"unknown placement {value!r}; expected one of {PLACEMENTS}")
        return PLACEMENTS[PLACEMENTS.index(value)]  # the member, as its Literal type

    def unsupported(self, value: str, device: DeviceLike) -> str:
        if self.check(value) == "host" and device.host_bandwidth <= 0:
            return f"{device.name} has no host link to offload over (on the CPU activations are in host memory already)"
        return ""

    def rewriting(self, value: str) -> int:
        return 3 if self.check(value) == "host" else 0  # more than any mode or precision: hooks and copies over the link

    def words(self, value: str) -> str:
        return value


PLACEMENT = PlacementAxis()


def check_offloadable(mode: str, placement: str) -> None:
    """Only keep and full units offload (a Choice's own check)."""
    if placement == "host" and mode not in OFFLOADABLE:
        raise OptionError(f"only keep and full units can offload what they save; got mode {mode!r}")


@dataclass(frozen=True)
class HostMemory:
    """Offload allowed: the host link copies move over, and the pinned host memory offloaded units may hold at once."""

    budget_bytes: int
    bandwidth: float  # bytes per second each way (`Device.host_bandwidth`)


def offload_allowed(offload: bool | None, device: DeviceLike, sharded: bool) -> bool:
    """The offload option: None (the default) offloads where the device has a host link, on one GPU; True where it
    cannot be is an OptionError that says why."""
    why = PLACEMENT.unsupported("host", device) or ("offload plans one GPU; with FSDP (world_size > 1) leave it off" if sharded else "")
    if offload is None:
        return not why
    if not isinstance(offload, bool):
        raise OptionError(f"offload takes True or False; got {offload!r}")
    if offload and why:
        raise OptionError(f"offload=True (--offload): {why}")
    return offload


# -- pricing: the host twins of a unit's choices, measured like any choice and priced by the host link ----------

UnitCost = Any  # profile.profiler.UnitCost, which measures with these twins (a later stage)


def host_twins(costs: Mapping[Any, UnitCost]) -> list:
    """The offloaded version of every measured choice that can offload (keep and full, each precision)."""
    return [dataclasses.replace(choice, placement="host") for choice in costs
            if choice.mode in OFFLOADABLE and choice.saves is None and not choice.offloaded]


def priced(choice, cost: UnitCost, host_bandwidth: float) -> UnitCost:
    """`cost` (a host twin's measured bytes and compute time) with its copies' time added."""
    one_way = cost.host_bytes / host_bandwidth
    to_host = max(0.0, one_way - cost.fwd_time_s)
    back = one_way if choice.mode == "full" else max(0.0, one_way - cost.bwd_time_s)
    return dataclasses.replace(cost, transfer_s=2 * one_way, exposed_transfer_s=to_host + back)


def measure_host_twins(costs: Mapping[Any, UnitCost], measure: Callable[[Any], UnitCost], host_bandwidth: float) -> dict:
    """The host twins that take something off the device, measured and priced."""
    twins = {}
    for twin in host_twins(costs):
        cost = measure(twin)
        if cost.host_bytes > 0:  # nothing saved but parameters: the twin is its device choice
            twins[twin] = priced(twin, cost, host_bandwidth)
    return twins


# -- how it runs: the saved-tensor hooks around an offloaded unit's call ----------------------------------------

_side_streams: dict[torch.device, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream | None":
    """One copy stream per CUDA device, shared by every offloaded unit (copies queue in save order)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


class _HostCopy:
    """One saved tensor's pinned host copy, and its copy back to the device once backward asks."""

    __slots__ = ("host", "device", "source", "on_device", "event")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.device = tensor.device
        stream = _side_stream(tensor.device)
        with on_host():
            self.host = torch.empty_like(tensor, device="cpu", pin_memory=stream is not None)
            if stream is None:
                self.host.copy_(tensor.detach())
            else:
                stream.wait_stream(torch.cuda.current_stream(tensor.device))
                with torch.cuda.stream(stream):
                    self.host.copy_(tensor.detach(), non_blocking=True)
        self.source: torch.Tensor | None = tensor  # held until the unit's forward returns: the copy may still be reading it
        self.on_device: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None

    def fetch(self) -> None:
        """Start the copy back to the device (on CUDA, on the side stream into compute-stream memory)."""
        if self.on_device is not None:
            return
        stream = _side_stream(self.device)
        with over_the_link():
            self.on_device = torch.empty_like(self.host, device=self.device)
            if stream is None:
                self.on_device.copy_(self.host)
                return
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.on_device.copy_(self.host, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(stream)

    def unpack(self) -> torch.Tensor:
        if self.on_device is None:
            self.fetch()
        assert self.on_device is not None  # fetch made it
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
        return self.on_device


class OffloadSaved(torch.autograd.graph.saved_tensors_hooks):
    """Around one call of an offloaded unit: its saved tensors go to host memory and come back for its backward."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._state = {id(t.untyped_storage()) for t in (*module.parameters(), *module.buffers())}
        self._copies: dict[tuple, _HostCopy] = {}
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        if isinstance(tensor, torch.nn.Parameter) or id(tensor.untyped_storage()) in self._state:
            return tensor  # alive anyway: a copy would only cost the link
        key = (id(tensor.untyped_storage()), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if key not in self._copies:
            self._copies[key] = _HostCopy(tensor)
        return self._copies[key]

    @staticmethod
    def _unpack(packed):
        return packed.unpack() if isinstance(packed, _HostCopy) else packed

    def forward_done(self, output) -> None:
        """The unit's forward returned: let the device tensors go once their copies are done, and bring
        the copies back when the unit's backward begins."""
        copies = list(self._copies.values())
        self._copies = {}
        if not copies:
            return
        streams = {copy.device: stream for copy in copies if (stream := _side_stream(copy.device)) is not None}
        for device, stream in streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)
        for copy in copies:
            copy.source = None
        nodes = {id(t.grad_fn): t.grad_fn for t in tensors_of(output) if t.requires_grad and t.grad_fn is not None}
        if not nodes:
            return  # nothing to hook: each copy comes back when backward unpacks it
        fetched: list[bool] = []

        def fetch_all(*_):
            if not fetched:
                fetched.append(True)
                for copy in reversed(copies):  # backward needs what forward saved last first
                    copy.fetch()
                copies.clear()  # the saved variables hold what they need; the hook holds nothing

        for node in nodes.values():
            node.register_prehook(fetch_all)

