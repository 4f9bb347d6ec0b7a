"""Tensor parallelism's all-reduce in the rank twin (instruments/collectives.py): a copy in memory, priced at the
card's interconnect by the ring formula, once per row-wise linear forward and column-wise linear backward."""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autoplan.inputs.devices import get_device
from autoplan.inputs.tensor_parallel import rank_model, resolve_layout
from autoplan.instruments.collectives import ALL_REDUCE, all_reduced
from autoplan.instruments.fake import new_fake_mode
from autoplan.instruments.tracker import FusedElementwiseRates, LiveBytesTracker
from examples.llama import Llama, LlamaConfig, example_batch


def _time_of_one(device, shape=(4, 1024, 1024), ranks=4) -> tuple[float, int]:
    with new_fake_mode() as mode:
        x = mode.from_tensor(torch.empty(shape, dtype=torch.bfloat16))
        with LiveBytesTracker(device) as tracker:
            before = tracker.live_bytes
            out = all_reduced(x, ranks)
            held = tracker.live_bytes - before
        del out
    return tracker.phases()[-1].time_s, held


def test_an_all_reduce_is_a_copy_priced_at_the_interconnect_by_the_ring():
    nbytes = 4 * 1024 * 1024 * 2
    h100, rtx = get_device("h100-80gb"), get_device("rtx-4090")
    assert h100.interconnect_bandwidth == 450e9 and rtx.interconnect_bandwidth == rtx.host_bandwidth  # NVLink; PCIe
    time_s, held = _time_of_one(h100)
    assert held == nbytes  # a new tensor, as torch's functional all-reduce returns
    assert time_s == 2 * 3 / 4 * nbytes / 450e9
    assert _time_of_one(rtx)[0] == 2 * 3 / 4 * nbytes / rtx.host_bandwidth
    assert _time_of_one(FusedElementwiseRates(h100))[0] == time_s  # compiled code fuses no collective
    cpu = get_device("cpu")
    assert _time_of_one(cpu)[0] == 2 * nbytes / cpu.memory_bandwidth  # no interconnect: the copy it is here


def test_a_ring_wider_than_a_node_moves_at_the_network_rate():
    """Eight H100s share NVLink; sixteen tensor-parallel ranks span two nodes, and the ring's slowest hop is the network
    (one 400 Gb/s port a GPU). A reduce-scatter and an all-gather each move (N-1)/N of the whole tensor: half a ring
    all-reduce."""
    from autoplan.inputs.sequence_parallel import gather_sequence
    from autoplan.instruments.collectives import peer_link

    h100, shape = get_device("h100-80gb"), (4, 1024, 1024)
    nbytes = 4 * 1024 * 1024 * 2
    assert peer_link(h100, 8) == 450e9 and peer_link(h100, 16) == 50e9 == h100.network_bandwidth
    assert _time_of_one(h100, shape, ranks=16)[0] == 2 * 15 / 16 * nbytes / 50e9
    assert _time_of_one(h100, shape, ranks=8)[0] == 2 * 7 / 8 * nbytes / 450e9
    assert peer_link(get_device("rtx-4090"), 16) == 12.5e9 and peer_link(get_device("cpu"), 16) == 0.0
    with new_fake_mode() as mode:
        part = mode.from_tensor(torch.empty(shape, dtype=torch.bfloat16))
        with LiveBytesTracker(h100) as tracker:
            gather_sequence(part, 4)  # all_gathered (priced) then a cat along the sequence (a copy in memory)
    gathered = 4 * nbytes
    copy = 2 * gathered / h100.memory_bandwidth
    assert tracker.phases()[-1].time_s == 3 / 4 * gathered / 450e9 + copy


def test_a_custom_card_names_its_interconnect_or_uses_its_host_link():
    assert get_device("custom:memory=80GiB,fp32_tflops=60,bandwidth=3TB/s,interconnect=450GB/s").interconnect_bandwidth == 450e9
    plain = get_device("custom:memory=80GiB,fp32_tflops=60,bandwidth=3TB/s,host_bandwidth=64GB/s")
    assert plain.interconnect_bandwidth == plain.host_bandwidth == 64e9
    assert plain.network_bandwidth == 12.5e9
    assert get_device("custom:memory=80GiB,fp32_tflops=60,bandwidth=3TB/s,network=50GB/s").network_bandwidth == 50e9


class _Collectives(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.sizes: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is ALL_REDUCE:
            self.sizes[(tuple(out.shape), args[1])] += 1
        return out


def test_a_rank_all_reduces_each_row_wise_output_and_each_column_wise_input_gradient():
    config = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
    torch.manual_seed(0)
    model = Llama(config)
    twin = rank_model(model, resolve_layout(model, 2, None), 2)
    tokens, targets = example_batch(config, 2, 32)
    with _Collectives() as forward:
        loss = twin(tokens, targets)
    with _Collectives() as backward:
        loss.backward()
    assert forward.sizes == {((2, 32, 64), 2): 2 * config.n_layers}  # attention.wo and feed_forward.w2
    # wq, wk, wv, w1, w3 and the split head: their inputs' gradients
    assert backward.sizes == {((2, 32, 64), 2): 5 * config.n_layers + 1}
