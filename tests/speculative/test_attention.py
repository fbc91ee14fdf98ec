"""Masked grouped-query attention without copied heads (speculative/attention.py): the same outputs as
Transformers' sdpa, used inside the runtime's passes only, and restored after."""

import pytest
import torch
from torch import nn
from transformers.integrations import sdpa_attention

from draftsmith.speculative import attention
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.kv import KVState, additive_mask
from draftsmith.speculative.options import DecodeOptions
from draftsmith.speculative.tiny import tiny_model


def _module(groups):
    m = nn.Module()
    m.num_key_value_groups = groups
    return m


@pytest.mark.parametrize("bool_mask", [True, False])
@pytest.mark.parametrize("queries", [1, 3])
def test_the_same_outputs_as_transformers_sdpa_without_copying_heads(bool_mask, queries, monkeypatch):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, queries, 16), torch.randn(2, 3, 20, 16), torch.randn(2, 3, 20, 16)
    allowed = torch.rand(2, queries, 20) > 0.3
    allowed[..., -1] = True  # no query row is fully masked
    mask = allowed[:, None] if bool_mask else additive_mask(allowed, torch.float32)
    want, _ = sdpa_attention.sdpa_attention_forward(_module(2), q, k, v, mask, scaling=0.25)
    copies = []
    real = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: copies.append(1) or real(*a))
    got, _ = attention.grouped_sdpa_forward(_module(2), q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape == (2, queries, 6, 16)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert not copies  # one query: sdpa folds the groups into it; several: the kernel takes them as they are


def test_switched_inside_the_runtime_only_and_greedy_output_unchanged(monkeypatch):
    model = tiny_model(0, num_layers=2)
    model.config._attn_implementation = "sdpa"
    calls = []
    real = attention.grouped_sdpa_forward
    monkeypatch.setitem(attention.AttentionInterface._global_mapping, attention.NAME,
                        lambda *a, **kw: calls.append(a[1].shape[2]) or real(*a, **kw))
    plain = SpeculativeDecoder(model, None).generate([[1, 72, 105, 33]], options=DecodeOptions(max_new_tokens=8))
    assert calls and model.config._attn_implementation == "sdpa"  # restored after the call
    calls.clear()
    with torch.inference_mode():
        model(torch.tensor([[1, 72, 105, 33]]))  # outside the runtime: Transformers' own sdpa
    assert not calls
    off = SpeculativeDecoder(model, None, grouped_attention=False)  # the switch disabled: the same tokens
    assert off.generate([[1, 72, 105, 33]], options=DecodeOptions(max_new_tokens=8)).tokens == plain.tokens


def test_a_masked_multi_token_pass_attends_through_it(monkeypatch):
    model = tiny_model(0, num_layers=1)
    model.config._attn_implementation = "sdpa"
    copies = []
    real = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: copies.append(1) or real(*a))
    kv = KVState(model, 1, "cpu")
    prompt = torch.tensor([[1, 72, 105, 33, 40]])
    with torch.inference_mode():
        kv.forward(prompt, torch.ones_like(prompt, dtype=torch.bool))
        tokens, valid = torch.tensor([[9, 10, 11]]), torch.ones(1, 3, dtype=torch.bool)
        want = kv.forward(tokens, valid)
        kv.keep_last(torch.zeros(1, 3, dtype=torch.bool))
        assert copies  # Transformers' sdpa copies the grouped heads under a mask
        copies.clear()
        with attention.grouped_attention(attention.switchable(model)):
            got = kv.forward(tokens, valid)
        assert not copies and model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-5)
