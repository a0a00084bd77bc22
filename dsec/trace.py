"""The trace format: JSON Lines, one episode per line.

    {"episode": "e1", "arrival_s": 0.0, "pool": "train", "template": "base", "priority": 0,
     "steps": [{"think_s": 2.5, "exec_s": 0.8}, ...]}

Replay acquires a sandbox at ``arrival_s``, then for every step waits ``think_s`` (the model
thinking; the sandbox is idle) and runs a command that takes ``exec_s``, then releases it.

Loading is strict: unknown fields, strings where numbers belong, negative or non-finite times
and duplicate episode ids are refused with a :class:`TraceError` naming the file and line.
Times are kept to the microsecond: finer is below anything replay can honour, and it keeps
generated files short and round-trips exact.
"""

from __future__ import annotations

import contextlib
import gc
import math
from array import array
from collections.abc import Iterable, Iterator, Sequence
from functools import cached_property
from itertools import repeat
from pathlib import Path
from typing import Annotated, Any, overload

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    ValidationError,
    with_config,
)
from pydantic_core import core_schema
from typing_extensions import TypedDict

MAX_STEPS_PER_EPISODE = 100_000
MAX_ID_LENGTH = 256
MAX_NAME_LENGTH = 128


MICROSECOND_DIGITS = 6


def _to_microseconds(seconds: float) -> float:
    return round(seconds, MICROSECOND_DIGITS)


Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False), AfterValidator(_to_microseconds)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_LENGTH)]


class TraceError(ValueError):
    """A trace (or a file being imported as one) is unreadable or invalid at a given line."""

    def __init__(self, path: str | Path, line: int | None, problem: str) -> None:
        self.path = str(path)
        self.line = line
        self.problem = problem
        where = self.path if line is None else f"{self.path} line {line}"
        super().__init__(f"{where}: {problem}")

    @classmethod
    def from_validation(cls, path: str | Path, line: int, error: ValidationError) -> TraceError:
        """Name every problem pydantic found, by field path (``steps.0.think_s``)."""
        problems = []
        for detail in error.errors(include_url=False):
            if detail["type"] == "json_invalid":
                problems.append(f"malformed JSON ({detail['ctx']['error']})")
                continue
            field = ".".join(str(part) for part in detail["loc"])
            message = "unknown field" if detail["type"] == "extra_forbidden" else detail["msg"]
            problems.append(f"{field}: {message}" if field else message)
        return cls(path, line, "; ".join(problems))


class _Strict(BaseModel):
    # strict: a trace that says "2.5" or true where a number belongs is wrong, not coercible.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Step(_Strict):
    """The model thinks for ``think_s`` (sandbox idle), then a tool runs for ``exec_s``."""

    think_s: Seconds
    exec_s: Seconds


@with_config(ConfigDict(extra="forbid", strict=True))
class _StepFields(TypedDict):
    """A step as a trace line writes it, checked as Step is, kept only until its times
    are in their episode's Steps (a dict costs less to make than a model)."""

    think_s: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    exec_s: Annotated[float, Field(ge=0, allow_inf_nan=False)]


class Steps(Sequence[Step]):
    """An episode's steps, as two arrays of seconds. A trace at DSec's scale holds tens
    of millions of steps: as Step models they would take half a kilobyte each, as floats
    in arrays sixteen bytes. Read as a sequence of Step, or by its arrays."""

    __slots__ = ("think_s", "exec_s")

    def __init__(self, think_s: array, exec_s: array) -> None:
        self.think_s, self.exec_s = think_s, exec_s

    @classmethod
    def rounded(cls, think_s: Iterable[float], exec_s: Iterable[float]) -> Steps:
        """Steps of these times, kept to the microsecond (as Step keeps them)."""
        # round itself, mapped: no call of a Python function per time (tens of millions)
        return cls(
            array("d", map(round, think_s, repeat(MICROSECOND_DIGITS))),
            array("d", map(round, exec_s, repeat(MICROSECOND_DIGITS))),
        )

    @classmethod
    def _of_fields(cls, steps: list[_StepFields]) -> Steps:
        return cls.rounded([s["think_s"] for s in steps], [s["exec_s"] for s in steps])

    def __len__(self) -> int:
        return len(self.think_s)

    @overload
    def __getitem__(self, index: int) -> Step: ...
    @overload
    def __getitem__(self, index: slice) -> Steps: ...
    def __getitem__(self, index: int | slice) -> Step | Steps:
        if isinstance(index, slice):
            return Steps(self.think_s[index], self.exec_s[index])
        return Step.model_construct(think_s=self.think_s[index], exec_s=self.exec_s[index])

    def __iter__(self) -> Iterator[Step]:
        for think_s, exec_s in zip(self.think_s, self.exec_s, strict=True):
            yield Step.model_construct(think_s=think_s, exec_s=exec_s)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Steps):
            return self.think_s == other.think_s and self.exec_s == other.exec_s
        if isinstance(other, list | tuple):
            return list(self) == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.think_s.tobytes(), self.exec_s.tobytes()))

    def __repr__(self) -> str:
        return f"Steps({list(self)!r})"

    def as_dicts(self) -> list[dict[str, float]]:
        return [{"think_s": t, "exec_s": e} for t, e in zip(self.think_s, self.exec_s, strict=True)]

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        # a list of steps, checked as Step checks one (the same errors, at steps.N.field),
        # and kept as arrays; Steps and Step models are taken as they are
        from_list = core_schema.no_info_after_validator_function(
            cls._of_fields,
            core_schema.list_schema(
                handler.generate_schema(_StepFields),
                min_length=1,
                max_length=MAX_STEPS_PER_EPISODE,
            ),
        )
        from_python = core_schema.union_schema(
            [
                core_schema.is_instance_schema(cls),
                core_schema.no_info_before_validator_function(_step_models_as_dicts, from_list),
            ],
            mode="left_to_right",
        )
        return core_schema.json_or_python_schema(
            json_schema=from_list,
            python_schema=from_python,
            serialization=core_schema.plain_serializer_function_ser_schema(cls.as_dicts),
        )


def _step_models_as_dicts(value: object) -> object:
    if isinstance(value, list | tuple):
        return [
            {"think_s": v.think_s, "exec_s": v.exec_s} if isinstance(v, Step) else v for v in value
        ]
    return value


class Episode(_Strict):
    """One agent's hold on one sandbox, from acquire at ``arrival_s`` to release."""

    episode: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    arrival_s: Seconds
    pool: Name = "default"
    template: Name = "base"
    priority: int = 0
    steps: Steps

    @cached_property
    def lifetime_s(self) -> float:
        """Time from acquire to release, if the sandbox is handed out at once (worked out
        once: a trace at DSec's scale has millions of steps, and replay asks repeatedly)."""
        return sum(t + e for t, e in zip(self.steps.think_s, self.steps.exec_s, strict=True))

    @property
    def busy_s(self) -> float:
        """Time the sandbox spends executing commands."""
        return sum(self.steps.exec_s)


def load_trace(path: str | Path) -> list[Episode]:
    """Read and validate a trace; episodes come back sorted by arrival (ties in file order)."""
    try:
        with open(path, "rb") as file:
            lines = file.read().splitlines()
    except OSError as error:
        raise TraceError(path, None, f"cannot read trace: {error.strerror}") from error
    episodes: list[Episode] = []
    line_of: dict[str, int] = {}
    with _collector_paused():
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                episode = Episode.model_validate_json(line)
            except ValidationError as error:
                raise TraceError.from_validation(path, number, error) from None
            first = line_of.get(episode.episode)
            if first is not None:
                raise TraceError(
                    path,
                    number,
                    f"duplicate episode id {episode.episode!r} (first on line {first})",
                )
            line_of[episode.episode] = number
            episodes.append(episode)
    if not episodes:
        raise TraceError(path, None, "trace has no episodes")
    episodes.sort(key=lambda episode: episode.arrival_s)
    return episodes


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """No cyclic garbage collection meanwhile, and what was made counted as old. A trace
    is millions of small objects, none of them garbage: left on, the collector would go
    through all those made so far again and again (half the loading time at DSec's
    scale), and through the new ones three times more once they are made."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()  # into the permanent generation, and from there
        gc.unfreeze()  # into the oldest, which is looked at least often
        if enabled:
            gc.enable()


def dump_trace(episodes: Iterable[Episode], path: str | Path) -> None:
    """Write episodes as JSON Lines, every field explicit."""
    with open(path, "w", encoding="utf-8") as file:
        for episode in episodes:
            file.write(episode.model_dump_json())
            file.write("\n")


def scale_trace(episodes: Iterable[Episode], factor: float) -> list[Episode]:
    """Multiply every time (arrivals, think and exec) by ``factor``; < 1 compresses the trace."""
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"time scale must be a finite number > 0, got {factor!r}")
    return [
        Episode(
            **episode.model_dump(exclude={"arrival_s", "steps"}),
            arrival_s=episode.arrival_s * factor,
            steps=Steps.rounded(
                [t * factor for t in episode.steps.think_s],
                [e * factor for e in episode.steps.exec_s],
            ),
        )
        for episode in episodes
    ]
