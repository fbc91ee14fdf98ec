"""The `draftsmith` command: one subcommand per workflow, each in its own module."""

from __future__ import annotations

import argparse
import sys

from draftsmith import __version__
from draftsmith.speculative.errors import DraftsmithError
from draftsmith.speculative.quiet import quiet_libraries


def build_parser() -> argparse.ArgumentParser:
    from draftsmith import eval_cmd, export_cmd, generate_cmd, quickstart, retune_cmd, serve_cmd, train_cmd

    parser = argparse.ArgumentParser(prog="draftsmith", description=__doc__)
    parser.add_argument("--version", action="version", version=f"draftsmith {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (generate_cmd, train_cmd, retune_cmd, eval_cmd, export_cmd, serve_cmd, quickstart):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    quiet_libraries()
    try:
        return int(args.run(args) or 0)
    except DraftsmithError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
