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


def at_least(args, **least: int) -> None:
    """Each named argument (argparse dest, e.g. new_tokens=2) is None or at least its bound; else one line."""
    for name, bound in least.items():
        v = getattr(args, name)
        if v is not None and v < bound:
            fail(f"--{name.replace('_', '-')} {v}: must be at least {bound}")


def within_model(model: str, lengths: list[int], new_tokens: int, shortest: int = 1) -> None:
    """The model exists (a local path, an installed embedded name or a hub id) and every context length, with the
    `new_tokens` decode steps after it (L + new_tokens - 1 positions), fits the positions its files declare; read
    from its files without loading it (a hub id: only the spelling is checked). One line on the first bad one."""
    from kvq_lab.common.errors import ConfigError
    from kvq_lab.models.loading import check_source
    from kvq_lab.preflight.model import model_facts

    short = [n for n in lengths if n < shortest]
    if short:
        fail(f"--lengths {short[0]}: a context holds at least {shortest} token(s)")
    try:
        check_source({"path": model})
        facts = model_facts(model)
    except ConfigError as e:
        fail(str(e).splitlines()[0].replace("model.path=", "--model "))
    if facts is not None and facts.context:
        most = facts.context - new_tokens + 1
        long = [n for n in lengths if n > most]
        if long:
            fail(f"--lengths {long[0]}: {model} has {facts.context} positions and {new_tokens} decode steps follow the "
                 f"context; use lengths up to {most} (or fewer --new-tokens)")  # fmt: skip
