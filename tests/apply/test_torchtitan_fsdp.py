"""torchtitan's FSDP2 setup, applied by hand as torchtitan applies it, against the plan pinned to that setup.

docs/published.md compares autoplan with torchtitan's published runs on its own Llama (`benchmarks/torchtitan_llama.py`):
FSDP2 with bf16 parameters and fp32 reduction, the last block kept gathered, every block checkpointed by torchtitan's
rule, its loop's loss. Two gloo ranks train a small model of each snapshot set up by torchtitan's own calls
(`tests/torchtitan_worker.py`: `checkpoint_wrapper` and `fully_shard`, not autoplan.apply); the CPU allocator's
count of each rank (`autoplan/verify/fsdp.py`) is the independent measure.
"""

from __future__ import annotations

import pytest

from tests.two_ranks import assert_counted_to_the_byte, distributed, run_on_two_ranks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_on_two_ranks("torchtitan_worker.py", tmp_path_factory.mktemp("torchtitan"))


@distributed
@pytest.mark.parametrize("snapshot, mode", [("2024-03", "full"), ("2024-12", "selective")])
def test_torchtitans_own_setup_is_counted_as_planned(ranks, snapshot, mode) -> None:
    plans = [rank[snapshot]["plan"] for rank in ranks]
    for plan in plans:
        assert plan["fsdp_mixed_precision"] == "bf16" and plan["world_size"] == 2
        assert [unit["mode"] for unit in plan["units"]] == [mode] * 3  # the pins, nothing chosen
    # The lower count is the peak, to the byte (tests/two_ranks.py). It was 512 bytes under the prediction until the
    # prefetched block's gathered parameters were counted as the flat all-gather output FSDP2 holds then, not as the
    # per-parameter storages it copies them into later.
    assert_counted_to_the_byte([rank[snapshot] for rank in ranks])
    for rank in ranks:
        losses = rank[snapshot]["losses"]
        assert all(loss == loss for loss in losses) and losses[-1] < losses[0]  # it trains
