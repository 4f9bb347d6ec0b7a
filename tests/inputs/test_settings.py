"""inputs.settings: the checks plan()'s options get before anything is traced."""

import pytest

from autoplan.errors import OptionError
from autoplan.inputs.settings import check_world_size
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
