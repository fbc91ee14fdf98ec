"""Tiny random models with a real byte-level tokenizer, built on the fly.

Tests, the tiny recipes and the quickstart's reduced mode need a target that exists without a download.
`tiny_model(seed)` is a 2-4 layer, 64-wide Llama over a 259-token byte-level BPE tokenizer (three
special tokens and the 256 bytes, no merges) with a ChatML chat template like SmolLM2's. Its weights
are random but deterministic in `seed`, so two processes that build `tiny:3` get the same model.
The `tiny-lm:SEED[:LAYERS]` spec is such a model briefly trained on a generated grammar corpus
(`train_tiny_lm`): the target of the tiny recipes, with text-like structure for drafters to learn.
The `tiny:SEED[:LAYERS]` model spec builds `tiny_model(SEED, num_layers=LAYERS,
attention_scale=TINY_SPEC_ATTENTION_SCALE)`: a target drafters can visibly learn in the tiny recipes.
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


TINY_SPEC_ATTENTION_SCALE = 0.02


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
               init_std: float = 0.5, attention_scale: float = 1.0, **overrides) -> LlamaForCausalLM:
    """A random Llama, deterministic in `seed`. A large init_std gives peaked, low-entropy next-token
    distributions (more like a trained LM's) instead of the near-uniform ones of a default init.
    `attention_scale` < 1 shrinks every attention output projection, so the next token depends mostly
    on the last few tokens: local structure a drafter can learn in seconds, as it would from a real LM
    (a fully random 4-layer model is chaotic in its whole context and barely learnable)."""
    config = tiny_config(vocab_size, num_layers, hidden_size, initializer_range=init_std, **overrides)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    if attention_scale != 1.0:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(attention_scale)
    return model.eval()


# --- a tiny *trained* LM -------------------------------------------------------------------------

_SUBJECTS = ["the cat", "a dog", "my friend", "the teacher", "our team", "the robot", "a small bird", "the old man",
             "this model", "the farmer", "a student", "the river"]
_VERBS = ["sees", "likes", "finds", "builds", "reads", "paints", "follows", "carries", "needs", "opens", "hears", "makes"]
_OBJECTS = ["the red ball", "a long letter", "the green door", "a quiet song", "the big map", "a warm cup of tea",
            "the last train", "a simple plan", "the bright star", "a wooden box", "the blue sky", "a new idea"]
_ENDINGS = ["today.", "every morning.", "in the garden.", "after lunch.", "again and again.", "before the rain.",
            "with great care.", "near the window."]


def grammar_corpus(seed: int, sentences: int = 3000) -> list[str]:
    """Short sentences from a small English grammar: structured text a byte-level LM learns in seconds."""
    g = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    return [f"{pick(_SUBJECTS)} {pick(_VERBS)} {pick(_OBJECTS)} {pick(_ENDINGS)}" for _ in range(sentences)]


def train_tiny_lm(seed: int = 0, *, num_layers: int = 4, steps: int = 200, batch_size: int = 16,
                  length: int = 64) -> LlamaForCausalLM:
    """`tiny_model(seed)` trained on `grammar_corpus(seed)` inside ChatML turns, so that its answers
    have the local structure of real text (a target that drafters can learn, as they would a real LM's).
    About 10 s on 2 CPU cores; `loading` caches the result (spec `tiny-lm:SEED[:LAYERS]`)."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(seed, num_layers=num_layers, init_std=0.02).train()
    text = "".join(f"<|im_start|>user\n{a}<|im_end|>\n<|im_start|>assistant\n{b}<|im_end|>\n"
                   for a, b in zip(grammar_corpus(seed)[::2], grammar_corpus(seed)[1::2]))
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    g = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - length - 1, (batch_size,), generator=g)
        batch = torch.stack([ids[s: s + length] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model.eval()
