"""Offloaded units: what a unit saves for backward waits in pinned host memory (`Choice.placement == "host"`).

`OffloadSaved` is a `saved_tensors_hooks` context around one call of a unit. Every tensor the
unit's ops save (keep mode), or the inputs checkpointing saves (full mode), is copied to pinned
host memory as it is saved; parameters and buffers stay where they are, and a tensor saved twice is
copied once. On CUDA the device-to-host copies run on a side stream, in the order the tensors were
saved, while the unit's later ops run; when the unit's forward returns, the compute stream waits
for them (a stream wait, not a host synchronize) and the device tensors are let go. The bytes are
therefore on the device exactly as long as keep mode has them during the unit's forward, and off
it from then until the unit's backward.

When the unit's backward begins (a pre-hook on its output's autograd node), every copy is brought
back on the side stream at once, last saved first, into memory allocated on the compute stream, and each saved
tensor's unpack waits for its own copy: the first backward op waits for the first copies, later
ones find theirs done. Without CUDA the same copies are made synchronously, in the same order, so
a simulated step allocates what a GPU step allocates, op for op (`instruments.host` tells the
tracker which allocations are host memory).
"""

from __future__ import annotations

import torch

from autoplan.instruments.host import on_host, over_the_link
from autoplan.vocabulary.tensors import tensors_of

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

