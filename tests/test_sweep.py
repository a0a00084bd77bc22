"""Parameter sweeps in the simulator (the grid, the Pareto front, the CLI), and the
comparison of dsec with every baseline on one trace."""

from __future__ import annotations

import json

import pytest

from bench import policies
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
    # a run that scheduled nothing has no latency: any run as cheap beats it
    nothing = {"p99_ms": None, "sandbox_seconds": 100}
    assert nothing not in pareto_front([*rows, nothing])
    cheaper = {"p99_ms": None, "sandbox_seconds": 50}
    assert pareto_front([nothing, cheaper]) == [cheaper]


@pytest.mark.parametrize("text", ["warm_fraction", "nope=1,2", "templates=1", "min_warm=a,b"])
def test_bad_params_are_refused(text):
    with pytest.raises(ValueError):
        parse_param(text)


def short_trace(path):
    """40 Poisson arrivals, one every 2 s: a trace the simulator plays in under a second."""
    dump_trace(generate(kind="poisson", n=40, rate_per_s=0.5, seed=1, lifetime_p50_s=20,
                        lifetime_p99_s=80, mean_step_s=5), path)  # fmt: skip
    return path


@pytest.fixture
def trace(tmp_path):
    return short_trace(tmp_path / "t.jsonl")


def test_a_sweep_runs_every_combination_and_plots(tmp_path, trace, capsys):
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


def test_each_baseline_runs_at_its_best_reasonable_configuration():
    assert policies.policy_params("static", peak=37, capacity=192).min_warm == 37
    assert policies.policy_params("static", peak=37, capacity=192).max_warm == 37
    for bounded in ("hpa", "keda", "kpa"):
        assert policies.policy_params(bounded, peak=37, capacity=192).max_warm == 192


def test_the_comparison_runs_every_policy_and_names_what_dsec_matches(tmp_path, trace, capsys):
    out = tmp_path / "policies"
    code = policies.main(["--trace", str(trace), "--nodes", "2", "--out", str(out), "--json",
                          "--dsec", "none:min_warm=0,warm_fraction=0"])  # fmt: skip
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    runs = {r["run"]: r for r in result["reports"]}
    assert set(runs) == {"cold", "dsec", "hpa", "keda", "kpa", "static", "dsec-none"}
    assert runs["dsec-none"]["policy"] == "dsec"
    assert set(result["wall_s"]) == set(runs)
    for v in result["verdicts"]:
        b = runs[v["baseline"]]
        for d in (r for r in runs.values() if r["policy"] == "dsec"):
            at_most = d["p99_ms"] <= b["p99_ms"] and d["sandbox_seconds"] <= b["sandbox_seconds"]
            assert (d["run"] in v["matched_by"]) == at_most
    assert {v["baseline"] for v in result["verdicts"]} == {"cold", "hpa", "keda", "kpa", "static"}
    assert (out / "latency_cdf.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    "variant", ["no-colon", ":min_warm=1", "x:nope=1", "x:templates=a", "x:min_warm=-1"]
)
def test_a_bad_dsec_variant_is_refused(trace, variant, capsys):
    assert policies.main(["--trace", str(trace), "--dsec", variant]) == 2
    assert "--dsec" in capsys.readouterr().err
