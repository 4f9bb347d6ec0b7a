"""Two frameworks' own loops of `tests/framework_loops/`: `lightning.Trainer`, and diffusers' train_text_to_image.py.

`lightning` fits a LightningModule that wraps a Llama; `diffusers` runs the script's step (without
accelerate) on a UNet beside a frozen VAE and CLIP text encoder, with an EMA copy of the UNet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autoplan import TrainingLoop
from tests.framework_loops import (
    BATCH,
    LEARNING_RATE,
    SEQ,
    STEPS,
    VOCAB,
    WIDTH,
    Case,
    Marker,
    seeded,
    stack_rows,
    token_rows,
)

# -- Lightning --------------------------------------------------------------------------------------------------


def lightning_case() -> Case:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    model = seeded(lambda: LlamaForCausalLM(config))
    rows = token_rows(STEPS * BATCH, seed=4)
    loop_fields = dict(
        keep_outputs=False,  # training_step returns `self.model(**batch).loss`
        zero_grad_set_to_none=True,  # optimizer.zero_grad(): torch's default, set_to_none=True
        loss_in_model=True,
        # the closure runs training_step, then zero_grad, then backward: last step's gradients live through forward
        zero_grad_before_backward=True,
        batches_ahead=1,  # _PrefetchDataFetcher holds the next batch
    )
    return Case("lightning", model, stack_rows(rows[:BATCH]), loop_fields,
                lambda m, steps, counter: run_lightning(m, steps, counter, rows))


def run_lightning(model: nn.Module, steps: int, counter: Marker, rows: list) -> list[float]:
    """lightning.Trainer.fit on a LightningModule whose training_step is `self.model(**batch).loss`."""
    import lightning as L
    from torch.utils.data import DataLoader

    class LitModel(L.LightningModule):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.model = inner

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LEARNING_RATE)

    losses: list[float] = []

    class Marks(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx % trainer.accumulate_grad_batches == 0:  # an optimizer step begins at its first micro-batch
                counter.mark(f"step {batch_idx // trainer.accumulate_grad_batches + 1}")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

        def on_train_end(self, trainer, pl_module):
            counter.mark("end")

    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Marks()])
    trainer.fit(LitModel(model), DataLoader(rows, batch_size=BATCH, shuffle=False))
    return losses


# -- diffusers' train_text_to_image.py --------------------------------------------------------------------------

IMAGE, TEXT_LENGTH, TEXT_WIDTH, DIFFUSION_BATCH = 32, 77, 32, 2


@dataclass(frozen=True)
class Diffusion:
    """What train_text_to_image.py holds beside the UNet: the frozen VAE and text encoder, the noise scheduler."""

    vae: nn.Module
    text_encoder: nn.Module
    scheduler: Any


def diffusion_parts() -> tuple[nn.Module, Diffusion]:
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(block_out_channels=(32, 64), layers_per_block=1, sample_size=IMAGE // 2, in_channels=4,
                                out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=TEXT_WIDTH)
    vae = AutoencoderKL(block_out_channels=(32, 64), in_channels=3, out_channels=3, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)
    text_config = CLIPTextConfig(vocab_size=VOCAB, hidden_size=TEXT_WIDTH, intermediate_size=37, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=TEXT_LENGTH)
    text_encoder = CLIPTextModel(text_config)
    for frozen in (vae, text_encoder):  # as from_pretrained leaves them, and the script freezes them
        frozen.requires_grad_(False).eval()
    return unet, Diffusion(vae, text_encoder, DDPMScheduler(num_train_timesteps=1000))


def diffusion_batches(count: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    return [{"pixel_values": torch.rand(DIFFUSION_BATCH, 3, IMAGE, IMAGE, generator=generator) * 2 - 1,
             "input_ids": torch.randint(0, VOCAB, (DIFFUSION_BATCH, TEXT_LENGTH), generator=generator)}
            for _ in range(count)]


def unet_inputs(parts: Diffusion, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The script's step up to the UNet: latents, noise, timesteps, noisy latents, the text encoder's states."""
    latents = parts.vae.encode(batch["pixel_values"]).latent_dist.sample() * parts.vae.config.scaling_factor
    noise = torch.randn_like(latents)
    timesteps = torch.randint(0, parts.scheduler.config.num_train_timesteps, (latents.shape[0],)).long()
    noisy_latents = parts.scheduler.add_noise(latents, noise, timesteps)
    encoder_hidden_states = parts.text_encoder(batch["input_ids"], return_dict=False)[0]
    return latents, noise, timesteps, noisy_latents, encoder_hidden_states


def diffusers_case() -> Case:
    unet, parts = diffusion_parts()
    batches = diffusion_batches(STEPS)
    with torch.no_grad():
        latents, noise, timesteps, noisy_latents, states = unet_inputs(parts, batches[0])
    trainable = [p for p in unet.parameters() if p.requires_grad]
    # as a person would say it: the frozen VAE and text encoder, the EMA's shadow copy of the UNet (trainable's size),
    # the latents and noise alive through the UNet's forward and backward, the pixels and token ids the step starts from
    kept = TrainingLoop().keeping(parts.vae, parts.text_encoder, *trainable, latents, noise,
                                  *batches[0].values()).kept_on_device_bytes
    loop_fields = dict(
        keep_outputs=True,  # `model_pred = unet(...).sample`: alive through backward and the step
        loss_in_model=False,
        kept_on_device_bytes=kept,
    )
    return Case("diffusers", unet, (noisy_latents, timesteps, states), loop_fields,
                lambda m, steps, counter: run_diffusers(m, steps, counter, parts, batches),
                # the script's loss, against the example step's noise (the loop holds it: kept_on_device_bytes)
                loss_fn=lambda output: F.mse_loss(output.sample.float(), noise.float(), reduction="mean"),
                resident=(parts.vae, parts.text_encoder))


def run_diffusers(unet: nn.Module, steps: int, counter: Marker, parts: Diffusion, batches: list) -> list[float]:
    """train_text_to_image.py's step without accelerate: encode, noise, predict, mse, clip, step, EMA."""
    from diffusers.training_utils import EMAModel

    torch.manual_seed(0)
    unet.train()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=LEARNING_RATE)
    ema_unet = EMAModel(unet.parameters())
    losses = []
    for step, batch in zip(range(steps), batches):
        counter.mark(f"step {step + 1}")
        latents, noise, timesteps, noisy_latents, encoder_hidden_states = unet_inputs(parts, batch)
        model_pred = unet(noisy_latents, timesteps, encoder_hidden_states).sample
        loss = F.mse_loss(model_pred.float(), noise.float(), reduction="mean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        ema_unet.step(unet.parameters())
        losses.append(loss.item())
    counter.mark("end")
    return losses
