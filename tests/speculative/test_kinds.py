"""The registry of drafter kinds: lookups, capabilities, and the rule that nothing outside a kind's own
module branches on a drafter's type or kind name."""

import re
from pathlib import Path

import pytest

from draftsmith.speculative import kinds
from draftsmith.speculative.drafters import load_drafter
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.loading import load_model

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("speculative", "data", "train", "eval", "cli", "benchmarks")
# The kinds' own modules (and the registry) are where a kind's type and name may appear.
KIND_MODULES = {"speculative/kinds.py", "speculative/formats.py"} | {  # formats.py: eagle3's engine formats
    m.removeprefix("draftsmith.").replace(".", "/") + ".py" for m in kinds.BUILTIN_MODULES}


@pytest.fixture(scope="module")
def target():
    return load_model("tiny:0:3")


def test_every_builtin_kind_is_registered_under_its_name():
    assert set(kinds.names()) >= {"draft-lm", "early-exit", "medusa", "eagle", "ngram", "lookup"}
    for name in kinds.names():
        assert kinds.get(name).name == name
    assert kinds.names(trainable=True) == sorted(n for n in kinds.names() if kinds.get(n).trainable)
    assert "ngram" in kinds.names(from_spec=True) and "eagle" not in kinds.names(from_spec=True)


def test_an_unknown_kind_is_a_one_line_error_naming_the_known_ones():
    with pytest.raises(InvalidInputError, match="unknown drafter kind 'nope' .*draft-lm"):
        kinds.get("nope")
    assert kinds.find("nope") is None


def test_a_kind_registered_twice_under_one_name_is_refused():
    class Impostor(kinds.DrafterKind):
        name = "ngram"

    with pytest.raises(ValueError, match="registered twice"):
        kinds.register(Impostor)


@pytest.mark.parametrize("spec, kind, weights, shares", [
    ("ngram", "ngram", 0, False),
    ("early-exit:1", "early-exit", 0, True),
    ("ngram:3:2+early-exit:2", "lookup", 0, True),
])
def test_loading_a_spec_names_its_kind_and_the_kind_knows_its_cost(target, spec, kind, weights, shares):
    proposer, source = load_drafter(spec, target)
    assert proposer.kind == kind and source.kind == kind and source.spec == spec
    footprint = kinds.of(proposer).footprint(proposer, target.model)
    assert footprint.weight_bytes == weights
    assert (footprint.kv_bytes_per_token > 0) == shares  # early exit keeps a cache of its own layers
    assert kinds.of(proposer).identity(proposer)["shares_target_weights"] == shares


def test_a_lookup_combination_needs_a_model_drafter_after_the_plus(target):
    with pytest.raises(InvalidInputError, match="after '\\+' comes a model drafter"):
        load_drafter("ngram+ngram", target)


def _sources():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative not in KIND_MODULES:
                yield relative, path.read_text()


def test_nothing_outside_the_kinds_tests_a_drafters_type():
    type_test = re.compile(r"isinstance\([^)]*\b\w*(Proposer|Drafter|Heads|ForTraining)\b")
    found = [f"{name}:{text[:m.start()].count(chr(10)) + 1}" for name, text in _sources()
             for m in type_test.finditer(text)]
    assert not found, f"isinstance on drafter classes outside their kind's module: {found}"


def test_nothing_outside_the_kinds_branches_on_a_kind_name():
    names = "|".join(re.escape(n) for n in kinds.names())
    branch = re.compile(rf"""(==|!=|\bin)\s*[(\[{{]?\s*["']({names})["']""")
    found = [f"{name}:{text[:m.start()].count(chr(10)) + 1}" for name, text in _sources()
             for m in branch.finditer(text)]
    assert not found, f"branches on kind names outside the registry: {found}"
