"""The shipped recipes stand alone: every one validates, names prompt sets that ship with draftsmith (or
prompts the target writes itself, `self:N`), and nothing in the package, its recipes, benchmarks or tests reads a folder beside the repository."""

from pathlib import Path

import pytest

from draftsmith.data.self_prompts import is_self_spec, self_prompt_count
from draftsmith.data.sources import builtin_path, is_builtin
from draftsmith.train.config import RECIPES_DIR, load_raw_recipe

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_recipe_names_only_shipped_prompt_sets(name):
    raw, _ = load_raw_recipe(name)
    prompts = raw["data"]["prompts"]
    files = [spec for spec in prompts if not is_self_spec(spec)]
    assert files and all(is_builtin(spec) for spec in files), prompts
    for spec in files:
        assert builtin_path(spec).is_file()
    for spec in prompts:
        if is_self_spec(spec):
            assert self_prompt_count(spec) > 0


def test_no_file_refers_to_a_folder_beside_the_repository():
    siblings = ("../" + "shared", '/ "' + 'shared"')  # spelled in parts so that this file does not match itself
    folders = ["cli", "data", "train", "eval", "speculative", "recipes", "benchmarks", "tests"]
    offenders = [str(path.relative_to(ROOT)) for folder in folders for path in (ROOT / folder).rglob("*")
                 if path.suffix in (".py", ".yaml", ".md", ".toml")
                 and any(s in path.read_text(errors="replace") for s in siblings)]
    assert offenders == []
