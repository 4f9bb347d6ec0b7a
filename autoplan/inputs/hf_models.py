"""Hugging Face transformers models: build them from configs, make their example batches.

    model = autoplan.hf.model_from_config("llama-3-70b")            # on the meta device: no memory
    inputs = autoplan.hf.example_inputs_for(model, batch_size=1, seq_len=2048)
    plan = autoplan.plan(model, "80GB", device="h100-80gb", batch_size=1, seq_len=2048)

`PRESETS` holds the published configs of popular checkpoints (their public config.json values), so
a model can be planned without downloading anything. transformers is an optional dependency
(`pip install autoplan[hf]`): this module imports it only when a function needs it, and the rest of
autoplan recognises a Hugging Face model by duck typing (`config` + `main_input_name`).
"""

from __future__ import annotations

import difflib
import sys
import json
from pathlib import Path
from typing import Any

import torch

from autoplan.errors import MissingExtraError, ModelConfigError, OptionError, OptionTypeError, UnknownModelError
from autoplan.vocabulary.signatures import accepts_argument

# name -> (transformers config class, the checkpoint's public config.json values)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": ("GPT2Config", dict(
        architectures=["GPT2LMHeadModel"], vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
        activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=True)),
    "gpt2-xl": ("GPT2Config", dict(
        architectures=["GPT2LMHeadModel"], vocab_size=50257, n_positions=1024, n_embd=1600, n_layer=48, n_head=25,
        activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=True)),
    "qwen2.5-0.5b": ("Qwen2Config", dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu", use_sliding_window=False, tie_word_embeddings=True)),
    "llama-3.2-1b": ("LlamaConfig", dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192))),
    "llama-3-8b": ("LlamaConfig", dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False)),
    "llama-3-70b": ("LlamaConfig", dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False)),
    "mistral-7b": ("MistralConfig", dict(
        architectures=["MistralForCausalLM"], vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
        sliding_window=4096, rope_theta=10000.0, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False)),
    "qwen2-7b": ("Qwen2Config", dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
        rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu", use_sliding_window=False,
        tie_word_embeddings=False)),
    "bert-base": ("BertConfig", dict(
        architectures=["BertForMaskedLM"], vocab_size=30522, hidden_size=768, num_hidden_layers=12,
        num_attention_heads=12, intermediate_size=3072, max_position_embeddings=512, type_vocab_size=2,
        hidden_act="gelu", layer_norm_eps=1e-12)),
    "t5-base": ("T5Config", dict(
        architectures=["T5ForConditionalGeneration"], vocab_size=32128, d_model=768, d_kv=64, d_ff=3072,
        num_layers=12, num_heads=12, relative_attention_num_buckets=32, feed_forward_proj="relu",
        tie_word_embeddings=True)),
    "vit-base": ("ViTConfig", dict(
        architectures=["ViTForImageClassification"], hidden_size=768, num_hidden_layers=12,
        num_attention_heads=12, intermediate_size=3072, image_size=224, patch_size=16, num_channels=3,
        num_labels=1000)),
}

# Task heads tried, in order, for a config that names no architecture.
_AUTO_HEADS = (
    "AutoModelForCausalLM",
    "AutoModelForSeq2SeqLM",
    "AutoModelForSpeechSeq2Seq",
    "AutoModelForMaskedLM",
    "AutoModelForImageClassification",
    "AutoModel",
)
# A Hugging Face model: transformers' PreTrainedModel, or peft's wrapper of one. Its attributes
# (`model.config`, `model.get_base_model()`) come through nn.Module.__getattr__, which torch types
# `Tensor | Module`, and transformers' own types are not followed (pyproject's mypy section): to the
# checker it is Any, and this name says what the argument is.
HFModel = Any

DEFAULT_SEQ_LEN_CAP = 2048  # seq_len when not given: the config's max positions, at most this


def require_transformers():
    """The transformers module, or MissingExtraError saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise MissingExtraError("Hugging Face models need the transformers package: pip install 'autoplan[hf]'") from None
    return transformers


# The auto classes a snippet loads a checkpoint with, and transformers' table of the model classes
# each loads; the first that lists a class names it (AutoModel, last, loads the bare models).
_AUTO_CLASSES = (
    ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("AutoModelForImageTextToText", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"),
    ("AutoModelForSpeechSeq2Seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
    ("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    ("AutoModelForTokenClassification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"),
    ("AutoModelForQuestionAnswering", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES"),
    ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    ("AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    ("AutoModel", "MODEL_MAPPING_NAMES"),
)


def loader_class(class_name: str) -> str | None:
    """The transformers class a snippet loads a checkpoint of `class_name` with: its auto class
    ("Qwen2ForCausalLM" -> "AutoModelForCausalLM"), else the class itself where transformers exports
    it; None for a model that is not transformers'. A transformers model has imported transformers: a
    report for another model does not pay seconds to import it."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    from transformers.models.auto import modeling_auto
    for auto, table in _AUTO_CLASSES:
        for names in getattr(modeling_auto, table, {}).values():
            if class_name in ((names,) if isinstance(names, str) else names):
                return auto
    return class_name if hasattr(transformers, class_name) else None


def is_hf_model(model: torch.nn.Module) -> bool:
    """A transformers PreTrainedModel, recognised without importing transformers."""
    return hasattr(model, "config") and hasattr(model, "main_input_name") and hasattr(model, "save_pretrained")


def _config_from_spec(spec: str):
    transformers = require_transformers()
    if spec in PRESETS:
        class_name, values = PRESETS[spec]
        return getattr(transformers, class_name)(**values)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.is_file():
        return _config_from_file(transformers, path)
    raise UnknownModelError(
        f"unknown model {spec!r}: expected a preset ({', '.join(PRESETS)}) or the path of a local config.json"
    )


def _config_from_file(transformers, path: Path):
    """A local config.json as transformers' config; anything it rejects is a ModelConfigError saying why."""
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ModelConfigError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(values, dict):
        raise ModelConfigError(f"{path} holds a JSON {type(values).__name__}; a config.json is a JSON object of config values")
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ModelConfigError(f"{path} has no 'model_type'; it is not a transformers config.json")
    known = list(transformers.CONFIG_MAPPING.keys())
    if model_type not in known:
        close = difflib.get_close_matches(str(model_type), known, n=3)
        raise ModelConfigError(f"{path}: transformers {transformers.__version__} knows no model_type {model_type!r}"
                               + (f" (did you mean {', '.join(close)}?)" if close else ""))
    try:
        return transformers.AutoConfig.for_model(model_type, **values)
    except Exception as error:  # noqa: BLE001 - transformers validates with errors of many classes
        raise ModelConfigError(f"{path}: transformers rejects it: {_one_line(error)}") from error


def _one_line(error: BaseException) -> str:
    """transformers' validation errors span lines: one line of at most 300 characters."""
    return " ".join(str(error).split())[:300] or type(error).__name__


def _model_class(config):
    transformers = require_transformers()
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    for head in _AUTO_HEADS:
        try:
            getattr(transformers, head)._model_mapping[type(config)]
        except KeyError:
            continue
        return getattr(transformers, head).from_config
    raise ModelConfigError(f"transformers has no model for config {type(config).__name__}")


def model_from_config(spec: str, *, meta: bool = True) -> torch.nn.Module:
    """A model with random weights from a preset name or a local config.json; nothing is downloaded.

    meta=True builds it on the meta device: parameters have shapes but no memory, which is all
    planning needs (a 70B model takes seconds and no RAM). Such a model can be planned, not trained.
    A config transformers rejects, or cannot build a model from, is a ModelConfigError.
    """
    config = _config_from_spec(spec)
    build = _model_class(config)
    context = torch.device("meta") if meta else torch.device("cpu")
    try:
        with context:
            return build(config)
    except Exception as error:  # noqa: BLE001 - a model's __init__ checks its config (heads divide the width, ...)
        raise ModelConfigError(f"{spec}: transformers cannot build a model from this {type(config).__name__}: {_one_line(error)}") from error


def max_positions(model: torch.nn.Module) -> tuple[int, str] | None:
    """The longest sequence the model's config allows, and the config key that says so (None: no limit)."""
    for key in ("max_position_embeddings", "n_positions", "max_target_positions"):
        value = getattr(model.config, key, None)
        if isinstance(value, int) and value > 0:
            return value, key
    return None


def default_seq_len(model: torch.nn.Module) -> int:
    """The config's maximum positions, capped at DEFAULT_SEQ_LEN_CAP (512 when the config has none)."""
    limit = max_positions(model)
    return min(limit[0], DEFAULT_SEQ_LEN_CAP) if limit else 512


def example_inputs_for(model: torch.nn.Module, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """One training batch for a Hugging Face model, as forward's keyword arguments.

    Text models get `input_ids` (batch_size × seq_len, random tokens), an all-ones `attention_mask`
    and `labels` (the same tokens, so the model computes its own loss); image models get
    `pixel_values` at the config's image size and a class label per image (seq_len is unused);
    speech models get `input_features` of the length the encoder requires and seq_len decoder
    labels. Encoder-decoder text models (T5) get labels of seq_len tokens, from which they make
    their decoder inputs. `labels` are left out when forward takes none.
    """
    if not is_hf_model(model):
        raise OptionTypeError(f"example_inputs_for() takes a transformers model; got {type(model).__name__}")
    if not (isinstance(batch_size, int) and batch_size > 0 and isinstance(seq_len, int) and seq_len > 0):
        raise OptionError(f"batch_size and seq_len must be positive ints; got {batch_size!r}, {seq_len!r}")
    limit = max_positions(model)
    if limit and seq_len > limit[0] and model.main_input_name in ("input_ids", "input_features"):
        raise OptionError(f"a sequence length of {seq_len} is more than {type(model).__name__} takes: at most {limit[0]} "
                          f"positions (config.{limit[1]})")
    config: Any = model.config  # a transformers PretrainedConfig
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None) or 2
    generator = torch.Generator().manual_seed(0)

    def tokens(length: int) -> torch.Tensor:
        return torch.randint(0, vocab, (batch_size, length), generator=generator)

    main = model.main_input_name
    inputs: dict[str, torch.Tensor] = {}
    if main == "input_ids":
        inputs["input_ids"] = tokens(seq_len)
        if accepts_argument(model.forward, "attention_mask", through_kwargs=False):
            inputs["attention_mask"] = torch.ones(batch_size, seq_len, dtype=torch.long)
        labels = inputs["input_ids"]
        if getattr(config, "is_encoder_decoder", False):
            labels = tokens(seq_len)
        if getattr(config, "problem_type", None) is not None or _is_sequence_classifier(model):
            labels = torch.randint(0, max(getattr(config, "num_labels", 2), 1), (batch_size,), generator=generator)
    elif main == "pixel_values":
        size = getattr(config, "image_size", 224)
        size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        channels = getattr(config, "num_channels", 3)
        inputs["pixel_values"] = torch.randn(batch_size, channels, *size, generator=generator)
        labels = torch.randint(0, max(getattr(config, "num_labels", 2), 1), (batch_size,), generator=generator)
    elif main == "input_features":
        frames = 2 * getattr(config, "max_source_positions", 1500)  # the encoder's two convolutions halve it
        inputs["input_features"] = torch.randn(batch_size, config.num_mel_bins, frames, generator=generator)
        labels = tokens(seq_len)
    else:
        raise OptionError(
            f"autoplan cannot make inputs for {type(model).__name__} (main input {main!r}); pass example_inputs="
        )
    if accepts_argument(model.forward, "labels", through_kwargs=False):
        inputs["labels"] = labels
    elif getattr(config, "is_encoder_decoder", False) and accepts_argument(model.forward, "decoder_input_ids", through_kwargs=False):
        inputs["decoder_input_ids"] = labels
    return inputs


def _is_sequence_classifier(model: torch.nn.Module) -> bool:
    return type(model).__name__.endswith(("ForSequenceClassification", "ForImageClassification"))


def training_inputs(model: HFModel, inputs: tuple[tuple, dict]) -> tuple[tuple, dict]:
    """The batch as a training step passes it: no KV cache (training never reads one back).

    A causal LM returns its cache by default, which holds every layer's keys and values until the
    step ends and which torch.export cannot trace; `use_cache=False` is what HF's own Trainer gets
    under gradient checkpointing. Only added when forward takes it and the caller did not set it.
    """
    args, kwargs = inputs
    # a peft wrapper passes use_cache on through **kwargs: ask the model it wraps
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    takes_it = accepts_argument(base.forward, "use_cache", through_kwargs=False) or _passes_to_language_model(base)
    if is_hf_model(model) and "use_cache" not in kwargs and takes_it:
        kwargs = {**kwargs, "use_cache": False}
    return args, kwargs


def stop_training_cache(model: torch.nn.Module) -> bool:
    """Set `use_cache=False` on every config in `model` that says True (a wrapped or multimodal model has
    several); whether one did.

    `model(**batch)` without use_cache reads its config's, and a causal LM's default True builds a KV cache
    in training that holds every layer's keys and values until the outputs are freed (in the common loop,
    through backward). Plans are made without one (`training_inputs`), as HF's Trainer trains. generate()
    passes its GenerationConfig's use_cache, not the model config's, so generation still caches.
    """
    configs = _caching_configs(model)
    for config in configs:
        config.use_cache = False
    return bool(configs)


def caches_in_training(model: torch.nn.Module) -> bool:
    """Whether a config in `model` says use_cache=True: what `stop_training_cache` would change."""
    return bool(_caching_configs(model))


def _caching_configs(model: torch.nn.Module) -> list[Any]:
    """The configs of `model`'s modules that say use_cache=True, each once (submodules share their model's)."""
    configs = {id(config): config for module in model.modules()
               if getattr(config := getattr(module, "config", None), "use_cache", None) is True}
    return list(configs.values())


def _passes_to_language_model(model: HFModel) -> bool:
    """A multimodal model (LLaVA) whose forward passes use_cache on, through **kwargs, to a language model that caches."""
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    return (text is not config and getattr(text, "use_cache", False)
            and accepts_argument(model.forward, "use_cache", through_kwargs=True))
