"""The batch's values under fake tensors (instruments/values.py): a view of the batch keeps its values
where an op addresses its storage directly, as slicing does once decomposed to as_strided."""

from __future__ import annotations

import pytest
import torch

from autoplan.instruments import fake as fake_module
from autoplan.instruments.fake import fake_tree, new_fake_mode
from autoplan.instruments.values import known_value


@pytest.mark.parametrize("copied_whole", [True, False], ids=["storage copied whole", "storage too large to copy"])
def test_slices_of_a_label_view_read_its_own_elements(copied_whole, monkeypatch) -> None:
    """Next-token labels are tokens[:, 1:], a view at storage offset 1. Its value was a contiguous copy,
    and the as_strided a slice at its end decomposes to addressed past the copy's end (a Llama at 4096
    tokens could not be planned)."""
    if not copied_whole:
        monkeypatch.setattr(fake_module, "VALUE_LIMIT", 5)  # the 5 labels keep a value, their 11-element storage is not copied
    tokens = torch.arange(100, 111).reshape(1, 11)
    labels = tokens[:, 1:6]
    mode = new_fake_mode()
    (fake,), _ = fake_tree(((labels,), {}), mode)
    with mode:
        flat = fake.flatten()
        tail, middle = flat[2:5], flat[1:3]
    assert torch.equal(known_value(tail), labels.flatten()[2:5])
    assert torch.equal(known_value(middle), labels.flatten()[1:3])
    assert torch.equal(known_value(fake), labels)


def test_an_integer_buffer_keeps_its_value_and_its_reads_are_not_the_batchs() -> None:
    """Issue 39: BatchNorm(momentum=None) divides by float(num_batches_tracked), which fake tensors cannot answer;
    the counter's value rides along its fake, while a float buffer (running_mean) keeps none."""
    from autoplan.instruments.fake import fake_copy

    norm = torch.nn.BatchNorm1d(4, momentum=None)
    norm.num_batches_tracked.fill_(6)
    mode = new_fake_mode()
    twin = fake_copy(norm, mode)
    assert int(known_value(twin.num_batches_tracked)) == 6 and known_value(twin.running_mean) is None
    with mode:
        twin(torch.randn(3, 4))  # adds 1, then reads the count
    assert int(known_value(twin.num_batches_tracked)) == 7 and int(norm.num_batches_tracked) == 6
    assert mode.values.reads and mode.values.batch_reads() == ()
