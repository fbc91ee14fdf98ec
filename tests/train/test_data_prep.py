"""A run's data: extra sampled answers per prompt beside the main ones, each pass cached on its own, with
an offline teacher read as one over all parts."""

import json

import pytest
import torch

from draftsmith.data.render import render_prompt
from draftsmith.data.self_prompts import write_prompts
from draftsmith.data.teacher import ConcatTeacher
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.loading import load_model
from draftsmith.train.config import load_recipe
from draftsmith.train.data_prep import prepare_data


@pytest.fixture(scope="module")
def target():
    return load_model("tiny:0")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"question {i}: {'ab' * i}"}) + "\n" for i in range(10)))
    return path


def recipe(prompts, cache, *extra):
    return load_recipe("tiny-eagle", [f"data.prompts=[{prompts}]", "data.heldout=2", "data.max_new_tokens=6",
                                      f"data.cache_dir={cache}", "teacher.mode=offline", "teacher.top_k=3",
                                      "target=tiny:0", *extra])


def test_extra_samples_add_sampled_answers_and_share_the_main_pass(target, prompts, tmp_path):
    main = prepare_data(recipe(prompts, tmp_path), target, is_main=True, progress=False)
    both = prepare_data(recipe(prompts, tmp_path, "data.extra_samples=2"), target, is_main=True, progress=False)
    assert len(list(tmp_path.glob("regen-*"))) == 3  # the main pass once, then one per extra sample
    assert len(both.train) == 3 * len(main.train) == 24 and both.heldout_prompts == main.heldout_prompts
    first, second, third = (both.train.select(range(i * 8, i * 8 + 8)) for i in range(3))
    assert first["input_ids"] == main.train["input_ids"]  # the greedy pass is the one cached before
    prompt_parts = [[r[:p] for r, p in zip(part["input_ids"], part["prompt_len"])] for part in (first, second, third)]
    assert prompt_parts[0] == prompt_parts[1] == prompt_parts[2]  # the same prompts, other answers
    assert second["input_ids"] != first["input_ids"] and third["input_ids"] != second["input_ids"]
    assert both.source["extra_samples"] == 2
    assert isinstance(both.teacher, ConcatTeacher) and len(both.teacher) == 24
    for i in (0, 7, 8, 15, 16, 23):  # every row's teacher signals are its own
        item = both.teacher[i]
        ids = torch.tensor(both.train[i]["input_ids"])
        assert item["hidden"].shape[0] == len(ids)
        with torch.no_grad():
            logits = target.model(ids[None]).logits[0]
        assert torch.equal(item["topk_ids"][:, 0], logits.argmax(-1))
    with pytest.raises(IndexError):
        both.teacher[24]


def test_extra_samples_need_regeneration(target, prompts, tmp_path):
    with pytest.raises(InvalidInputError, match="extra_samples needs data.regenerate"):
        prepare_data(recipe(prompts, tmp_path, "data.extra_samples=1", "data.regenerate=false"), target,
                     is_main=True, progress=False)


def test_a_self_source_adds_prompts_the_target_writes(target, prompts, tmp_path):
    data = prepare_data(recipe(prompts, tmp_path, f"data.prompts=[{prompts},self:12]"), target, is_main=True,
                        progress=False)
    written = list(tmp_path.glob("prompts-*"))
    assert len(written) == 1
    kept = write_prompts(target, 12, written[0], seed=0, progress=False)  # what the run used, from its cache
    assert 0 < len(kept) < 12
    assert data.source["records"] + data.source["heldout"] == 10 + len(kept)
    firsts = {tuple(ids[:p]) for ids, p in zip(data.train["input_ids"], data.train["prompt_len"])}
    firsts |= {tuple(p) for p in data.heldout_prompts}
    dropped = data.source["records"] - len(data.train)  # answers with no token left to learn after truncation
    answered = sum(tuple(render_prompt(target.tokenizer, row["messages"])) in firsts for row in kept)
    assert answered >= len(kept) - dropped and answered > 0  # the self-written requests are answered
    assert data.source["prompts"] == [str(prompts), "self:12"]
    with pytest.raises(InvalidInputError, match="self:N"):
        prepare_data(recipe(prompts, tmp_path, "data.prompts=[self:many]"), target, is_main=True, progress=False)


def test_adding_prompts_answers_only_the_new_ones(target, prompts, tmp_path, monkeypatch):
    import draftsmith.data.regenerate as regen_module

    more = tmp_path / "more.jsonl"
    more.write_text("".join(json.dumps({"prompt": f"another question {i}"}) + "\n" for i in range(4)))
    first = prepare_data(recipe(prompts, tmp_path / "cache"), target, is_main=True, progress=False)
    decoded = []
    real_add = regen_module.Engine.add
    monkeypatch.setattr(regen_module.Engine, "add", lambda self, request: (decoded.append(request.prompt),
                                                                          real_add(self, request))[1])
    both = prepare_data(recipe(f"{prompts},{more}", tmp_path / "cache"), target, is_main=True, progress=False)
    known = {tuple(r[:p]) for r, p in zip(first.train["input_ids"], first.train["prompt_len"])}
    rows = [tuple(r[:p]) for r, p in zip(both.train["input_ids"], both.train["prompt_len"])]
    assert len(rows) == 12 and len(decoded) == sum(row not in known for row in rows) < 12
    monkeypatch.undo()
    fresh = prepare_data(recipe(f"{prompts},{more}", tmp_path / "fresh"), target, is_main=True, progress=False)
    assert both.train.to_list() == fresh.train.to_list()  # the same rows as answering every prompt anew


def test_regen_dtype_writes_prompts_and_answers_in_it_and_keeps_the_teacher_exact(target, prompts, tmp_path):
    full = prepare_data(recipe(prompts, tmp_path, f"data.prompts=[{prompts},self:6]"), target, is_main=True,
                        progress=False)
    half = prepare_data(recipe(prompts, tmp_path, f"data.prompts=[{prompts},self:8]", "data.regen_dtype=bfloat16"),
                        target, is_main=True, progress=False)
    manifests = {p.parent.name: json.loads(p.read_text())["settings"] for p in tmp_path.glob("*/manifest.json")}
    regens = sorted(s.get("dtype", "float32") for n, s in manifests.items() if n.startswith("regen-"))
    writes = sorted(s.get("dtype", "float32") for n, s in manifests.items() if n.startswith("prompts-"))
    assert regens == writes == ["bfloat16", "float32"]  # cached apart
    assert half.source["regen_dtype"] == "bfloat16" and full.source["regen_dtype"] == "float32"
    assert all(p.dtype == torch.float32 for p in target.model.parameters())  # the loaded target is untouched
    for i in (0, len(half.train) - 1):  # the teacher is the float32 target's, on the bf16 target's text
        ids = torch.tensor(half.train[i]["input_ids"])
        with torch.no_grad():
            logits = target.model(ids[None]).logits[0]
        assert torch.equal(half.teacher[i]["topk_ids"][:, 0], logits.argmax(-1))


@pytest.mark.parametrize("native", [True, False])
def test_regen_dtype_auto_is_bf16_only_where_the_device_does_bf16_arithmetic(target, prompts, tmp_path, monkeypatch,
                                                                             native):
    import draftsmith.train.data_prep as data_prep

    monkeypatch.setattr(data_prep, "native_bf16", lambda device: native)
    data = prepare_data(recipe(prompts, tmp_path, "data.regen_dtype=auto"), target, is_main=True, progress=False)
    wanted = "bfloat16" if native else "float32"
    assert data.source["regen_dtype"] == wanted
    settings = [json.loads(p.read_text())["settings"] for p in tmp_path.glob("regen-*/manifest.json")]
    assert [s.get("dtype", "float32") for s in settings] == [wanted]
    named = prepare_data(recipe(prompts, tmp_path, f"data.regen_dtype={wanted}"), target, is_main=True,
                         progress=False)
    assert len(list(tmp_path.glob("regen-*"))) == 1  # auto resolved is the same cache as the dtype named
    assert named.train.to_list() == data.train.to_list()


def test_regen_target_casts_each_weight_once_and_leaves_the_loaded_target_alone(target):
    from draftsmith.train.data_prep import regen_target

    cast = regen_target(target, "bfloat16")
    assert regen_target(target, "float32") is target
    loaded = dict(target.model.named_parameters(remove_duplicate=False))
    for name, weight in cast.model.named_parameters(remove_duplicate=False):
        assert weight.dtype == torch.bfloat16 and torch.equal(weight, loaded[name].to(torch.bfloat16))
        assert weight.data_ptr() != loaded[name].data_ptr()
    for (name, buffer), (_, before) in zip(cast.model.named_buffers(), target.model.named_buffers()):
        assert buffer.dtype == (torch.bfloat16 if before.is_floating_point() else before.dtype), name
    tied = [n for n, _ in target.model.named_parameters(remove_duplicate=False)]
    assert len(list(cast.model.parameters())) == len(list(target.model.parameters())) <= len(tied)
    assert all(p.dtype == torch.float32 for p in target.model.parameters())
    assert cast.weight_hash() == target.weight_hash()
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        assert torch.equal(cast.model(ids).logits, copy_cast(target.model)(ids).logits)


def copy_cast(model):
    import copy

    return copy.deepcopy(model).to(torch.bfloat16)


def test_adding_prompts_computes_only_the_new_rows_teacher_signals(target, prompts, tmp_path, monkeypatch, capfd):
    import draftsmith.data.teacher as teacher_module

    more = tmp_path / "more.jsonl"
    more.write_text("".join(json.dumps({"prompt": f"another question {i}"}) + "\n" for i in range(4)))
    first = prepare_data(recipe(prompts, tmp_path / "cache"), target, is_main=True, progress=False)
    computed = []
    real_states = teacher_module.teacher_states
    monkeypatch.setattr(teacher_module, "teacher_states",
                        lambda model, ids, mask, layers: (computed.append(int(mask.sum(1).gt(0).sum())),
                                                          real_states(model, ids, mask, layers))[1])
    capfd.readouterr()
    both = prepare_data(recipe(f"{prompts},{more}", tmp_path / "cache"), target, is_main=True, progress=False)
    known = {tuple(ids) for ids in first.train["input_ids"]}
    new = sum(tuple(ids) not in known for ids in both.train["input_ids"])
    assert 0 < sum(computed) == new < len(both.train)  # the rows the first cache holds are copied
    assert f"{len(both.train) - new} of {len(both.train)} examples copied" in capfd.readouterr().err
    monkeypatch.undo()
    fresh = prepare_data(recipe(f"{prompts},{more}", tmp_path / "fresh"), target, is_main=True, progress=False)
    assert both.train.to_list() == fresh.train.to_list()
    for i in range(len(both.train)):  # the same signals as computing every row
        mine, theirs = both.teacher[i], fresh.teacher[i]
        assert torch.equal(mine["topk_ids"], theirs["topk_ids"])
        for name in ("topk_logprobs", "hidden"):
            assert torch.allclose(mine[name], theirs[name], atol=2e-3), name


def test_a_cache_with_fewer_signals_lends_nothing(target, prompts, tmp_path, monkeypatch):
    import draftsmith.data.teacher as teacher_module

    prepare_data(recipe(prompts, tmp_path, "teacher.top_k=2"), target, is_main=True, progress=False)
    computed = []
    real_states = teacher_module.teacher_states
    monkeypatch.setattr(teacher_module, "teacher_states",
                        lambda *args: (computed.append(1), real_states(*args))[1])
    prepare_data(recipe(prompts, tmp_path, "teacher.top_k=3"), target, is_main=True, progress=False)
    assert computed  # top-2 log-probs cannot stand in for top-3
