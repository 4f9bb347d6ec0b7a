"""inputs.settings: the checks plan()'s options get before anything is traced."""

import pytest

from autoplan.errors import OptionError
from autoplan.inputs.settings import check_world_size, host_budget_bytes
from autoplan.mesh import MAX_RANKS


@pytest.mark.parametrize("world_size", [0, -1, 1.5, True, "2"])
def test_world_size_must_be_a_whole_number_of_gpus(world_size) -> None:
    with pytest.raises(OptionError, match="whole number of GPUs"):
        check_world_size(world_size)
    assert check_world_size(4) == 4


def test_a_world_size_no_fsdp_job_runs_is_refused_naming_the_limit() -> None:
    assert check_world_size(MAX_RANKS) == MAX_RANKS
    with pytest.raises(OptionError, match="1,000,000 is more GPUs than FSDP shards over .at most 65,536."):
        check_world_size(1_000_000)


def test_a_host_budget_takes_every_unit_a_budget_does() -> None:
    # issue 39: --host-budget 1PB was "unknown unit 'PB'", and the message did not say which units there are
    assert host_budget_bytes("1PB") == 10**15 and host_budget_bytes("1TiB") == 2**40
    with pytest.raises(OptionError, match=r"unknown unit 'XB' \(known: B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB, %\)"):
        host_budget_bytes("1XB")
