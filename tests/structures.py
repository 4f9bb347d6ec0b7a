"""The structure zoo: ordinary model shapes a new user brings, each with its by-hand checkpointing.

Every `Structure` builds a small model (seeded, CPU, fp32) and knows what "checkpointing every
block by hand" means for it: the three lines a person would write with
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` around each repeated block, or
`gradient_checkpointing_enable()` where transformers offers it. autoplan's guarantee is measured
against that (`tests/handmade.py`): its lowest peak is never above the by-hand one.

The named structures are the table of issue 11; `tests/generated.py` adds random module trees.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

SEED = 0
WIDTH, HIDDEN, BATCH = 32, 128, 256


@dataclass(frozen=True)
class Structure:
    """A model shape and the blocks a person would checkpoint by hand in it."""

    name: str
    build: Callable[[], tuple[nn.Module, Any]]  # (model, example_inputs), same weights every call
    blocks: Callable[[nn.Module], list[nn.Module]] | None = None  # modules to wrap in checkpoint
    transformers_checkpointing: bool = False  # by hand = model.gradient_checkpointing_enable()
    sequential_segments: Callable[[nn.Module], int] | None = None  # by hand = checkpoint_sequential(n)
    needs_transformers: bool = False
    notes: str = ""
    tags: tuple[str, ...] = field(default_factory=tuple)


def mlp_block(width: int = WIDTH, hidden: int = HIDDEN) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


def _inputs(width: int = WIDTH) -> torch.Tensor:
    return torch.randn(BATCH, width)


# -- ModuleList of Sequential blocks with residual adds -------------------------------------------


class ResidualList(nn.Module):
    def __init__(self, depth: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(mlp_block() for _ in range(depth))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def build_residual_list():
    torch.manual_seed(SEED)
    return ResidualList(), (_inputs(),)


# -- blocks in a ModuleDict, called by key --------------------------------------------------------


class KeyedBlocks(nn.Module):
    def __init__(self, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({f"l{i}": mlp_block() for i in range(depth)})
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        for key in self.layers:
            x = x + self.layers[key](x)
        return self.head(x)


def build_keyed_blocks():
    torch.manual_seed(SEED)
    return KeyedBlocks(), (_inputs(),)


# -- stages of blocks: stages[i].blocks[j] (ConvNeXt / Swin shape) ---------------------------------


class Stage(nn.Module):
    def __init__(self, width_in: int, width: int, depth: int) -> None:
        super().__init__()
        self.downsample = nn.Linear(width_in, width)
        self.blocks = nn.ModuleList(mlp_block(width, 4 * width) for _ in range(depth))

    def forward(self, x):
        x = self.downsample(x)
        for block in self.blocks:
            x = x + block(x)
        return x


class Staged(nn.Module):
    def __init__(self, widths=(32, 48, 64), depths=(2, 3, 2)) -> None:
        super().__init__()
        ins = (WIDTH, *widths[:-1])
        self.stages = nn.ModuleList(Stage(a, b, d) for a, b, d in zip(ins, widths, depths))
        self.head = nn.Linear(widths[-1], 1)

    def forward(self, x):
        for stage in self.stages:
            x = stage(x)
        return self.head(x)


def build_staged():
    torch.manual_seed(SEED)
    return Staged(), (_inputs(),)


# -- VGG-style: one top-level Sequential of conv / BatchNorm / ReLU --------------------------------


def build_vgg():
    torch.manual_seed(SEED)
    layers: list[nn.Module] = []
    channels = 3
    for width, pool in ((8, False), (8, False), (8, False), (8, True), (16, False), (16, False), (16, True), (32, False)):
        layers += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
        if pool:
            layers.append(nn.MaxPool2d(2))
        channels = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10)]
    return nn.Sequential(*layers), (torch.randn(8, 3, 16, 16),)


def _vgg_segments(model: nn.Module) -> int:
    return sum(isinstance(layer, nn.Conv2d) for layer in model)


# -- U-Net with skips, no repeated class ----------------------------------------------------------


def _conv(a: int, b: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(a, b, 3, padding=1), nn.BatchNorm2d(b), nn.ReLU(), nn.Conv2d(b, b, 3, padding=1), nn.ReLU())


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc1, self.enc2 = _conv(3, 8), _conv(8, 16)
        self.bottleneck = _conv(16, 32)
        self.up2, self.dec2 = nn.ConvTranspose2d(32, 16, 2, stride=2), _conv(32, 16)
        self.up1, self.dec1 = nn.ConvTranspose2d(16, 8, 2, stride=2), _conv(16, 8)
        self.out = nn.Conv2d(8, 1, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        b = self.bottleneck(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([self.up2(b), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1))
        return self.out(d1)


def build_unet():
    torch.manual_seed(SEED)
    return UNet(), (torch.randn(4, 3, 32, 32),)


# -- one block applied N times (ALBERT-style weight sharing) ---------------------------------------


class SharedBlock(nn.Module):
    def __init__(self, repeats: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.block = mlp_block()
        self.repeats = repeats
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        x = self.embed(x)
        for _ in range(self.repeats):
            x = x + self.block(x)
        return self.head(x)


def build_shared():
    torch.manual_seed(SEED)
    return SharedBlock(), (_inputs(),)


# -- a mixture of experts written the common eager way: routing decides the shapes ----------------


class EagerMoE(nn.Module):
    """Top-k routing, then per expert `torch.where` on its mask, a gather and `index_add_`.

    The router is a linear layer with a bias, so a test can fix the routing: `route_all_to(0, 1)`
    sends every token to experts 0 and 1 (the most skewed routing); the default input pattern of
    `build_eager_moe(balanced=True)` gives every expert the same number of tokens.
    """

    def __init__(self, width: int = WIDTH, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k, self.experts = top_k, experts
        self.router = nn.Linear(width, experts)
        self.expert = nn.ModuleList(mlp_block(width, 2 * width) for _ in range(experts))

    def forward(self, x):
        weights, chosen = torch.topk(self.router(x).softmax(-1), self.top_k, dim=-1)
        mask = F.one_hot(chosen, self.experts).permute(2, 1, 0)  # (experts, top_k, tokens)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.expert):
            slot, token = torch.where(mask[e])
            out.index_add_(0, token, expert(x.index_select(0, token)) * weights[token, slot, None])
        return out


class EagerMoEModel(nn.Module):
    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EagerMoE() for _ in range(depth))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)

    def route_all_to(self, *experts: int) -> None:
        """Every token to `experts`, whatever its value: the router's weights 0, its bias picks them."""
        with torch.no_grad():
            for layer in self.layers:
                layer.router.weight.zero_()
                layer.router.bias.fill_(-10.0)
                for rank, expert in enumerate(experts):
                    layer.router.bias[expert] = 10.0 - rank


def build_eager_moe(balanced: bool = False):
    """The eager MoE model and a batch; balanced: routers read a pattern in the input that gives each expert
    tokens × top_k / experts tokens (token t goes to experts t mod 4 and t + 1 mod 4)."""
    torch.manual_seed(SEED)
    model, x = EagerMoEModel(), torch.randn(64, WIDTH)
    if balanced:
        tokens = torch.arange(64)
        with torch.no_grad():
            x[:, :4] = 0.0
            x[tokens, tokens % 4] = 100.0
            x[tokens, (tokens + 1) % 4] = 50.0
            for layer in model.layers:
                layer.router.weight.zero_()
                layer.router.weight[:, :4] = 0.1 * torch.eye(4)  # logits 10, 5, 0, 0: more than the layers add
                layer.router.bias.zero_()
    return model, (x,)


# -- transformers, from tiny configs (random weights, nothing downloaded) --------------------------


def _hf(config_class: str, model_class: str, **config):
    import transformers

    torch.manual_seed(SEED)
    return getattr(transformers, model_class)(getattr(transformers, config_class)(**config))


def build_hf_resnet():
    model = _hf("ResNetConfig", "ResNetForImageClassification", embedding_size=8, hidden_sizes=[8, 16], depths=[2, 2], layer_type="basic", num_labels=4)
    return model, {"pixel_values": torch.randn(4, 3, 48, 48)}


def build_hf_convnext():
    model = _hf("ConvNextConfig", "ConvNextForImageClassification", num_stages=2, hidden_sizes=[8, 16], depths=[2, 2], num_labels=4)
    return model, {"pixel_values": torch.randn(4, 3, 48, 48)}


def build_hf_swin():
    model = _hf(
        "SwinConfig", "SwinForImageClassification",
        image_size=32, patch_size=4, embed_dim=8, depths=[2, 2], num_heads=[1, 2], window_size=4, num_labels=4,
    )
    return model, {"pixel_values": torch.randn(4, 3, 32, 32)}


_MOE = dict(
    vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=64,
)


def _tokens() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(SEED))
    return {"input_ids": ids, "labels": ids, "use_cache": False}  # a training step keeps no KV cache


def build_hf_mixtral():
    model = _hf("MixtralConfig", "MixtralForCausalLM", **_MOE, num_local_experts=4, num_experts_per_tok=2)
    return model, _tokens()


def build_hf_qwen2_moe():
    model = _hf(
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM", **_MOE, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
    )
    return model, _tokens()


def _hf_layers(stages_path: str) -> Callable[[nn.Module], list[nn.Module]]:
    def blocks(model: nn.Module) -> list[nn.Module]:
        stages = model.get_submodule(stages_path)
        return [layer for stage in stages for layer in stage.layers]

    return blocks


# -- PyTorch's own layers: self-attention called as attn(h, h, h), stacked LSTMs and RNNs ------------


class TiedSelfAttention(nn.Module):
    """nn.MultiheadAttention blocks called with one tensor as query, key and value (its self-attention
    path runs other ops than three tensors do: recomputation must see one), and a head tied to the embedding."""

    def __init__(self, depth: int = 3, width: int = 48, vocab: int = 100) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.attn = nn.ModuleList([nn.MultiheadAttention(width, 4, batch_first=True) for _ in range(depth)])
        self.norms = nn.ModuleList([nn.LayerNorm(width) for _ in range(depth)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for attn, norm in zip(self.attn, self.norms):
            h = norm(x)
            x = x + attn(h, h, h, need_weights=False)[0]
        return nn.functional.cross_entropy((x @ self.embed.weight.T).flatten(0, 1), ids.flatten())


class StackedRecurrent(nn.Module):
    """nn.LSTM layers with residuals: on the CPU each keeps oneDNN's workspace for backward (`instruments.rnn`).
    With `layer=nn.RNN`, layers torch's selective checkpointing refuses (its tanh cell writes in place)."""

    def __init__(self, depth: int = 4, width: int = 32, layer: type[nn.Module] = nn.LSTM) -> None:
        super().__init__()
        self.layers = nn.ModuleList([layer(width, width, batch_first=True) for _ in range(depth)])
        self.out = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lstm in self.layers:
            x = x + lstm(x)[0]
        return self.out(x)


def build_tied_self_attention():
    torch.manual_seed(0)
    return TiedSelfAttention(), torch.randint(0, 100, (4, 40))


def build_stacked_lstm():
    torch.manual_seed(0)
    return StackedRecurrent(), torch.randn(4, 48, 32)


def build_stacked_rnn():
    torch.manual_seed(0)
    return StackedRecurrent(layer=nn.RNN), torch.randn(4, 48, 32)


STRUCTURES: tuple[Structure, ...] = (
    Structure("ModuleList of residual Sequential blocks", build_residual_list, lambda m: list(m.blocks)),
    Structure("blocks in a ModuleDict, called by key", build_keyed_blocks, lambda m: list(m.layers.values())),
    Structure("stages of blocks (stages[i].blocks[j])", build_staged, lambda m: [b for s in m.stages for b in s.blocks]),
    Structure("VGG-style top-level Sequential", build_vgg, sequential_segments=_vgg_segments),
    Structure("U-Net with skips", build_unet, lambda m: [m.enc1, m.enc2, m.bottleneck, m.dec2, m.dec1]),
    Structure("one block applied N times (shared weights)", build_shared, lambda m: [m.block]),
    Structure("nn.MultiheadAttention as attn(h, h, h), tied head", build_tied_self_attention, lambda m: list(m.attn)),
    Structure("stacked nn.LSTM with residuals", build_stacked_lstm, lambda m: list(m.layers)),
    Structure("stacked nn.RNN (no selective checkpointing)", build_stacked_rnn, lambda m: list(m.layers)),
    Structure("transformers ResNet", build_hf_resnet, _hf_layers("resnet.encoder.stages"), needs_transformers=True),
    Structure("transformers ConvNext", build_hf_convnext, _hf_layers("convnext.encoder.stages"), needs_transformers=True),
    Structure("transformers Swin", build_hf_swin, transformers_checkpointing=True, needs_transformers=True),
    Structure("transformers Mixtral (MoE)", build_hf_mixtral, transformers_checkpointing=True, needs_transformers=True, tags=("moe",)),
    Structure("transformers Qwen2-MoE", build_hf_qwen2_moe, transformers_checkpointing=True, needs_transformers=True, tags=("moe",)),
)


def by_name(name: str) -> Structure:
    return next(s for s in STRUCTURES if s.name == name)
