"""train.time_budget_min: the steps that fit the budget, and the cosine schedule ending there."""

from types import SimpleNamespace

import pytest
import torch

from draftsmith.train.config import load_recipe
from draftsmith.train.loop import TrainerState, cosine_with_warmup, steps_within_budget, total_steps


def test_the_schedule_is_transformers_cosine_with_warmup():
    from transformers import get_cosine_schedule_with_warmup

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    reference = get_cosine_schedule_with_warmup(optimizer, 5, 40)
    for step in range(41):
        assert cosine_with_warmup(step, 5, 40) == pytest.approx(reference.lr_lambdas[0](step), abs=1e-12)
    assert cosine_with_warmup(40, 5, 40) == 0.0 and cosine_with_warmup(5, 5, 40) == 1.0
    assert cosine_with_warmup(45, 5, 40) == 0.0  # past the end it stays at zero (Transformers' climbs back)


def test_the_steps_that_fit_count_the_evaluations_and_leave_out_the_first_steps():
    recipe = load_recipe("tiny-eagle", ["train.steps=1000", "train.time_budget_min=1", "train.eval_every=50"])
    one = SimpleNamespace(num_processes=1)
    # The evaluation before training 5 s, then 10 steps in 10 s, the first 2 of them 2 s (one-off costs): 1 s a
    # step after; an evaluation every 50 steps (0.1 s a step) and one at the end: (60 - 15 - 5) / 1.1 = 36 more.
    state = TrainerState(step=10, train_seconds=10.0, loop_seconds=15.0, eval_seconds=5.0)
    assert steps_within_budget(recipe, state, (2, 2.0), one) == 46
    assert steps_within_budget(recipe, state, None, one) == 46  # (a resumed run: the mean over all steps)
    roomy = load_recipe("tiny-eagle", ["train.steps=30", "train.time_budget_min=60"])
    assert steps_within_budget(roomy, state, (2, 2.0), one) == 30  # never more than train.steps
    # The first 2 steps took 10 s: spent, but not what a step costs from then on ((60 - 23 - 5) / 1.1 = 29 more).
    slow_start = TrainerState(step=10, train_seconds=18.0, loop_seconds=23.0, eval_seconds=5.0)
    assert steps_within_budget(recipe, slow_start, (2, 10.0), one) == 39
    spent = TrainerState(step=10, train_seconds=10.0, loop_seconds=120.0, eval_seconds=5.0)
    assert steps_within_budget(recipe, spent, (2, 2.0), one) == 10  # over budget already: stop here
    assert total_steps(recipe, TrainerState()) == 1000 and total_steps(recipe, TrainerState(planned_steps=50)) == 50


def test_the_budget_is_checked():
    from draftsmith.speculative.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="time_budget_min"):
        load_recipe("tiny-eagle", ["train.time_budget_min=0"])
