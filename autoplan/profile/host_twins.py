"""Offload choices of a unit: its keep and full choices again with their saved tensors in host memory.

The host twins are measured like any choice (`profile.profiler`), the offload hooks making the host
copies (`planned.offload`), so their device bytes are exact; what measuring cannot tell, the time
of the copies, is priced here from the device profile's host link (`Device.host_bandwidth`, bytes
per second each way):

- device to host: the copies run on a side stream while the unit's forward goes on; what takes
  longer than its forward is exposed (the forward's end waits for them);
- host to device: fetched when the unit's backward begins. A full unit's recomputation needs its
  inputs first, so their copy is exposed whole; a keep unit's copies overlap its backward, and what
  takes longer than the backward is exposed.

A model of overlap, not a measurement: copies share the link with nothing else here, at the
link's datasheet rate, and no copy hides behind another unit's compute.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from autoplan.plan import OFFLOADABLE, Choice

UnitCost = Any  # profile.profiler.UnitCost, which measures with these twins (an import would close a circle)


def host_twins(costs: Mapping[Choice, UnitCost]) -> list[Choice]:
    """The offloaded version of every measured choice that can offload (keep and full, each precision)."""
    return [dataclasses.replace(choice, placement="host") for choice in costs
            if choice.mode in OFFLOADABLE and choice.saves is None and not choice.offloaded]


def priced(choice: Choice, cost: UnitCost, host_bandwidth: float) -> UnitCost:
    """`cost` (a host twin's measured bytes and compute time) with its copies' time added."""
    one_way = cost.host_bytes / host_bandwidth
    to_host = max(0.0, one_way - cost.fwd_time_s)
    back = one_way if choice.mode == "full" else max(0.0, one_way - cost.bwd_time_s)
    return dataclasses.replace(cost, transfer_s=2 * one_way, exposed_transfer_s=to_host + back)


def measure_host_twins(costs: Mapping[Choice, UnitCost], measure: Callable[[Choice], UnitCost],
                       host_bandwidth: float) -> dict[Choice, UnitCost]:
    """The host twins that take something off the device, measured and priced."""
    twins = {}
    for twin in host_twins(costs):
        cost = measure(twin)
        if cost.host_bytes > 0:  # nothing saved but parameters: the twin is its device choice
            twins[twin] = priced(twin, cost, host_bandwidth)
    return twins


def on_device_only(profile):
    """`profile` without its host twins: the plan space with offload off."""
    units = tuple(dataclasses.replace(unit, options={c: cost for c, cost in unit.options.items() if not c.offloaded})
                  for unit in profile.units)
    return dataclasses.replace(profile, units=units, offload=False)
