"""What every script in scripts/ does with a bad argument: one line on stderr naming the value and the fix, exit
status 2, before anything heavy runs (as run.py does with a bad config). argparse's own errors (an unknown option, a
missing value, a type that does not parse) go through the same line instead of its usage block."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


class Parser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose errors are one line (`error: ...; see --help`), exit status 2."""

    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see {Path(self.prog).name} --help)")


def results_folder(path: str | Path) -> Path:
    """A results folder named on the command line: it exists and holds `runs/` (where run.py writes its records);
    else one line naming it. A mistyped folder must not pass for one without matching records."""
    p = Path(path)
    if not p.is_dir():
        fail(f"results folder {str(path)!r} does not exist; name a folder holding runs/ (e.g. experiments/bits)")
    if not (p / "runs").is_dir():
        fail(f"{str(path)!r} holds no runs/ folder: not a results folder (run.py writes <results_dir>/runs/<run>/)")
    return p
