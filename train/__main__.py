"""`accelerate launch -m draftsmith.train RECIPE [key=value ...]` (also `python -m draftsmith.train`)."""

import sys

from draftsmith.train.cli import main

sys.exit(main())
