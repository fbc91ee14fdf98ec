"""Tiny random models with a real byte-level tokenizer, built on the fly.

Tests, the tiny recipes and the quickstart's reduced mode need a target that exists without a download.
`tiny_target(seed)` is a 2-4 layer, 64-wide Llama over a 259-token byte-level BPE tokenizer (three
special tokens and the 256 bytes, no merges) with a ChatML chat template like SmolLM2's. Its weights
are random but deterministic in `seed`, so two processes that build `tiny:3` get the same model.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(alphabet):
        vocab[symbol] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def tiny_config(vocab_size: int = 259, num_layers: int = 2, hidden_size: int = 64, **overrides) -> LlamaConfig:
    values = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def tiny_model(seed: int = 0, *, num_layers: int = 2, hidden_size: int = 64, vocab_size: int = 259,
               init_std: float = 0.5, **overrides) -> LlamaForCausalLM:
    """A random Llama, deterministic in `seed`. A large init_std gives peaked, low-entropy next-token
    distributions (more like a trained LM's) instead of the near-uniform ones of a default init."""
    config = tiny_config(vocab_size, num_layers, hidden_size, initializer_range=init_std, **overrides)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    return model.eval()
