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


def test_the_path_is_measured_per_shape_and_row_count_on_cpu_and_remembered(machine_cache, monkeypatch):
    from draftsmith.speculative import calibrate, small_gemm
    from draftsmith.speculative.small_gemm import ALL_ROWS, choice, resolve_mode

    assert resolve_mode("cpu") == "auto" and resolve_mode("cuda") == "off"
    assert resolve_mode("cpu", True) == "on" and resolve_mode("cpu", False) == "off" and resolve_mode("cpu", "on") == "on"
    monkeypatch.setenv("DRAFTSMITH_SMALL_GEMM", "off")
    from draftsmith.speculative.tiny import tiny_model

    assert resolve_mode("cpu") == "off" and SpeculativeDecoder(tiny_model(0, num_layers=1)).small_gemm == "off"
    monkeypatch.setenv("DRAFTSMITH_SMALL_GEMM", "sometimes")
    from draftsmith.speculative.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="DRAFTSMITH_SMALL_GEMM"):
        resolve_mode("cpu")
    monkeypatch.delenv("DRAFTSMITH_SMALL_GEMM")

    measured = []
    route = {1: 2, 2: 2, 3: 4, 5: 5}  # one row computed as two, three as four (zeros added), five as five
    monkeypatch.setattr(small_gemm, "measure", lambda w, working_set: measured.append((tuple(w.shape), working_set)) or route)
    layer = nn.Linear(64, 300)
    assert choice(layer.weight, 3 << 20) == route and choice(nn.Linear(64, 300).weight, 3 << 20) == route
    assert measured == [((300, 64), 4 << 20)]  # once per shape and working set (rounded up to a power of 2 MiB)
    assert choice(layer.weight, 200 << 30) == route and measured[-1] == ((300, 64), small_gemm.COLD_CAP)
    assert "(300, 64)|4 MiB" in machine_cache.read_text()
    monkeypatch.setattr(small_gemm, "_chosen", {})
    monkeypatch.setattr(calibrate, "_memory", {})  # a new process on the machine: reads, does not measure
    assert choice(layer.weight, 3 << 20) == route and len(measured) == 2
    with small_row_linears(layer, mode="auto"):
        assert layer._ds_route == route
        seen, computed = [], []
        real, matmul = nn.functional.linear, torch.matmul
        monkeypatch.setattr(nn.functional, "linear", lambda *a: seen.append(a[0].shape[0]) or real(*a))
        monkeypatch.setattr(torch, "matmul", lambda w, x: computed.append(x.shape[1]) or matmul(w, x))
        for rows in (1, 2, 3, 4, 5, 17):
            x = torch.randn(rows, 64)
            out = layer(x)
            assert out.shape == (rows, 300) and out.is_contiguous()  # row-major, as F.linear's
            torch.testing.assert_close(out, real(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert seen == [4, 17]  # F.linear only where W @ x.T was not measured faster
        assert computed == [2, 2, 4, 5]  # 1 -> 2 and 3 -> 4 rows: the added rows are zeros, cut from the result
    assert "_ds_route" not in vars(layer) and "forward" not in vars(layer)
    monkeypatch.setenv("DRAFTSMITH_CALIBRATE", "0")  # no calibration: the fixed choice
    assert choice(nn.Linear(8, 8).weight) == ALL_ROWS and choice(nn.Linear(8, 8).to(torch.bfloat16).weight) == {}


def test_a_real_measurement_routes_each_row_count_to_as_many_rows_or_more(machine_cache):
    from draftsmith.speculative.small_gemm import MAX_ROWS, measure

    route = measure(nn.Linear(32, 64).weight, 1 << 20, reps=1)
    assert all(1 <= rows <= width <= MAX_ROWS and width >= 2 for rows, width in route.items())


def test_a_plans_timing_cycles_through_the_memory_its_weights_fill(monkeypatch):
    """Timed alone, a weight sits in cache; in a pass it comes back after every other weight. The plan
    times each shape over as many bytes as all its modules' linear weights (tied ones once), up to COLD_CAP."""
    from draftsmith.speculative import small_gemm

    asked = []
    monkeypatch.setattr(small_gemm, "choice", lambda w, working_set: asked.append(working_set) or {2: 2})
    big = nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 1024, bias=False))  # 8 MiB
    small = nn.Linear(16, 16)
    small_gemm.plan(big, small, mode="auto")
    assert set(asked) == {16 << 20}  # 8 MiB + 1 KiB, rounded up to a power of two MiB
    asked.clear()
    tied = nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 1024, bias=False))
    tied[1].weight = tied[0].weight
    small_gemm.plan(tied, mode="auto")
    assert set(asked) == {4 << 20}
    assert small_gemm.working_set_bytes(10**12) == small_gemm.COLD_CAP and small_gemm.working_set_bytes(0) == 1 << 20
    assert small_gemm.signature([]) == "off" and small_gemm.signature(small_gemm.plan(big, mode="on")) != "off"


def test_a_decoder_plans_its_layers_once_and_nested_blocks_keep_the_outer_patch(target):
    from draftsmith.speculative.generate import SpeculativeDecoder

    decoder = SpeculativeDecoder(target, None, small_gemm="on")
    linears = [m for m in target.modules() if type(m) is torch.nn.Linear]
    with decoder.fast_paths():
        plan = decoder._linear_plan
        assert {id(m) for m, _ in plan} == {id(m) for m in linears}
        with decoder.fast_paths():  # nested (eval times passes inside a runtime block): same plan
            assert decoder._linear_plan is plan
        assert all("forward" in vars(m) for m in linears)  # the inner block left the outer's patch
    assert not any("forward" in vars(m) for m in linears)  # restored: the model is plain again
