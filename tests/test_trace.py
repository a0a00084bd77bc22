"""The trace format: validation errors name the line, round trips are exact, scaling."""

import json
from pathlib import Path

import pytest

from dsec.trace import (
    MAX_STEPS_PER_EPISODE,
    Episode,
    Step,
    TraceError,
    dump_trace,
    load_trace,
    scale_trace,
)

GOOD = {"episode": "e1", "arrival_s": 0.0, "steps": [{"think_s": 2.5, "exec_s": 0.8}]}


def write_lines(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def line(**changes: object) -> str:
    return json.dumps({**GOOD, **changes})


def load_error(tmp_path: Path, *lines: str) -> TraceError:
    path = write_lines(tmp_path, *lines)
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    assert str(path) in str(caught.value)
    return caught.value


def test_defaults_and_properties(tmp_path: Path) -> None:
    steps = [{"think_s": 2.5, "exec_s": 0.75}, {"think_s": 1.0, "exec_s": 0.25}]
    [episode] = load_trace(write_lines(tmp_path, line(steps=steps)))
    assert (episode.pool, episode.template, episode.priority) == ("default", "base", 0)
    assert episode.lifetime_s == pytest.approx(4.5)
    assert episode.busy_s == pytest.approx(1.0)


def test_malformed_json_names_the_line_counting_blank_lines(tmp_path: Path) -> None:
    error = load_error(tmp_path, line(), "", '{"episode": "e2", "arrival_s": ')
    assert error.line == 3
    assert "line 3" in str(error) and "malformed JSON" in str(error)


def test_unknown_field_is_named(tmp_path: Path) -> None:
    error = load_error(tmp_path, line(), line(episode="e2", colour="red"))
    assert error.line == 2
    assert "colour: unknown field" in str(error)


def test_unknown_step_field_is_named(tmp_path: Path) -> None:
    error = load_error(tmp_path, line(steps=[{"think_s": 1, "exec_s": 1, "cmd": "ls"}]))
    assert "steps.0.cmd: unknown field" in str(error)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"arrival_s": -1.0}, "arrival_s"),
        (
            {"steps": [{"think_s": 1, "exec_s": 1}, {"think_s": -0.5, "exec_s": 1}]},
            "steps.1.think_s",
        ),
        ({"steps": [{"think_s": 1, "exec_s": 1e400}]}, "steps.0.exec_s"),
        ({"arrival_s": "1.5"}, "arrival_s"),
        ({"priority": True}, "priority"),
        ({"episode": ""}, "episode"),
        ({"pool": ""}, "pool"),
        ({"steps": []}, "steps"),
    ],
)
def test_bad_values_name_the_line_and_field(
    tmp_path: Path, changes: dict[str, object], field: str
) -> None:
    error = load_error(tmp_path, line(episode="e0"), line(**changes))
    assert error.line == 2
    assert f"{field}: " in error.problem


def test_missing_steps_is_named(tmp_path: Path) -> None:
    error = load_error(tmp_path, json.dumps({"episode": "e1", "arrival_s": 0}))
    assert "steps: Field required" in str(error)


def test_non_object_line_is_refused(tmp_path: Path) -> None:
    assert load_error(tmp_path, "[1, 2]").line == 1


def test_too_many_steps_is_refused(tmp_path: Path) -> None:
    steps = [{"think_s": 0, "exec_s": 0}] * (MAX_STEPS_PER_EPISODE + 1)
    assert "steps: " in load_error(tmp_path, line(steps=steps)).problem


def test_duplicate_episode_id_names_both_lines(tmp_path: Path) -> None:
    error = load_error(tmp_path, line(), "", line(episode="e2"), line(arrival_s=5.0))
    assert error.line == 4
    assert "duplicate episode id 'e1' (first on line 1)" in str(error)


def test_empty_and_missing_files(tmp_path: Path) -> None:
    assert "no episodes" in str(load_error(tmp_path, "", "  "))
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "absent.jsonl")


def test_load_sorts_by_arrival_keeping_file_order_for_ties(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path,
        line(episode="late", arrival_s=9.0),
        line(episode="tie-a", arrival_s=1.0),
        line(episode="tie-b", arrival_s=1.0),
    )
    assert [episode.episode for episode in load_trace(path)] == ["tie-a", "tie-b", "late"]


def test_dump_load_round_trip(tmp_path: Path) -> None:
    episodes = [
        Episode(
            episode=f"e{number}",
            arrival_s=number * 0.1,
            pool="eval" if number % 2 else "train",
            template="python",
            priority=number - 2,
            steps=[Step(think_s=1 / 3, exec_s=0.1 + 0.2)] * (number + 1),
        )
        for number in range(5)
    ]
    path = tmp_path / "out.jsonl"
    dump_trace(episodes, path)
    assert load_trace(path) == episodes
    assert '"exec_s":0.3}' in path.read_text()  # kept to the microsecond


def test_scale_trace_multiplies_every_time() -> None:
    episode = Episode(
        episode="e1", arrival_s=10.0, pool="eval", steps=[Step(think_s=4.0, exec_s=2.0)]
    )
    [scaled] = scale_trace([episode], 0.25)
    assert scaled.arrival_s == 2.5
    assert scaled.steps == [Step(think_s=1.0, exec_s=0.5)]
    assert (scaled.episode, scaled.pool) == ("e1", "eval")
    assert scaled.lifetime_s == episode.lifetime_s * 0.25


@pytest.mark.parametrize("factor", [0.0, -1.0, float("inf"), float("nan")])
def test_scale_trace_refuses_bad_factors(factor: float) -> None:
    with pytest.raises(ValueError, match="time scale"):
        scale_trace([], factor)
