"""The real embedded default target (SmolLM2-135M-Instruct), fetched once into the cache."""

import pytest
import torch

from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.loading import load_model
from draftsmith.speculative.prompts import encode_prompt, stop_token_ids
from draftsmith.speculative.early_exit import EarlyExitProposer
from draftsmith.speculative.options import DecodeOptions

pytestmark = [pytest.mark.embedded, pytest.mark.slow]  # a 30-layer model decoding on the CPU

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 10 and explain why they are prime.",
]


@pytest.fixture(scope="module")
def smollm2():
    return load_model(None)


def test_early_exit_greedy_equals_plain_greedy(smollm2):
    model, tok = smollm2.model, smollm2.tokenizer
    stops = stop_token_ids(model, tok)
    prompts = [encode_prompt(tok, p, chat=True) for p in PROMPTS]
    plain = []
    for ids in prompts:
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False,
                             eos_token_id=stops, pad_token_id=tok.pad_token_id)
        plain.append(out[0, len(ids):].tolist())
    decoder = SpeculativeDecoder(model, EarlyExitProposer(model, 12), stop_token_ids=stops)
    solo = [decoder.generate([ids], options=DecodeOptions(max_new_tokens=32, draft_len=4)).tokens[0] for ids in prompts]
    assert solo == plain
    batch = decoder.generate(prompts, options=DecodeOptions(max_new_tokens=32, draft_len=4))
    assert batch.tokens == plain
