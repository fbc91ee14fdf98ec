"""A recipe trains from a dataset named `hf:` (a local dataset repository, as no hub is reachable
here), materialised or streamed, with its columns mapped by data.columns."""

import json

import pytest

from draftsmith.speculative.checkpoint import read_drafter_info
from draftsmith.train.cli import main as train_main

pytestmark = pytest.mark.slow

ONE_STEP = ["target=tiny:0", "data.heldout=2", "data.max_new_tokens=4", "train.steps=1", "train.batch_size=2",
            "train.eval_prompts=2", "train.eval_max_new_tokens=4", "tracking.report_to=none", "--no-progress"]


def test_a_recipe_trains_from_a_local_dataset_repository_by_name(dataset_repo, tmp_path):
    out = tmp_path / "run"
    code = train_main(["tiny-draft-lm", f"output_dir={out}", f"data.prompts=[hf:{dataset_repo}]",
                       "data.columns.prompt=query", "data.columns.category=topic", "data.limit=10", *ONE_STEP])
    assert code == 0
    info = read_drafter_info(out / "drafter")
    assert info.recipe["data"]["prompts"] == [f"hf:{dataset_repo}"]
    assert info.recipe["data"]["columns"]["prompt"] == "query"
    assert info.training["steps"] == 1
    regenerated = json.loads(next((out / "data").glob("regen-*/manifest.json")).read_text())
    assert regenerated["settings"]["num_records"] == 8  # data.limit 10, 2 of them held out


def test_a_recipe_trains_from_a_streamed_dataset(dataset_repo, tmp_path):
    out = tmp_path / "run"
    code = train_main(["tiny-draft-lm", f"output_dir={out}", f"data.prompts=[hf:{dataset_repo}:chat]",
                       "data.columns.conversation=dialog", "data.streaming=true", "data.shuffle=true",
                       "data.stream_buffer=4", "data.limit=6", *ONE_STEP])
    assert code == 0
    streamed = json.loads(next((out / "data").glob("stream-*/manifest.json")).read_text())
    assert streamed["complete"] and streamed["settings"]["limit"] == 6 and streamed["settings"]["shuffle_seed"] == 0
    assert json.loads(next((out / "data").glob("regen-*/manifest.json")).read_text())["settings"]["num_records"] == 4


def test_a_recipe_trains_on_fixed_conversations_beside_regenerated_answers(dataset_repo, tmp_path):
    out = tmp_path / "run"
    sources = (f"[{{source: 'hf:{dataset_repo}', columns: {{prompt: query}}, limit: 6}}, "
               f"{{source: 'hf:{dataset_repo}:chat', regenerate: false, columns: {{conversation: dialog}}}}]")
    code = train_main(["tiny-eagle", f"output_dir={out}", f"data.prompts={sources}", "teacher.mode=offline",
                       "teacher.top_k=3", *ONE_STEP])
    assert code == 0
    info = read_drafter_info(out / "drafter")
    assert info.recipe["data"]["prompts"][1]["regenerate"] is False
    assert len(list((out / "data").glob("teacher-*"))) == 2  # one pass over each part, regenerated and fixed
