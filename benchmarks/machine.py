"""The line every benchmark prints about the machine it ran on, so a figure can be traced to one.

`describe_machine()` names the host, the CPU, its cores and torch's threads, Python and torch, and
any library the benchmark's numbers depend on; with a CUDA device, the GPU, its driver, the CUDA
version and what the CUDA context (and any other process) already holds on it.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version

import torch


def describe_machine(device: torch.device | None = None, *, libraries: tuple[str, ...] = ()) -> str:
    """"host · CPU · N cores, M threads · Python · torch [· library versions] [· GPU ...]"."""
    parts = [platform.node(), platform.processor() or platform.machine(),
             f"{os.cpu_count()} cores, {torch.get_num_threads()} threads",
             f"Python {platform.python_version()}", f"torch {torch.__version__}"]
    parts += [f"{name} {_version(name)}" for name in libraries]
    if device is not None and device.type == "cuda":
        parts += _cuda(device)
    return " · ".join(parts)


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _cuda(device: torch.device) -> list[str]:
    from autoplan.vocabulary.formatting import format_bytes

    free, total = torch.cuda.mem_get_info(device)  # after CUDA is initialised: what its context took
    context = total - free - torch.cuda.memory_reserved(device)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True).stdout.strip()
    except OSError:  # no nvidia-smi on the path: the line says so rather than the benchmark failing
        driver = ""
    return [torch.cuda.get_device_name(device), f"driver {driver or '?'}", f"CUDA {torch.version.cuda}",
            f"CUDA context + other processes: {format_bytes(context)}"]
