"""Parameter sweeps in the simulator: the grid, the Pareto front, the CLI."""

from __future__ import annotations

import json

import pytest

from bench.generate import generate
from bench.sweep import pareto_front, parse_param
from dsec.cli import main
from dsec.trace import dump_trace


def test_the_pareto_front_keeps_what_nothing_beats_on_both():
    rows = [
        {"p99_ms": 10, "sandbox_seconds": 100},
        {"p99_ms": 5, "sandbox_seconds": 200},
        {"p99_ms": 12, "sandbox_seconds": 150},  # beaten by the first on both
        {"p99_ms": 1, "sandbox_seconds": 300},
    ]
    assert pareto_front(rows) == [rows[0], rows[1], rows[3]]


@pytest.mark.parametrize("text", ["warm_fraction", "nope=1,2", "templates=1", "min_warm=a,b"])
def test_bad_params_are_refused(text):
    with pytest.raises(ValueError):
        parse_param(text)


def test_a_sweep_runs_every_combination_and_plots(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    dump_trace(generate(kind="poisson", n=40, rate_per_s=0.5, seed=1, lifetime_p50_s=20,
                        lifetime_p99_s=80, mean_step_s=5), trace)  # fmt: skip
    out = tmp_path / "sweep"
    code = main([
        "bench", "sweep", "--trace", str(trace), "--param", "min_warm=0,4",
        "--param", "freeze_after_s=5,60", "--nodes", "2", "--out", str(out), "--json",
    ])  # fmt: skip
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted((r["min_warm"], r["freeze_after_s"]) for r in rows) == [
        (0, 5), (0, 60), (4, 5), (4, 60)
    ]  # fmt: skip
    assert any(r["pareto"] for r in rows)
    assert (out / "pareto.png").read_bytes().startswith(b"\x89PNG")
    bad = main(["bench", "sweep", "--trace", str(trace), "--param", "min_warm=-1"])
    assert bad == 2 and "min_warm" in capsys.readouterr().err
