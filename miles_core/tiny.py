"""The built-in tiny model: a Qwen3-architecture decoder with a character tokenizer.

Saved as a normal Hugging Face directory, so every code path (engine, trainer, export,
registry) treats it exactly like a downloaded model.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3MoeConfig

if TYPE_CHECKING:  # the tokenizer builder must import without pydantic (GPU hosts)
    from miles_core.config import TinyModelConfig

SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHARACTERS = list(string.digits + "+-*=?.,:;()[]{}\\/ _" + string.ascii_letters + "\n")
# Roles become single tokens so that the tiny task's prompts stay ~10 tokens long.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<|pad|>",
        eos_token="<|end|>",
        unk_token="?",
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(shape: TinyModelConfig, out_dir: str | Path) -> Path:
    """Write a randomly initialised tiny Qwen3 + its tokenizer as an HF directory."""
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.hidden_size // shape.num_attention_heads,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    return save_random_model(config, tokenizer, out_dir, shape.seed)


def build_tiny_moe_model(shape: TinyModelConfig, out_dir: str | Path, num_experts: int = 4,
                         experts_per_token: int = 2) -> Path:
    """The tiny model's shape as a Qwen3-MoE (every layer's MLP a set of small experts) + its
    tokenizer: for routing replay and expert parallelism without a downloaded MoE."""
    tokenizer = build_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        moe_intermediate_size=max(shape.intermediate_size // num_experts, 8), num_experts=num_experts,
        num_experts_per_tok=experts_per_token, norm_topk_prob=True, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.hidden_size // shape.num_attention_heads, max_position_embeddings=shape.max_positions,
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, torch_dtype="float32")
    return save_random_model(config, tokenizer, out_dir, shape.seed)


def save_random_model(config: PretrainedConfig, tokenizer, out_dir: str | Path, seed: int) -> Path:
    """Randomly initialise `config` with `seed` and save it with its tokenizer as an HF dir."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return Path(out_dir)
