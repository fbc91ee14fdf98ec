"""`draftsmith train RECIPE [key=value ...]`: the same code as `accelerate launch -m draftsmith.train`."""

from draftsmith.train.cli import add_arguments, run


def register(sub) -> None:
    p = sub.add_parser("train", help="train a drafter from a recipe (resumes from its last checkpoint)")
    add_arguments(p)
    p.set_defaults(run=run)
