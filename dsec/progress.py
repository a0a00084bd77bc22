"""Progress bars (tqdm) for the commands that run for more than a few seconds.

Always on stderr, so a `--json` answer on stdout stays clean, and drawn also when stderr
is not a terminal: a log then gets a line at most every LOG_INTERVAL_S rather than
nothing for the twenty minutes a long search takes.
"""

from __future__ import annotations

import sys

from tqdm import tqdm

LOG_INTERVAL_S = 10.0


def progress_bar(
    total: float | None, desc: str, unit: str, *, leave: bool = True, shown: bool = True
) -> tqdm:
    """A bar of `total` `unit`s (None: a count with no end) named `desc`, on stderr; one
    not `shown` (a step inside a command with a bar of its own) counts and draws nothing."""
    terminal = sys.stderr.isatty()
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        leave=leave,
        mininterval=0.1 if terminal else LOG_INTERVAL_S,
        dynamic_ncols=terminal,
        ascii=not terminal,
        disable=not shown,
    )
