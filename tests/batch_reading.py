"""Models whose forward reads the batch's values, or random draws: built here, with the blocks a person
would checkpoint by hand in them (`tests.structures.Structure`).

Generated ones (no transformers): a tower whose patches are split by an image grid in the batch, a
label check and a loss over the labelled positions only (`nonzero`), packed sequences split by
`cu_seqlens`, LayerDrop written both ways (`rand < p` skips; `rand > keep` skips). And tiny
transformers families: Qwen2-VL and LLaVA (images and text), Wav2Vec2 and HuBERT with a CTC head
(LayerDrop, SpecAugment, padded audio).
"""

from __future__ import annotations

import torch
from torch import nn

from tests.structures import Structure

SEED = 0
WIDTH = 32


class AttentionBlock(nn.Module):
    """Self-attention over one sequence and an MLP, residual."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, lengths: list[int] | None = None) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        pieces = zip(*(t.split(lengths) for t in (q, k, v))) if lengths else [(q, k, v)]
        attended = [torch.softmax(a @ b.transpose(-1, -2) / a.shape[-1] ** 0.5, dim=-1) @ c for a, b, c in pieces]
        x = x + torch.cat(attended)
        return x + self.mlp(x)


class GridTower(nn.Module):
    """A vision tower whose images are as large as the batch's grid says: patches split per image."""

    def __init__(self, depth: int = 4, patch: int = 12) -> None:
        super().__init__()
        self.embed = nn.Linear(patch, WIDTH)
        self.blocks = nn.ModuleList(AttentionBlock() for _ in range(depth))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, patches: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        lengths = [int(h * w) for h, w in grid.tolist()]  # a value of the batch
        ids = torch.repeat_interleave(torch.arange(len(lengths)), grid.prod(-1))  # a shape from a value
        x = self.embed(patches)
        for block in self.blocks:
            x = block(x, lengths)
        pooled = torch.zeros(len(lengths), WIDTH).index_add(0, ids, x)
        return self.head(pooled).square().mean()


def build_grid_tower():
    generator = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    grid = torch.tensor([[6, 8], [4, 5], [10, 10]])
    return GridTower(), (torch.randn(int(grid.prod(-1).sum()), 12, generator=generator), grid)


class LabelledOnly(nn.Module):
    """A token model that checks its labels (as a CTC head does) and takes its loss over labelled positions only."""

    def __init__(self, vocab: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, WIDTH)
        self.blocks = nn.ModuleList(AttentionBlock() for _ in range(depth))
        self.out = nn.Linear(WIDTH, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if labels.max() >= self.vocab:
            raise ValueError("labels out of the vocabulary")
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        kept = torch.nonzero(labels.reshape(-1) != -100).squeeze(1)  # as many rows as labelled tokens
        logits = self.out(x.reshape(-1, WIDTH)[kept])
        return nn.functional.cross_entropy(logits, labels.reshape(-1)[kept])


def build_labelled_only():
    generator = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    ids = torch.randint(0, 64, (4, 48), generator=generator)
    labels = ids.clone()
    labels[:, :20] = -100  # a prompt the loss skips
    return LabelledOnly(), {"input_ids": ids, "labels": labels}


class PackedSequences(nn.Module):
    """Several sequences packed into one row, attended one by one as `cu_seqlens` bounds them."""

    def __init__(self, vocab: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, WIDTH)
        self.blocks = nn.ModuleList(AttentionBlock() for _ in range(depth))
        self.out = nn.Linear(WIDTH, vocab)

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        x = self.embed(input_ids[0])
        for block in self.blocks:
            x = block(x, lengths)
        return nn.functional.cross_entropy(self.out(x[:-1]), input_ids[0, 1:])


def build_packed():
    generator = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    cu_seqlens = torch.tensor([0, 40, 64, 130, 160], dtype=torch.int32)
    return PackedSequences(), {"input_ids": torch.randint(0, 64, (1, 160), generator=generator), "cu_seqlens": cu_seqlens}


class LayerDrop(nn.Module):
    """Residual blocks each skipped at random in training, decided on a draw: `rand < p` (transformers'
    LayerDrop) or, with `skip_above`, `rand > keep` (stochastic depth written the other way)."""

    def __init__(self, depth: int = 6, p: float = 0.3, skip_above: bool = False) -> None:
        super().__init__()
        self.p, self.skip_above = p, skip_above
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
                                    for _ in range(depth))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            draw = torch.rand([])
            skip = draw > 1 - self.p if self.skip_above else draw < self.p
            if self.training and skip:
                continue
            x = x + block(x)
        return self.head(x).square().mean()


def build_layerdrop(skip_above: bool = False):
    torch.manual_seed(SEED)
    return LayerDrop(skip_above=skip_above), (torch.randn(256, WIDTH, generator=torch.Generator().manual_seed(SEED)),)


# -- transformers families ----------------------------------------------------------------


def build_qwen2_vl(grids=((1, 16, 16), (1, 8, 12)), text: int = 120):
    """A tiny Qwen2-VL, and a batch of text and two images of other sizes (their grids in the batch)."""
    import transformers

    torch.manual_seed(SEED)
    config = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [4, 4, 8]},
                         max_position_embeddings=2048),
        vision_config=dict(depth=3, embed_dim=64, hidden_size=128, num_heads=4, mlp_ratio=2, patch_size=4, spatial_merge_size=2,
                           temporal_patch_size=2, in_channels=3),
        image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503,
    )
    return transformers.Qwen2VLForConditionalGeneration(config), qwen2_vl_batch(grids, text)


def qwen2_vl_batch(grids=((1, 16, 16), (1, 8, 12)), text: int = 120) -> dict:
    """Image patches, the grid of each image, and text with each image's tokens (a 2×2 merge: a token per 4 patches);
    no KV cache, as in a training step."""
    generator = torch.Generator().manual_seed(SEED)
    grid = torch.tensor(grids)
    ids, kinds = [], []
    for t, h, w in grids:
        image = t * h * w // 4
        ids += [torch.randint(0, 400, (text // len(grids),), generator=generator), torch.tensor([502]),
                torch.full((image,), 500), torch.tensor([503])]
        kinds += [torch.zeros(text // len(grids) + 1, dtype=torch.long), torch.ones(image, dtype=torch.long), torch.zeros(1, dtype=torch.long)]
    input_ids, token_types = torch.cat(ids)[None], torch.cat(kinds)[None]
    labels = input_ids.masked_fill(token_types == 1, -100)
    pixel_values = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4, generator=generator)
    return {"input_ids": input_ids, "mm_token_type_ids": token_types, "attention_mask": torch.ones_like(input_ids),
            "pixel_values": pixel_values, "image_grid_thw": grid, "labels": labels, "use_cache": False}


def collate_image_text(examples: list[dict]) -> dict:
    """An image-text collator: text right-padded to the longest example, image patches and grids concatenated."""
    longest = max(len(example["input_ids"]) for example in examples)

    def padded(key: str, fill: int) -> torch.Tensor:
        return torch.stack([torch.nn.functional.pad(e[key], (0, longest - len(e[key])), value=fill) for e in examples])

    return {"input_ids": padded("input_ids", 0), "mm_token_type_ids": padded("mm_token_type_ids", 0),
            "attention_mask": padded("attention_mask", 0), "labels": padded("labels", -100),
            "pixel_values": torch.cat([e["pixel_values"] for e in examples]),
            "image_grid_thw": torch.cat([e["image_grid_thw"] for e in examples])}


def build_llava():
    """A tiny LLaVA (CLIP vision tower, Llama language model) and two image-text examples."""
    import transformers

    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED)
    vision = transformers.CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                           image_size=32, patch_size=4)
    text = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlavaForConditionalGeneration(
        transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=500, projector_hidden_act="gelu"))
    image_tokens = (32 // 4) ** 2  # the default strategy drops the CLS token
    row = torch.cat([torch.randint(0, 400, (10,), generator=generator), torch.full((image_tokens,), 500),
                     torch.randint(0, 400, (60,), generator=generator)])
    ids = row.repeat(2, 1)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": torch.randn(2, 3, 32, 32, generator=generator),
             "labels": ids.masked_fill(ids == 500, -100), "use_cache": False}  # a training step keeps no KV cache
    return model, batch


def build_ctc(family: str = "Wav2Vec2", freeze_feature_encoder: bool = True):
    """A tiny Wav2Vec2 (or HuBERT) with a CTC head, LayerDrop and SpecAugment, on two clips, one padded."""
    import transformers

    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED)
    config = getattr(transformers, f"{family}Config")(
        vocab_size=32, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
        conv_dim=(32, 32, 32), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, layerdrop=0.1, mask_time_prob=0.05, mask_time_length=2, ctc_loss_reduction="mean",
        pad_token_id=0, feat_extract_norm="layer", do_stable_layer_norm=True,
    )
    model = getattr(transformers, f"{family}ForCTC")(config)
    if freeze_feature_encoder:
        model.freeze_feature_encoder()
    attention_mask = torch.ones(2, 4000, dtype=torch.long)
    attention_mask[1, 3000:] = 0  # the second clip is shorter: padded
    labels = torch.randint(1, 32, (2, 12), generator=generator)
    labels[1, 9:] = -100
    return model, {"input_values": torch.randn(2, 4000, generator=generator), "attention_mask": attention_mask, "labels": labels}


def _layers(path: str):
    return lambda model: list(model.get_submodule(path))


GENERATED: tuple[Structure, ...] = (
    Structure("patches split by an image grid in the batch", build_grid_tower, lambda m: list(m.blocks)),
    Structure("label check and a loss over labelled positions (nonzero)", build_labelled_only, lambda m: list(m.blocks)),
    Structure("packed sequences split by cu_seqlens", build_packed, lambda m: list(m.blocks)),
    Structure("LayerDrop (rand < p skips a block)", build_layerdrop, lambda m: list(m.blocks)),
    Structure("stochastic depth (rand > keep skips a block)", lambda: build_layerdrop(skip_above=True), lambda m: list(m.blocks)),
)

FAMILIES: tuple[Structure, ...] = (
    Structure("transformers Qwen2-VL", build_qwen2_vl, transformers_checkpointing=True, needs_transformers=True),
    Structure("transformers LLaVA", build_llava, transformers_checkpointing=True, needs_transformers=True),
    Structure("transformers Wav2Vec2 CTC", build_ctc, transformers_checkpointing=True, needs_transformers=True),
    Structure("transformers HuBERT CTC, feature encoder trained", lambda: build_ctc("Hubert", False),
              transformers_checkpointing=True, needs_transformers=True),
)
