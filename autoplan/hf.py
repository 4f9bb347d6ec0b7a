"""Hugging Face transformers models: build from a preset or config, and infer a training batch.

    model = autoplan.hf.model_from_config("llama-3-70b")            # on the meta device: no memory
    inputs = autoplan.hf.example_inputs_for(model, batch_size=1, seq_len=2048)

transformers is an optional extra (`pip install autoplan[hf]`); this is the public face of
`autoplan.inputs.hf_models`, where the code lives.
"""

from __future__ import annotations

from autoplan.inputs.hf_models import (
    DEFAULT_SEQ_LEN_CAP,
    PRESETS,
    default_seq_len,
    example_inputs_for,
    is_hf_model,
    model_from_config,
    training_inputs,
)

__all__ = [
    "DEFAULT_SEQ_LEN_CAP",
    "PRESETS",
    "default_seq_len",
    "example_inputs_for",
    "is_hf_model",
    "model_from_config",
    "training_inputs",
]
