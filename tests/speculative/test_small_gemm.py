"""The W @ x.T path for linear layers over a few rows (speculative/small_gemm.py).

It must compute the same product as F.linear, apply only inside the runtime's calls, and leave the model
as it found it. Greedy equality with the target's own `generate` while it is on is covered by
test_generate_greedy.py, which runs on the CPU where the runtime turns it on by default.
"""

import pytest
import torch
from torch import nn

from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.draft_lm import DraftModelProposer
from draftsmith.speculative.early_exit import EarlyExitProposer
from draftsmith.speculative.small_gemm import MAX_ROWS, small_row_linear, small_row_linears
from draftsmith.speculative.options import DecodeOptions


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 7), (3, 7), (2, 3, 7), (1, MAX_ROWS, 7), (2, MAX_ROWS, 7), (0, 7)])
def test_same_product_as_f_linear(shape, bias):
    torch.manual_seed(0)
    layer = nn.Linear(7, 300, bias=bias)
    x = torch.randn(*shape)
    out = small_row_linear(layer, x)
    assert out.shape == (*shape[:-1], 300)
    torch.testing.assert_close(out, nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_active_only_inside_the_block_and_restored_after_errors():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)))
    linears = [model[0], model[2][0]]
    with small_row_linears(model, model[2]):  # overlapping roots: each layer is patched once
        assert all("forward" in vars(m) for m in linears)
        model(torch.randn(3, 4))
    assert not any("forward" in vars(m) for m in linears)
    with pytest.raises(RuntimeError):
        with small_row_linears(model):
            raise RuntimeError("boom")
    assert not any("forward" in vars(m) for m in linears)
    with small_row_linears(model):
        with small_row_linears(model):  # nested: the inner block must not undo the outer one
            pass
        assert all("forward" in vars(m) for m in linears)
    assert not any("forward" in vars(m) for m in linears)


@pytest.mark.parametrize("small_gemm", [True, False])
def test_runtime_switch(target, random_drafter, small_gemm):
    """Inside generate the target's and the draft model's linears take the path iff it is on; after the
    call both models are plain nn.Linear again, and the outputs agree either way."""
    seen = []
    head = target.get_output_embeddings()
    draft_head = random_drafter.get_output_embeddings()
    hooks = [m.register_forward_pre_hook(lambda m, args: seen.append("forward" in vars(m)))
             for m in (head, draft_head)]
    try:
        decoder = SpeculativeDecoder(target, DraftModelProposer(random_drafter), small_gemm=small_gemm)
        result = decoder.generate([[1, 72, 105, 33, 40]], options=DecodeOptions(max_new_tokens=12, draft_len=3))
    finally:
        for h in hooks:
            h.remove()
    assert seen and all(s == small_gemm for s in seen)
    assert "forward" not in vars(head) and "forward" not in vars(draft_head)
    other = SpeculativeDecoder(target, EarlyExitProposer(target, 1), small_gemm=not small_gemm)
    assert other.generate([[1, 72, 105, 33, 40]], options=DecodeOptions(max_new_tokens=12, draft_len=3)).tokens == result.tokens


def test_the_few_row_path_is_the_default_for_float32_on_cpu_only():
    from draftsmith.speculative.small_gemm import wanted
    from draftsmith.speculative.tiny import tiny_model

    assert wanted("cpu") and wanted("cpu", torch.float32)
    assert not wanted("cpu", torch.bfloat16) and not wanted("cpu", torch.float16)  # oneDNN's own path is faster
    assert not wanted("cuda", torch.float32)
    assert SpeculativeDecoder(tiny_model(0, num_layers=1)).small_gemm
    assert not SpeculativeDecoder(tiny_model(0, num_layers=1).to(torch.bfloat16)).small_gemm
