"""Two more Trainer cases of `tests/framework_loops/`: what the first two leave out.

- `sft_qwen2_8bit`: trl's SFTTrainer on a 4-bit NF4 Qwen2 with LoRA, bitsandbytes' 8-bit AdamW
  (`optim="adamw_bnb_8bit"`) and 2 micro-batches per optimizer step;
- `trainer_qwen2vl`: transformers' Trainer on a tiny Qwen2-VL, fed by an image-text collator (pixel_values,
  image_grid_thw, input_ids, labels): each example holds two images of different sizes.

Both train through `trainers.run_trainer` and are planned by `autoplan.hf.optimize_for_trainer`, like the others.
"""

from __future__ import annotations

import tempfile

import torch

from tests.framework_loops import ACCUMULATION, LEARNING_RATE, STEPS, WIDTH, Case, TrainerInputs, output_dir
from tests.batch_reading import collate_image_text
from tests.framework_loops.trainers import run_trainer

# bitsandbytes keeps 8-bit state only for tensors of 4096 elements or more (min_8bit_size): at rank 32 the MLP's
# adapters (160 × 32) have 8-bit state, the attention's (64 × 32, 32 × 32) 32-bit state, as small ones do
LORA_RANK = 32
VL_BATCH, VL_TEXT = 2, 40  # Qwen2-VL examples per micro-batch, and text tokens per example besides its image's
VL_GRIDS = ((1, 8, 8), (1, 4, 8))  # the (t, h, w) patch grids of each example's two images
IMAGE_TOKEN, VISION_START, VISION_END = 500, 502, 503


def quantized_qwen2(vocab_size: int, *, layers: int = 2, width: int = WIDTH):
    """A Qwen2 with random weights loaded back 4-bit NF4 (double quantization, bf16 compute),
    as examples/sft_qlora.quantized_llama loads its Llama."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Qwen2Config, Qwen2ForCausalLM

    from examples import sft_qlora

    config = Qwen2Config(vocab_size=vocab_size, hidden_size=width, intermediate_size=2 * width + width // 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=sft_qlora.BATCH * sft_qlora.MAX_LENGTH, pad_token_id=0,
                         eos_token_id=2, bos_token_id=None)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        Qwen2ForCausalLM(config).save_pretrained(folder)
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                          bnb_4bit_compute_dtype=torch.bfloat16)
        return AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization, device_map="cpu")


def qlora_qwen2(vocab_size: int):
    """The 4-bit Qwen2 with LoRA (rank LORA_RANK) on every linear layer, prepared as examples/sft_qlora.qlora_llama
    prepares its Llama."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model = prepare_model_for_kbit_training(quantized_qwen2(vocab_size), use_gradient_checkpointing=False)
    return get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.05,
                                            target_modules="all-linear", task_type="CAUSAL_LM"))


def full_bin_texts(count: int) -> list[str]:
    """`count` texts of examples/sft_qlora.py's sentences, run together and cut at max_length - 1 words: with the
    tokenizer's end-of-sequence token each is one full bin of max_length tokens, so each packed row is as long as
    the row planned (sft_batch). The sentences packed as they are make rows of 120-126 tokens, not 128: the run
    then peaks 2.8% under the plan."""
    from itertools import cycle, islice

    from examples import sft_qlora

    words = cycle(" ".join(sft_qlora.sentences()).split())
    return [" ".join(islice(words, sft_qlora.MAX_LENGTH - 1)) for _ in range(count)]


def sft_qwen2_8bit_case() -> Case:
    """trl's SFTTrainer on a 4-bit NF4 Qwen2 with LoRA: examples/sft_qlora.py's SFTConfig (packing, bf16) with
    bitsandbytes' AdamW8bit and 2 micro-batches per optimizer step."""
    from datasets import Dataset

    from autoplan.inputs.hf_trl import sft_batch
    from examples import sft_qlora

    texts = full_bin_texts(2 * STEPS * ACCUMULATION * sft_qlora.BATCH)
    tokenizer = sft_qlora.word_tokenizer(texts)
    model = qlora_qwen2(len(tokenizer))
    args = sft_qlora.sft_config(output_dir(), STEPS, gradient_checkpointing=False,
                                optim="adamw_bnb_8bit", gradient_accumulation_steps=ACCUMULATION)
    inputs = TrainerInputs(args, Dataset.from_dict({"text": texts}), None, processing_class=tokenizer)
    loop_fields = dict(
        keep_outputs=False,  # SFTTrainer's compute_loss reads its metrics from the outputs, then drops them
        accumulation_steps=ACCUMULATION,
        optimizer_impl="auto",  # bitsandbytes' AdamW8bit, counted from an instance (optimize_for_trainer: "auto")
        grad_scaler=False,  # bf16: no scaler
        loss_in_model=True,
        fetches_whole_step=True,
        batches_ahead=1,  # accelerate's DataLoaderShard holds the next batch
    )
    return Case("sft_qwen2_8bit", model, sft_batch(model, args, sft_qlora.BATCH, sft_qlora.MAX_LENGTH), loop_fields,
                lambda m, steps, counter, args=None: run_trainer(m, steps, counter, inputs, args), trainer=inputs,
                notes=("optim='adamw_bnb_8bit': bitsandbytes' AdamW8bit, as the Trainer builds it",))


def qwen2_vl():
    """A tiny Qwen2-VL with random weights: 2 vision blocks, 2 language layers."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config=dict(vocab_size=512, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]}, bos_token_id=None,
                         eos_token_id=None),  # Qwen2-VL's own ids lie outside this vocabulary
        vision_config=dict(depth=2, embed_dim=32, hidden_size=WIDTH, num_heads=4, mlp_ratio=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=IMAGE_TOKEN, video_token_id=501, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END)
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(config)


def image_text_examples(count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Examples as Qwen2-VL's processor makes them: text and an image, twice, the images of the two sizes of VL_GRIDS
    (each its patches, its grid and its tokens: one per 2×2 merged patches); the images' tokens are not labels.

    Every example is alike in shape, so every batch the shuffled sampler draws is the one planned."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(count):
        ids, kinds = [], []
        for t, h, w in VL_GRIDS:
            image = t * h * w // 4
            text = VL_TEXT // len(VL_GRIDS)
            ids += [torch.randint(0, 400, (text,), generator=generator), torch.tensor([VISION_START]),
                    torch.full((image,), IMAGE_TOKEN), torch.tensor([VISION_END])]
            kinds += [torch.zeros(text + 1, dtype=torch.long), torch.ones(image, dtype=torch.long),
                      torch.zeros(1, dtype=torch.long)]
        input_ids, token_types = torch.cat(ids), torch.cat(kinds)
        patches = sum(t * h * w for t, h, w in VL_GRIDS)
        examples.append({"input_ids": input_ids, "mm_token_type_ids": token_types,
                         "attention_mask": torch.ones_like(input_ids),
                         "labels": input_ids.masked_fill(token_types == 1, -100),
                         "pixel_values": torch.randn(patches, 3 * 2 * 4 * 4, generator=generator),
                         "image_grid_thw": torch.tensor(VL_GRIDS)})
    return examples


def trainer_qwen2vl_case() -> Case:
    """transformers' Trainer on a tiny Qwen2-VL, 2 micro-batches of 2 image-text examples per optimizer step."""
    from transformers import TrainingArguments

    model = qwen2_vl()
    examples = image_text_examples(STEPS * ACCUMULATION * VL_BATCH)
    args = TrainingArguments(output_dir=output_dir(),
                             per_device_train_batch_size=VL_BATCH,
                             gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, learning_rate=LEARNING_RATE,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
                             remove_unused_columns=False)  # the collator reads the image columns
    inputs = TrainerInputs(args, examples, collate_image_text)
    loop_fields = dict(
        keep_outputs=False,  # compute_loss returns outputs["loss"]
        accumulation_steps=ACCUMULATION,
        optimizer_impl="fused",  # optim="adamw_torch_fused", transformers 5's default
        loss_in_model=True,
        fetches_whole_step=True,  # get_batch_samples fetches every micro-batch of the step before its first forward
        batches_ahead=1,  # and accelerate's DataLoaderShard holds the next one
    )
    return Case("trainer_qwen2vl", model, collate_image_text(examples[:VL_BATCH]), loop_fields,
                lambda m, steps, counter, args=None: run_trainer(m, steps, counter, inputs, args), trainer=inputs)
