"""Traces from recorded workloads: the Azure LLM inference trace 2023 and a generic CSV.

Azure LLM 2023 (``TIMESTAMP, ContextTokens, GeneratedTokens``; one row per request to a
production code-completion or conversation service). It records when model calls arrive and
how big they are, but not what an agent did with a sandbox, so the mapping is a choice:

- Each request starts one episode, acquired at its TIMESTAMP less the earliest TIMESTAMP in
  the file (the first row in the published files), so the trace starts at 0 and keeps the
  real, bursty arrival process.
- The request is read as the latest turn of a multi-turn agent, whose context holds the turns
  so far: the episode has ``ceil(ContextTokens / context_tokens_per_step)`` steps (at least
  one), default 500 tokens of prompt, action and tool output per turn.
- Every step is like this turn: the model thinks for ``GeneratedTokens / decode_tokens_per_s``
  (default 50 tokens/s, one decode stream of a batched server; prefill is left out as small
  next to decode), then a tool runs for ``exec_s_per_step`` (default 2 s).

With the defaults an episode holds its sandbox ~9 s at the median in the code trace and
~16 s in the conversation trace (~30 and ~95 sandboxes busy on average, ~340 and ~150 at
peak); raise ``exec_s_per_step`` for tool-heavier agents.

Generic CSV: a header row, then one row per episode with an arrival time and a lifetime in
seconds (column names given). Arrivals are taken relative to the earliest one; each lifetime
is cut into think and exec steps as the generators do (``bench.steps.split_lifetime``),
seeded.

Both importers keep file order for episode ids (``{id_prefix}1`` is the first data row),
return episodes sorted by arrival, read only the first ``limit`` data rows when it is given,
and multiply every time by ``time_scale``. Bad data raises :class:`TraceError` naming the file
and line (the header is line 1).
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from itertools import islice
from pathlib import Path
from typing import TypeVar

from pydantic import ValidationError

from bench.steps import (
    DEFAULT_EXEC_SHARE,
    DEFAULT_MEAN_STEP_S,
    require,
    require_fraction,
    require_non_negative,
    require_positive,
    split_lifetime,
)
from dsec.trace import Episode, Step, TraceError

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

Value = TypeVar("Value")


def _rows(
    csv_path: str | Path, columns: tuple[str, ...], limit: int | None
) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, row) for the first ``limit`` data rows, once the columns are checked."""
    require(limit is None or limit > 0, f"limit must be > 0, got {limit}")
    try:
        with open(csv_path, newline="", encoding="utf-8") as file:
            reader = csv.DictReader(file)
            if reader.fieldnames is None:
                raise TraceError(csv_path, None, "empty file: expected a header row")
            missing = [column for column in columns if column not in reader.fieldnames]
            if missing:
                raise TraceError(
                    csv_path,
                    1,
                    f"missing column(s) {', '.join(missing)}; "
                    f"the header has {', '.join(reader.fieldnames)}",
                )
            for row in islice(reader, limit):
                yield reader.line_num, row
    except OSError as error:
        raise TraceError(csv_path, None, f"cannot read: {error.strerror}") from error
    except UnicodeDecodeError as error:
        raise TraceError(csv_path, None, f"not UTF-8 text ({error.reason})") from error


def _field(
    csv_path: str | Path,
    line: int,
    row: dict[str, str],
    column: str,
    parse: Callable[[str], Value],
    expected: str,
) -> Value:
    """A column's value parsed, or a TraceError naming the row and what was expected."""
    text = row[column]
    try:
        return parse((text or "").strip())
    except ValueError:
        raise TraceError(csv_path, line, f"{column}: expected {expected}, got {text!r}") from None


def _epoch_seconds(text: str) -> float:
    moment = datetime.fromisoformat(text)
    # Naive times are read as UTC: local time would bend arrivals across a DST change.
    return moment.replace(tzinfo=moment.tzinfo or UTC).timestamp()


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def _non_negative_finite(text: str) -> float:
    value = _finite(text)
    if value < 0:
        raise ValueError(text)
    return value


def _episodes(
    csv_path: str | Path,
    rows: list[tuple[int, float, list[Step]]],
    time_scale: float,
    pool: str,
    template: str,
    priority: int,
    id_prefix: str,
) -> list[Episode]:
    """Episodes from (line, arrival, steps) rows, arrivals rebased to the earliest and scaled."""
    if not rows:
        raise TraceError(csv_path, None, "no data rows")
    origin = min(arrival for _, arrival, _ in rows)
    episodes = []
    for number, (line, arrival, steps) in enumerate(rows, start=1):
        try:
            episodes.append(
                Episode(
                    episode=f"{id_prefix}{number}",
                    arrival_s=(arrival - origin) * time_scale,
                    pool=pool,
                    template=template,
                    priority=priority,
                    steps=steps,
                )
            )
        except ValidationError as error:
            raise TraceError.from_validation(csv_path, line, error) from None
    episodes.sort(key=lambda episode: episode.arrival_s)
    return episodes


def import_azure_llm(
    csv_path: str | Path,
    *,
    decode_tokens_per_s: float = 50.0,
    context_tokens_per_step: float = 500.0,
    exec_s_per_step: float = 2.0,
    limit: int | None = None,
    time_scale: float = 1.0,
    pool: str = "default",
    template: str = "base",
    priority: int = 0,
    id_prefix: str = "e",
) -> list[Episode]:
    """One episode per request of an Azure LLM 2023 CSV, mapped as the module docstring says."""
    require_positive("time_scale", time_scale)
    require_positive("decode_tokens_per_s", decode_tokens_per_s)
    require_positive("context_tokens_per_step", context_tokens_per_step)
    require_non_negative("exec_s_per_step", exec_s_per_step)

    rows = []
    for line, row in _rows(csv_path, AZURE_COLUMNS, limit):
        arrival = _field(csv_path, line, row, "TIMESTAMP", _epoch_seconds, "a date and time")
        context = _field(
            csv_path, line, row, "ContextTokens", _non_negative_int, "a whole number >= 0"
        )
        generated = _field(
            csv_path, line, row, "GeneratedTokens", _non_negative_int, "a whole number >= 0"
        )
        step = Step(
            think_s=generated / decode_tokens_per_s * time_scale,
            exec_s=exec_s_per_step * time_scale,
        )
        rows.append((line, arrival, [step] * max(1, math.ceil(context / context_tokens_per_step))))
    return _episodes(csv_path, rows, time_scale, pool, template, priority, id_prefix)


def import_csv(
    csv_path: str | Path,
    arrival_col: str = "arrival_s",
    duration_col: str = "duration_s",
    *,
    mean_step_s: float = DEFAULT_MEAN_STEP_S,
    exec_share: float = DEFAULT_EXEC_SHARE,
    seed: int = 0,
    limit: int | None = None,
    time_scale: float = 1.0,
    pool: str = "default",
    template: str = "base",
    priority: int = 0,
    id_prefix: str = "e",
) -> list[Episode]:
    """One episode per row of (arrival seconds, lifetime seconds), cut into steps seeded."""
    require_positive("time_scale", time_scale)
    require_positive("mean_step_s", mean_step_s)
    require_fraction("exec_share", exec_share)

    rng = random.Random(seed)
    rows = []
    for line, row in _rows(csv_path, (arrival_col, duration_col), limit):
        arrival = _field(csv_path, line, row, arrival_col, _finite, "a number of seconds")
        duration = _field(
            csv_path, line, row, duration_col, _non_negative_finite, "a number of seconds >= 0"
        )
        steps = split_lifetime(rng, duration * time_scale, mean_step_s * time_scale, exec_share)
        rows.append((line, arrival, steps))
    return _episodes(csv_path, rows, time_scale, pool, template, priority, id_prefix)
