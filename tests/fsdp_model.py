"""The models and batches tests/apply/test_sharding.py trains, shared by the test and its torchrun worker."""

from __future__ import annotations

import torch

from examples.llama import Llama, LlamaConfig, example_batch

BATCH, SEQ, STEPS = 2, 32, 3  # per rank; three steps so the last is a steady-state one


def tiny_llama() -> tuple[Llama, LlamaConfig]:
    config = LlamaConfig(vocab_size=2048, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=768)
    torch.manual_seed(0)
    return Llama(config), config


def rank_batch(config: LlamaConfig, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return example_batch(config, BATCH, SEQ, seed=100 + rank)


def tiny_qwen2():
    """A transformers Qwen2 (random weights from a config): its output holds logits, which the loop keeps through a step."""
    import transformers

    config = transformers.Qwen2Config(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config)


def qwen2_batch(rank: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 2048, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 + rank))
    return {"input_ids": tokens, "labels": tokens}


def shared_block() -> torch.nn.Module:
    """One block applied six times per forward (ALBERT-style): six call-site units, one set of parameters."""
    from tests.structures import build_shared

    return build_shared()[0]


def shared_batch(rank: int) -> tuple[torch.Tensor]:
    return (torch.randn(256, 32, generator=torch.Generator().manual_seed(100 + rank)),)
