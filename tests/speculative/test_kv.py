"""KVState: after any rollback, row selection or compaction, each row's cache is exactly the cache of a
fresh forward over the tokens that row kept (same keys and values at the same rotary positions), and
the next token's logits are the fresh model's."""

import pytest
import torch
from transformers import DynamicCache

from draftsmith.speculative import kv as kv_module
from draftsmith.speculative.kv import KVState
from draftsmith.speculative.tiny import tiny_model

TOL = dict(rtol=1e-4, atol=1e-5)  # cached keys and values
LOGITS_TOL = dict(rtol=1e-3, atol=1e-4)  # logits: a padded batch sums in another order than one row alone


@pytest.fixture(scope="module")
def model():
    return tiny_model(0, num_layers=2)


def left_padded(rows):
    """[B, L] tokens and valid mask of token lists, left-padded with holes (token 0)."""
    width = max(len(r) for r in rows)
    tokens = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    valid = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows])
    return tokens, valid


def prefilled(model, prompts):
    state = KVState(model, len(prompts), "cpu")
    state.forward(*left_padded(prompts))
    return state


@torch.no_grad()
def fresh(model, tokens):
    """Per layer ([kv_heads, n, head_dim] keys, values) and [n, V] logits of one unpadded forward."""
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True).logits[0]
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers], logits


def assert_row_is_fresh(model, state, row, kept):
    """Row `row` of `state` holds exactly the cache of a fresh forward over `kept`, in order."""
    assert int(state.lengths[row]) == len(kept)
    assert int(state.mask[row].sum()) == len(kept)
    reference, _ = fresh(model, kept)
    slots = state.mask[row]
    for layer, (keys, values) in zip(state.cache.layers, reference):
        assert layer.keys.shape[2] == state.mask.shape[1]  # one mask entry per cached slot
        torch.testing.assert_close(layer.keys[row][:, slots], keys, **TOL)
        torch.testing.assert_close(layer.values[row][:, slots], values, **TOL)


@torch.no_grad()
def assert_next_logits_are_fresh(model, state, kept_rows, next_tokens):
    """One more token per row: the logits equal a fresh forward over kept + that token."""
    tokens = torch.tensor([[t] for t in next_tokens])
    out = state.forward(tokens, torch.ones_like(tokens, dtype=torch.bool))
    for row, kept in enumerate(kept_rows):
        _, logits = fresh(model, kept + [next_tokens[row]])
        torch.testing.assert_close(out.logits[row, -1], logits[-1], **LOGITS_TOL)


PROMPTS = [[1, 72, 101, 108, 108, 111, 32], [1, 97, 98, 99]]


@torch.no_grad()
def test_chain_rollback_keeps_exactly_the_accepted_prefix(model):
    state = prefilled(model, PROMPTS)
    drafts = torch.tensor([[40, 41, 42, 43], [50, 51, 0, 0]])
    valid = torch.tensor([[True] * 4, [True, True, False, False]])  # row 1 drafted 2: two holes
    state.forward(drafts, valid)
    # Row 0 accepts 2 of 4, row 1 1 of 2.
    state.keep_last(torch.tensor([[True, True, False, False], [True, False, False, False]]))
    kept = [PROMPTS[0] + [40, 41], PROMPTS[1] + [50]]
    for row in range(2):
        assert_row_is_fresh(model, state, row, kept[row])
    # The slots no row kept any more were cropped from the end of the cache.
    assert state.mask.shape[1] == len(PROMPTS[0]) + 2
    assert_next_logits_are_fresh(model, state, kept, [60, 61])


@torch.no_grad()
def test_rejecting_everything_returns_to_the_prefill(model):
    state = prefilled(model, PROMPTS)
    before = [layer.keys.clone() for layer in state.cache.layers]
    state.forward(torch.tensor([[40, 41, 42], [50, 51, 52]]), torch.ones(2, 3, dtype=torch.bool))
    state.keep_last(torch.zeros(2, 3, dtype=torch.bool))
    assert state.lengths.tolist() == [len(p) for p in PROMPTS]
    assert state.mask.shape[1] == len(PROMPTS[0])
    for layer, keys in zip(state.cache.layers, before):
        torch.testing.assert_close(layer.keys, keys, rtol=0, atol=0)
    assert_next_logits_are_fresh(model, state, PROMPTS, [60, 61])


def tree_inputs(trunk, leaves):
    """(depth, sees) of the slots [last, d_1 .. d_D, leaves...]: the trunk is causal, a leaf at depth i
    sees last, d_1 .. d_{i-1} and itself (the layout of speculative/tree.py)."""
    trunk_depth = torch.arange(trunk + 1)
    leaf_depth = torch.tensor(leaves)
    depth = torch.cat([trunk_depth, leaf_depth])
    total = len(depth)
    sees = torch.zeros(total, total, dtype=torch.bool)
    sees[: trunk + 1, : trunk + 1] = trunk_depth[None, :] <= trunk_depth[:, None]
    sees[trunk + 1:, : trunk + 1] = trunk_depth[None, :] < leaf_depth[:, None]
    sees[trunk + 1:, trunk + 1:] = torch.eye(len(leaves), dtype=torch.bool)
    return depth, sees


@torch.no_grad()
def test_tree_rollback_keeps_exactly_the_accepted_path(model):
    """Slots [last, d1, d2, d3, leaf@1, leaf@2]: row 0 keeps last, d1 and the depth-2 leaf (d2 rejected);
    row 1 keeps last and the depth-1 leaf. Each kept cache, and the logits at the kept slots, are those
    of a plain forward over exactly the kept path: no rejected sibling leaks into it."""
    state = prefilled(model, PROMPTS)
    last = [32, 99]
    tokens = torch.tensor([[last[0], 40, 41, 42, 70, 71], [last[1], 50, 51, 52, 80, 81]])
    valid = torch.ones_like(tokens, dtype=torch.bool)
    out = state.forward(tokens, valid, tree=tree_inputs(3, [1, 2]))
    keep = torch.tensor([[True, True, False, False, False, True], [True, False, False, False, True, False]])
    state.keep_last(keep)
    kept = [PROMPTS[0] + [last[0], 40, 71], PROMPTS[1] + [last[1], 80]]
    for row in range(2):
        assert_row_is_fresh(model, state, row, kept[row])
        _, logits = fresh(model, kept[row])
        path = keep[row].nonzero()[:, 0]
        torch.testing.assert_close(out.logits[row, path], logits[-len(path):], **LOGITS_TOL)
    assert_next_logits_are_fresh(model, state, kept, [60, 61])


@torch.no_grad()
def test_select_rows_keeps_each_chosen_row_whole(model):
    prompts = [[1, 72, 101, 108, 108, 111, 32, 119, 111], *PROMPTS]  # row 0 is the longest
    state = prefilled(model, prompts)
    state.forward(torch.tensor([[40, 41], [50, 51], [60, 0]]), torch.tensor([[True, True], [True, True],
                                                                          [True, False]]))
    state.keep_last(torch.tensor([[True, False], [True, True], [True, False]]))
    kept = [prompts[0] + [40], prompts[1] + [50, 51], prompts[2] + [60]]
    state.select_rows(torch.tensor([2, 1]))  # the longest row leaves; the order changes
    assert state.batch_size == 2
    assert state.lengths.tolist() == [len(kept[2]), len(kept[1])]
    assert_row_is_fresh(model, state, 0, kept[2])
    assert_row_is_fresh(model, state, 1, kept[1])
    assert_next_logits_are_fresh(model, state, [kept[2], kept[1]], [33, 34])


@torch.no_grad()
def test_compaction_packs_the_valid_slots_in_order(model, monkeypatch):
    """Three rows take turns accepting a whole draft of 8 while the others accept 1: every row gathers
    holes, and once holes fill most of the cache it is compacted; each row still holds exactly the
    tokens it kept, at their positions."""
    monkeypatch.setattr(kv_module, "COMPACT_MIN_SLOTS", 32)  # reached in a few rounds
    prompts = [[1, 72, 101, 108, 108, 111, 32, 119, 111], *PROMPTS]
    state = prefilled(model, prompts)
    kept = [list(p) for p in prompts]
    compactions = 0
    for step in range(9):
        tokens = torch.tensor([[40 + 50 * row + i for i in range(8)] for row in range(3)])
        state.forward(tokens, torch.ones_like(tokens, dtype=torch.bool))
        accepted = [8 if row == step % 3 else 1 for row in range(3)]
        keep = torch.tensor([[i < n for i in range(8)] for n in accepted])
        slots_before = state.mask.shape[1]
        state.keep_last(keep)
        if state.mask.shape[1] < slots_before:  # only a compaction shrinks a cache whose last slot is kept
            compactions += 1
            assert state.mask.shape[1] == int(state.lengths.max())
        for row in range(3):
            kept[row] += tokens[row, : accepted[row]].tolist()
            assert_row_is_fresh(model, state, row, kept[row])
    assert compactions >= 1
    assert_next_logits_are_fresh(model, state, kept, [60, 61, 62])


@torch.no_grad()
def test_rows_join_a_cache_that_lost_every_slot(model):
    """A drafter's cache where the only rows with slots leave and the rest hold none (rows that joined
    while the batch decoded plainly: nothing fed yet) is trimmed to zero slots, its layers still shaped
    for the old batch; when another row joins, the next forward runs at the new batch size."""
    state = prefilled(model, [[1, 2, 3], [4, 5]])
    state.keep_last(torch.tensor([[True] * 3, [False] * 3]))  # row 1 holds no slot
    state.select_rows(torch.tensor([1]))  # row 0 leaves: zero slots wide
    state.append_rows(KVState(model, 1, "cpu"))  # a new row, nothing prefilled yet
    assert state.batch_size == 2
    assert all(layer.keys.shape[0] == 2 for layer in state.cache.layers if layer.is_initialized)
    logits = state.forward(*left_padded([[6, 7], [8]])).logits
    for row, tokens in enumerate([[6, 7], [8]]):
        torch.testing.assert_close(logits[row, -1], fresh(model, tokens)[1][-1], **LOGITS_TOL)


@torch.no_grad()
def test_rows_leave_a_cache_that_holds_no_slot(model):
    """Rows leaving a cache trimmed to zero slots (a drafter whose batch has drafted nothing yet) leave its
    layers too: the next forward runs at the smaller batch size."""
    state = prefilled(model, [[1, 2, 3], [4, 5], [6]])
    state.keep_last(torch.zeros(3, 3, dtype=torch.bool))  # every slot rolled back: zero slots wide
    state.select_rows(torch.tensor([2]))
    assert state.batch_size == 1
    assert all(layer.keys.shape[0] == 1 for layer in state.cache.layers if layer.is_initialized)
    logits = state.forward(*left_padded([[7, 8]])).logits
    torch.testing.assert_close(logits[0, -1], fresh(model, [7, 8])[1][-1], **LOGITS_TOL)


def test_a_pass_keeps_only_the_hidden_states_it_is_asked_for():
    """`output_hidden_states=[...]` (what the decoder asks for: its proposer's layers) gives the same
    tensors at those indices as keeping every layer's, negative indices included, and None elsewhere."""
    from draftsmith.speculative.kv import KVState
    from draftsmith.speculative.proposers import left_pad
    from draftsmith.speculative.tiny import tiny_model

    model = tiny_model(0, num_layers=4).eval()
    tokens, valid = left_pad([[1, 5, 9, 12, 7], [3, 4]], "cpu")
    with torch.inference_mode():
        every = KVState(model, 2, torch.device("cpu")).forward(tokens, valid, output_hidden_states=True)
        some = KVState(model, 2, torch.device("cpu")).forward(tokens, valid, output_hidden_states=[1, 3, -1])
    assert len(some.hidden_states) == len(every.hidden_states) == 5
    for i in (1, 3, 4):
        assert torch.equal(some.hidden_states[i], every.hidden_states[i])
    assert some.hidden_states[0] is None and some.hidden_states[2] is None
    assert torch.equal(some.logits, every.logits)
