"""Progress of a ``kvmove-bench`` run, on stderr, for a person watching a terminal.

The rule: a bar when stderr is a terminal, except when the report is JSON going anywhere but
a terminal (``--json | jq``, ``--json > out.json``), where the run is a script's step and
stays silent. Text reports piped elsewhere keep the bar, since the person still sees stderr.
The bar goes to stderr only, so stdout holds the report alone either way.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator

from tqdm import tqdm

__all__ = ["Progress", "bar", "wanted"]

Progress = Callable[[str], None]


def wanted(args: argparse.Namespace) -> bool:
    """The rule of the module docstring, for a subcommand's parsed ``args``."""
    if not sys.stderr.isatty():
        return False
    return not (getattr(args, "json", False) and not sys.stdout.isatty())


@contextlib.contextmanager
def bar(args: argparse.Namespace, total: int) -> Iterator[Progress]:
    """A ``progress(label)`` callback: each call is one of ``total`` steps, ``label`` naming
    the step just done. Draws nothing unless ``wanted(args)``."""
    if not wanted(args):
        yield lambda label: None
        return
    with tqdm(total=total, file=sys.stderr, unit="step",
              desc=f"kvmove-bench {args.command}") as progress_bar:
        def step(label: str) -> None:
            progress_bar.set_postfix_str(label)
            progress_bar.update()
        yield step
