"""Tests for autoplan.inputs.devices: the device table, name resolution and rates."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from autoplan.errors import DeviceError
from autoplan.inputs.devices import DEVICES, Device, get_device, list_devices
from autoplan.inputs.devices import _match_gpu

REQUIRED = (
    "a100-40gb", "a100-80gb", "h100-80gb", "h200", "rtx-3090", "rtx-4090",
    "t4", "v100-16gb", "v100-32gb", "l4", "cpu",
)
GiB = 2**30


@pytest.mark.parametrize("name", REQUIRED)
def test_required_device_present_and_positive(name: str) -> None:
    device = DEVICES[name]
    assert device.name == name
    assert device.kind == ("cpu" if name == "cpu" else "cuda")
    assert device.memory_bytes > 0
    assert device.memory_bandwidth > 0
    assert device.context_bytes >= 0
    assert device.description and device.source
    assert device.peak_flops["fp32"] > 0
    assert all(rate > 0 for rate in device.peak_flops.values())
    assert set(device.peak_flops) <= {"fp32", "tf32", "bf16", "fp16", "float8"}


@pytest.mark.parametrize(
    ("name", "memory", "bandwidth", "bf16"),
    [
        ("a100-40gb", 40 * GiB, 1555e9, 312e12),
        ("a100-80gb", 80 * GiB, 2039e9, 312e12),
        ("h100-80gb", 80 * GiB, 3.35e12, 989.4e12),
        ("h200", 141 * GiB, 4.8e12, 989.4e12),
        ("rtx-3090", 24 * GiB, 936e9, 71e12),
        ("rtx-4090", 24 * GiB, 1008e9, 165.2e12),
        ("l4", 24 * GiB, 300e9, 121e12),
    ],
)
def test_datasheet_numbers(name: str, memory: int, bandwidth: float, bf16: float) -> None:
    device = DEVICES[name]
    assert device.memory_bytes == memory
    assert device.memory_bandwidth == pytest.approx(bandwidth)
    assert device.peak_flops["bf16"] == pytest.approx(bf16)


def test_cuda_context_and_cpu_memory() -> None:
    # Hopper cards take the context measured on an H100 once cuBLAS, cuDNN and attention ran; others the estimate
    assert DEVICES["h100-80gb"].context_bytes == DEVICES["h200"].context_bytes == 800_653_312
    assert DEVICES["h100-80gb"].context_source.startswith("measured on an NVIDIA H100")
    assert DEVICES["a100-80gb"].context_bytes == 512 * 2**20 and "estimate" in DEVICES["a100-80gb"].context_source
    cpu = DEVICES["cpu"]
    assert cpu.context_bytes == 0
    assert cpu.memory_bytes == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert "rough" in cpu.description


def test_h100_bf16_faster_than_fp32() -> None:
    h100 = DEVICES["h100-80gb"]
    assert h100.peak_flops["bf16"] > h100.peak_flops["fp32"]
    assert h100.supports_bf16
    assert h100.low_precision_dtype == torch.bfloat16
    assert h100.low_precision_name == "bf16"


@pytest.mark.parametrize("name", ["t4", "v100-16gb", "v100-32gb"])
def test_pre_ampere_has_no_bf16(name: str) -> None:
    device = DEVICES[name]
    assert not device.supports_bf16
    assert "tf32" not in device.peak_flops
    assert device.low_precision_dtype == torch.float16
    assert device.low_precision_name == "fp16"


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("h100", "h100-80gb"),
        ("H100", "h100-80gb"),
        ("H100-80GB", "h100-80gb"),
        ("a100-80", "a100-80gb"),
        ("A100-40GB", "a100-40gb"),
        ("4090", "rtx-4090"),
        ("3090", "rtx-3090"),
        ("RTX 4090", "rtx-4090"),
        ("  T4 ", "t4"),
        ("H200", "h200"),
        ("CPU", "cpu"),
    ],
)
def test_aliases(alias: str, name: str) -> None:
    assert get_device(alias) is DEVICES[name]


@pytest.mark.parametrize(("family", "sizes"), [("a100", ("a100-40gb", "a100-80gb")), ("V100", ("v100-16gb", "v100-32gb"))])
def test_a_family_of_several_sizes_must_name_one(family: str, sizes: tuple[str, ...]) -> None:
    with pytest.raises(ValueError) as info:  # not a silent pick of one memory size
        get_device(family)
    assert all(size in str(info.value) for size in sizes)


def test_torch_device() -> None:
    assert get_device(torch.device("cpu")) is DEVICES["cpu"]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="not a CUDA device of this machine"):
            get_device(torch.device("cuda"))
    with pytest.raises(ValueError, match="meta"):
        get_device(torch.device("meta"))


def test_device_passes_through() -> None:
    device = DEVICES["l4"]
    assert get_device(device) is device


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(ValueError) as info:
        get_device("tpu-v9")
    message = str(info.value)
    assert "tpu-v9" in message
    for name in REQUIRED:
        assert name in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CUDA-less path")
def test_none_without_cuda_is_cpu() -> None:
    assert get_device(None) is DEVICES["cpu"]
    assert get_device() is DEVICES["cpu"]


def test_list_devices_sorted() -> None:
    names = [d.name for d in list_devices()]
    assert names == sorted(names)
    assert set(REQUIRED) <= set(names)


def test_flops_for_dtype_mapping() -> None:
    a100 = DEVICES["a100-80gb"]
    assert a100.flops_for(torch.float32) == pytest.approx(19.5e12)
    assert a100.flops_for(torch.float32, allow_tf32=True) == pytest.approx(156e12)
    assert a100.flops_for(torch.bfloat16) == pytest.approx(312e12)
    assert a100.flops_for(torch.float16) == pytest.approx(312e12)
    assert a100.flops_for(torch.float64) == pytest.approx(19.5e12)
    assert a100.flops_for(torch.int8) == pytest.approx(19.5e12)


def test_flops_for_falls_back_to_fp32() -> None:
    t4 = DEVICES["t4"]
    assert t4.flops_for(torch.bfloat16) == t4.peak_flops["fp32"]
    assert t4.flops_for(torch.float32, allow_tf32=True) == t4.peak_flops["fp32"]
    assert t4.flops_for(torch.float16) == pytest.approx(65e12)
    cpu = DEVICES["cpu"]
    assert cpu.flops_for(torch.float16) == cpu.peak_flops["fp32"]
    assert cpu.flops_for(torch.bfloat16) == cpu.peak_flops["fp32"]


def test_device_is_frozen() -> None:
    device = DEVICES["h100-80gb"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        device.memory_bytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        device.peak_flops["fp32"] = 1.0  # type: ignore[index]


def test_plain_dict_rates_are_frozen_too() -> None:
    device = Device("x", "x", "cuda", 1, {"fp32": 1.0}, 1.0, 0, "test")
    with pytest.raises(TypeError):
        device.peak_flops["fp32"] = 2.0  # type: ignore[index]


@pytest.mark.parametrize(
    ("gpu_name", "memory", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 79 * GiB, "h100-80gb"),
        ("NVIDIA H200", 140 * GiB, "h200"),
        ("NVIDIA A100-SXM4-40GB", 39 * GiB, "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", 79 * GiB, "a100-80gb"),
        ("Tesla V100-SXM2-16GB", 15 * GiB, "v100-16gb"),
        ("Tesla V100-SXM2-32GB", 31 * GiB, "v100-32gb"),
        ("Tesla T4", 15 * GiB, "t4"),
        ("NVIDIA L4", 22 * GiB, "l4"),
        ("NVIDIA GeForce RTX 4090", 23 * GiB, "rtx-4090"),
        ("NVIDIA GeForce RTX 3090", 23 * GiB, "rtx-3090"),
    ],
)
def test_gpu_names_match_table(gpu_name: str, memory: int, expected: str) -> None:
    device = _match_gpu(gpu_name, memory, 0, (9, 0))
    assert device.name == expected
    assert device.memory_bytes == memory
    assert device.peak_flops == DEVICES[expected].peak_flops


def test_unknown_gpu_assumes_h100_rates() -> None:
    device = _match_gpu("NVIDIA B200", 94 * GiB, 1, (10, 0))
    assert device.name == "cuda:1"
    assert device.memory_bytes == 94 * GiB
    assert "H100 rates assumed" in device.description
    assert device.peak_flops == DEVICES["h100-80gb"].peak_flops
    old = _match_gpu("Quadro P6000", 24 * GiB, 0, (6, 1))
    assert not old.supports_bf16


def test_host_links_follow_the_interface() -> None:
    """Offload is priced by the host link: PCIe Gen5 for Hopper SXM, Gen4 for Ampere/Ada, NVLink-C2C on GH200."""
    assert DEVICES["h100-80gb"].host_bandwidth == 2 * DEVICES["a100-80gb"].host_bandwidth == 64e9
    assert DEVICES["t4"].host_bandwidth == 16e9
    grace = _match_gpu("NVIDIA GH200 480GB", 94 * GiB, 0, (9, 0))
    assert grace.name == "gh200" and grace.host_bandwidth == 450e9 and grace.memory_bytes == 94 * GiB
    assert DEVICES["cpu"].host_bandwidth == 0
    assert get_device("custom:memory=24GiB,fp32_tflops=10,bandwidth=900GB/s,host_bandwidth=8GB/s").host_bandwidth == 8e9
    assert get_device("custom:memory=24GiB,fp32_tflops=10,bandwidth=900GB/s").host_bandwidth == 32e9


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_none_on_cuda_uses_torch_memory() -> None:
    device = get_device(None)
    index = torch.cuda.current_device()
    assert device.kind == "cuda"
    assert device.memory_bytes == torch.cuda.get_device_properties(index).total_memory


# -- more cards, and a card of your own ------------------------------------------------------------


@pytest.mark.parametrize(("gpu_name", "expected"), [("NVIDIA A10G", "a10g"), ("NVIDIA RTX A6000", "rtx-a6000"),
                                                    ("NVIDIA L40S", "l40s"), ("NVIDIA L4", "l4")])
def test_common_cards_are_known_by_their_cuda_names(gpu_name: str, expected: str) -> None:
    assert _match_gpu(gpu_name, 22 * GiB, 0, (8, 6)).name == expected
    assert get_device(expected).compute_capability >= (8, 6)


def test_a_custom_card_from_the_command_line() -> None:
    card = get_device("custom:memory=48GiB,fp32_tflops=91.6,bf16_tflops=362,bandwidth=864GB/s,capability=8.9,name=mine")
    assert (card.name, card.kind, card.memory_bytes, card.compute_capability) == ("mine", "cuda", 48 * GiB, (8, 9))
    assert card.peak_flops["bf16"] == 362e12 and card.peak_flops["fp16"] == 362e12 and card.memory_bandwidth == 864e9
    assert card.supports_bf16
    old = get_device("custom:memory=16GiB,fp32_tflops=8,fp16_tflops=65,bandwidth=320GB/s")
    assert not old.supports_bf16 and old.compute_capability == (7, 0)


def test_a_custom_card_from_a_json_file(tmp_path) -> None:
    path = tmp_path / "a40.json"
    path.write_text('{"name": "a40", "memory": "48GiB", "fp32_tflops": 37.4, "bf16_tflops": 149.7, "bandwidth": "696GB/s"}')
    card = get_device(str(path))
    assert card.name == "a40" and card.memory_bytes == 48 * GiB and card.compute_capability == (8, 0)


def test_a_json_device_file_that_gives_a_key_twice_is_refused(tmp_path) -> None:
    # issue 39: json.load keeps the last of two equal keys, so "memory" was read as 80GiB without a word
    path = tmp_path / "twice.json"
    path.write_text('{"memory": "48GiB", "fp32_tflops": 37.4, "bandwidth": "696GB/s", "memory": "80GiB"}')
    with pytest.raises(DeviceError) as info:
        get_device(str(path))
    assert str(info.value) == f"the device file {str(path)!r} gives 'memory' twice: give each key once"


@pytest.mark.parametrize(("spec", "says"), [
    ("custom:memory=48GiB", "missing fp32_tflops, bandwidth"),
    ("custom:memory=48GiB,fp32_tflops=91,bandwidth=864GB/s,colour=red", "unknown key(s) colour"),
    ("custom:memory=48,fp32_tflops=91,bandwidth=864GB/s", "memory: a memory needs a unit"),
    ("custom:memory=48GiB,fp32_tflops=-1,bandwidth=864GB/s", "fp32_tflops must be positive"),
    ("custom:memory=48GiB,fp32_tflops=91,bandwidth=864GB/s,interconnect=fast", "interconnect: an interconnect must start with a number"),
    ("custom:memory=48GiB,fp32_tflops=91,bandwidth=864GB/s,capability=nine", "capability is major.minor"),
    ("custom:memory", "key=value pairs"),
    ("no/such/card.json", "cannot read the device file"),
    # issue 39: a key given twice was taken, the last value winning
    ("custom:memory=48GiB,fp32_tflops=91,bandwidth=864GB/s,Memory=80GiB", "gives 'memory' twice: give each key once"),
])
def test_a_custom_card_that_is_wrong_says_what(spec: str, says: str) -> None:
    with pytest.raises(DeviceError) as info:
        get_device(spec)
    assert says in str(info.value)
