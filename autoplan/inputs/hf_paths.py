"""transformers' value-dependent shortcuts, decided under fake tensors as the real batch decides them.

transformers skips building a (batch, 1, T, T) attention mask when it can read that no token is
padding (`_ignore_causal_mask_sdpa`, `_ignore_bidirectional_mask_sdpa`) or that no sequences are
packed in a row (`find_packed_sequence_indices`); SDPA then runs with `is_causal=True` and, for
grouped-query attention, with `enable_gqa=True` instead of `repeat_kv`. Those reads need values,
which fake tensors do not have, so under fake tensors transformers always builds the mask and
repeats the key/value heads: a different code path from the real run, which saved up to 5% more
for backward in the Llama family (docs/loops.md).

`real_mask_decisions(example_inputs)` answers those questions from the real batch instead, while
autoplan simulates a step: an unpadded batch (every 2-D attention mask in it real and all ones)
and unpacked positions (no position ids in it, or real ones that count up in every row) take the
real run's shortcut. A batch whose values are unknown (meta tensors) keeps transformers' own
answer under fake tensors — the mask is built — so the estimate errs high.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

import torch
from torch._subclasses.fake_tensor import is_fake

from autoplan.vocabulary.tensors import tensors_of


def _known(tensor: torch.Tensor) -> bool:
    return not (tensor.is_meta or is_fake(tensor))


def unpadded(example_inputs: Any) -> bool:
    """Every attention mask the batch passes is real, 2-D and all ones (and there is at least one)."""
    args, kwargs = example_inputs
    masks = [value for key, value in kwargs.items() if key.endswith("attention_mask") and isinstance(value, torch.Tensor)]
    return bool(masks) and all(_known(m) and m.dim() == 2 and bool((m == 1).all()) for m in masks)


def unpacked(example_inputs: Any, find_packed: Callable[[torch.Tensor], Any]) -> bool:
    """The batch passes no position ids (the model counts them up itself), or real ones that are not packed."""
    args, kwargs = example_inputs
    positions = [value for key, value in kwargs.items() if key.endswith("position_ids") and isinstance(value, torch.Tensor)]
    return all(_known(p) and p.dim() == 2 and find_packed(p) is None for p in positions)


@contextlib.contextmanager
def real_mask_decisions(example_inputs: Any) -> Iterator[None]:
    """While it is open, transformers' mask shortcuts on fake tensors decide as on the real batch.

    Does nothing when transformers' masking module is not loaded (not a Hugging Face model).
    """
    masking = sys.modules.get("transformers.masking_utils")
    names = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa", "find_packed_sequence_indices")
    if masking is None or not all(hasattr(masking, name) for name in names) or not tensors_of(example_inputs):
        yield
        return
    originals = {name: getattr(masking, name) for name in names}
    replacements = {}
    if unpadded(example_inputs):
        for name in names[:2]:
            replacements[name] = _without_fake_padding(originals[name])
    if unpacked(example_inputs, originals["find_packed_sequence_indices"]):
        replacements["find_packed_sequence_indices"] = _unpacked_when_fake(originals["find_packed_sequence_indices"])
    for name, function in replacements.items():
        setattr(masking, name, function)
    try:
        yield
    finally:
        for name in replacements:
            setattr(masking, name, originals[name])


def _without_fake_padding(original: Callable) -> Callable:
    """The skip decision with a fake padding mask read as what it is in the real batch: no padding."""

    def decide(padding_mask, *args, **kwargs):
        if isinstance(padding_mask, torch.Tensor) and is_fake(padding_mask):
            padding_mask = None  # all ones: transformers treats None and an all-ones mask alike
        return original(padding_mask, *args, **kwargs)

    return decide


def _unpacked_when_fake(original: Callable) -> Callable:
    def find(position_ids):
        if isinstance(position_ids, torch.Tensor) and is_fake(position_ids):
            return None  # counted up by the model, or checked on the real batch: one sequence per row
        return original(position_ids)

    return find
