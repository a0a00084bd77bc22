"""Reports of a replay: ``report.json``, ``report.md`` and PNG plots, and comparisons of
several reports (one per policy) in one table and one latency plot.

``report.json`` holds the fields docs/benchmarks.md names: ``schedule_latency_ms`` (p50, p95, p99,
max and the same ``by_path``), ``utilisation``, ``queue_wait_share``, ``episodes_per_hour``
(completed episodes per hour of the trace's arrivals, in trace time),
``sandbox_seconds`` (local, cloud), ``scale_events``, what the run was (``trace``,
``policy``, ``params``, ``mode``, ``seed``, ``time_scale``, ...) and ``episodes`` (total,
completed, failed). Next to it, ``latencies.json`` keeps every schedule latency by path, so
that a later comparison can draw the whole distributions, not only their quantiles.

Quantities that cannot be computed (no latencies, no sandbox-seconds, a run of zero span)
are ``null`` rather than NaN, which is not JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.records import SCHEDULE_PATHS, RunResult
from bench.stats import latency_summary

REPORT_FILE = "report.json"
LATENCIES_FILE = "latencies.json"
MARKDOWN_FILE = "report.md"
LATENCY_CDF_FILE = "latency_cdf.png"
TIMELINE_FILE = "timeline.png"
COMPARE_JSON_FILE = "compare.json"
COMPARE_MARKDOWN_FILE = "compare.md"

# The targets the seeds name, shown beside the results.
SCHEDULE_TARGET_MS = 500.0
UTILISATION_TARGET = 0.30
QUEUE_WAIT_SHARE_TARGET = 0.10

# Held states first, so the stacked plot reads from "in use" up to "spare".
STATE_ORDER = (
    "leased",
    "leased_paused",
    "warm",
    "paused",
    "hibernated",
    "creating",
    "destroying",
    "lost",
)
RUN_FIELDS = ("trace", "policy", "params", "mode", "seed", "time_scale")


def schedule_latencies(result: RunResult) -> dict[str, list[float]]:
    """The pool-side schedule latency of every acquired episode, in ms, by path."""
    by_path: dict[str, list[float]] = {}
    for record in result.records:
        if record.schedule_ms is not None and record.path is not None:
            by_path.setdefault(record.path, []).append(record.schedule_ms)
    return by_path


def _ratio(numerator: float, denominator: float, digits: int = 4) -> float | None:
    return round(numerator / denominator, digits) if denominator > 0 else None


def build_report(result: RunResult) -> dict[str, Any]:
    """The report.json of a run (see the module's docstring for the fields)."""
    records = result.records
    by_path = schedule_latencies(result)
    all_latencies = [ms for values in by_path.values() for ms in values]
    ordered_paths = [p for p in SCHEDULE_PATHS if p in by_path] + sorted(
        p for p in by_path if p not in SCHEDULE_PATHS
    )

    # Queue-wait share over episodes that were both served and given back: for those the
    # whole span from request to release is known.
    held = [r for r in records if r.acquired_at_s is not None and r.released_at_s is not None]
    waited_s = sum(r.acquired_at_s - r.requested_at_s for r in held)
    held_s = sum(r.released_at_s - r.requested_at_s for r in held)

    completed = sum(1 for r in records if r.completed)
    # over the span of the trace's arrivals, in trace time: neither how long the replay
    # took (a replay at time scale 0.1 plays an hour of the trace in 6 minutes) nor the
    # tail of the last episodes' lifetimes, which would make a longer-lived workload
    # look slower at the same rate of episodes
    arrivals = [r.arrival_s for r in records]
    span_s = max(arrivals) - min(arrivals) if arrivals else 0.0
    trace_span_s = span_s / (result.meta.get("time_scale") or 1.0)

    sandbox_seconds = {
        kind: round(result.sandbox_seconds.get(kind, 0.0), 3) for kind in ("local", "cloud")
    }
    meta = dict(result.meta)
    return {
        **{name: meta.pop(name, None) for name in RUN_FIELDS},
        **meta,
        "episodes": {
            "total": len(records),
            "completed": completed,
            "failed": sum(1 for r in records if r.error is not None),
        },
        "schedule_latency_ms": {
            **latency_summary(all_latencies),
            "by_path": {path: latency_summary(by_path[path]) for path in ordered_paths},
        },
        "utilisation": _ratio(result.busy_seconds, sum(result.sandbox_seconds.values())),
        "queue_wait_share": _ratio(waited_s, held_s),
        "episodes_per_hour": _ratio(completed * 3600.0, trace_span_s, digits=1),
        "sandbox_seconds": sandbox_seconds,
        "scale_events": dict(sorted(result.scale_events.items())),
    }


# --- the readable report -----------------------------------------------------------


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _number(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines.extend("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows)
    return lines


def render_markdown(report: Mapping[str, Any]) -> str:
    """report.md: what the run was, the results against the seeds' targets, latency by path,
    scale events, and the plots."""
    latency = report["schedule_latency_ms"]
    episodes = report["episodes"]
    sandbox_seconds = report["sandbox_seconds"]
    run_rows: list[list[object]] = [
        ["trace", report["trace"] or "n/a"],
        ["policy", report["policy"]],
        ["mode", report["mode"]],
        ["seed", report["seed"] if report["seed"] is not None else "n/a"],
        ["time scale", report["time_scale"]],
    ]
    if report.get("nodes") is not None:
        run_rows.append(["nodes", f"{report['nodes']} x {report.get('slots_per_node')} slots"])
    if report.get("wall_s") is not None:
        run_rows.append(["wall time", f"{report['wall_s']:.1f} s"])
    result_rows = [
        [
            "schedule latency p50 / p95 / p99 / max",
            " / ".join(_ms(latency[q]) for q in ("p50", "p95", "p99", "max")) + " ms",
            f"p99 < {SCHEDULE_TARGET_MS:.0f} ms",
        ],
        ["utilisation (busy / sandbox lifetime)", _percent(report["utilisation"]), "> 30%"],
        ["queue-wait share", _percent(report["queue_wait_share"]), "< 10%"],
        ["episodes per hour", _number(report["episodes_per_hour"]), ""],
        [
            "sandbox-seconds local / cloud",
            f"{_number(sandbox_seconds['local'])} / {_number(sandbox_seconds['cloud'])}",
            "",
        ],
        [
            "episodes total / completed / failed",
            f"{episodes['total']} / {episodes['completed']} / {episodes['failed']}",
            "",
        ],
    ]
    path_rows = [
        [path, s["n"], _ms(s["p50"]), _ms(s["p95"]), _ms(s["p99"]), _ms(s["max"])]
        for path, s in latency["by_path"].items()
    ]
    event_rows = [[action, count] for action, count in report["scale_events"].items()]
    lines = [f"# Replay report: {report['policy']} ({report['mode']})", ""]
    lines += _table(["run", ""], run_rows) + [""]
    lines += ["## Results", ""]
    lines += _table(["metric", "value", "target"], result_rows) + [""]
    lines += ["## Schedule latency by path (ms)", ""]
    lines += _table(["path", "n", "p50", "p95", "p99", "max"], path_rows or [["none"] * 6])
    lines += ["", "## Scale events", ""]
    lines += _table(["action", "count"], event_rows or [["none", 0]]) + [""]
    lines += ["## Policy parameters", "", "```json", json.dumps(report["params"], indent=2)]
    lines += ["```", "", f"![schedule latency CDF]({LATENCY_CDF_FILE})", ""]
    lines += [f"![pool over time]({TIMELINE_FILE})", ""]
    return "\n".join(lines)


# --- plots ---------------------------------------------------------------------------
# matplotlib is imported inside the plotting functions: it is the `bench` extra, and slow to
# import, and the `dsec` command line imports this module for every command.


def new_figure(rows: int = 1, height: float = 4.5, legends_outside: bool = False):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # A bare Figure on the Agg canvas: no pyplot, so no global state and no display needed.
    # Fixed margins (room on the right for legends drawn outside) rather than a layout
    # engine, which measured every label on every draw: half of a report's time.
    figure = Figure(figsize=(9, height))
    FigureCanvasAgg(figure)
    figure.subplots_adjust(left=0.1, right=0.8 if legends_outside else 0.97,
                           bottom=0.5 / height, top=1 - 0.4 / height, hspace=0.45)  # fmt: skip
    axes = figure.subplots(rows, 1, sharex=rows > 1, squeeze=False)[:, 0]
    return figure, axes


def plot_latency_cdfs(series: Mapping[str, Sequence[float]], path: Path | str) -> Path:
    """Draw one schedule-latency CDF per named series (ms) in one plot, to a PNG."""
    figure, (axis,) = new_figure()
    drawn = False
    for label, values_ms in series.items():
        if not values_ms:
            continue
        ordered = sorted(values_ms)
        shares = [(i + 1) / len(ordered) for i in range(len(ordered))]
        # from 0 at the fastest acquire, so the first step shows
        axis.step(
            [ordered[0], *ordered],
            [0.0, *shares],
            where="post",
            label=f"{label} (n={len(ordered)})",
        )
        drawn = True
    if drawn:
        # warm claims take milliseconds and cold creates seconds: a log axis shows both
        if min(min(v) for v in series.values() if v) > 0:
            axis.set_xscale("log")
        axis.axvline(SCHEDULE_TARGET_MS, color="grey", linestyle=":", label="500 ms target")
        axis.legend(loc="upper left")
    else:
        axis.text(0.5, 0.5, "no acquired episodes", ha="center", transform=axis.transAxes)
    axis.set_xlabel("schedule latency (ms)")
    axis.set_ylabel("share of acquires")
    axis.set_ylim(0, 1.02)
    axis.grid(True, which="both", alpha=0.3)
    axis.set_title("Schedule latency CDF")
    path = Path(path)
    figure.savefig(path, dpi=100)
    return path


def executing_over_time(result: RunResult, times_s: Sequence[float]) -> list[float]:
    """Sandboxes executing at each of ``times_s`` (ascending), each held episode's busy time
    spread evenly over its hold: records keep exec totals, not exec start times, live and
    simulated alike, so this is the finest either can say."""
    changes: list[tuple[float, float]] = []
    for r in result.records:
        if r.acquired_at_s is None or r.released_at_s is None:
            continue
        held_s = r.released_at_s - r.acquired_at_s
        if held_s > 0:
            changes += [(r.acquired_at_s, r.busy_s / held_s), (r.released_at_s, -r.busy_s / held_s)]
    changes.sort()
    executing, applied, rates = [], 0, 0.0
    for t in times_s:
        while applied < len(changes) and changes[applied][0] <= t:
            rates += changes[applied][1]
            applied += 1
        executing.append(max(0.0, rates))  # max: float sums of +x and -x may end at -1e-17
    return executing


def plot_timeline(result: RunResult, path: Path | str, utilisation: float | None) -> Path:
    """Pool size by state (stacked), queue depth, and utilisation over time, to a PNG."""
    from matplotlib.ticker import MaxNLocator

    figure, (sizes, queue, busy) = new_figure(rows=3, height=9, legends_outside=True)
    samples = result.timeline
    times = [s.t_s for s in samples]
    outside = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": "small"}
    if samples:
        seen = {state for s in samples for state in s.sandboxes}
        states = [s for s in STATE_ORDER if s in seen] + sorted(seen - set(STATE_ORDER))
        sizes.stackplot(
            times,
            [[s.sandboxes.get(state, 0) for s in samples] for state in states],
            labels=states,
            step="post",
        )
        sizes.legend(**outside)
        queue.step(times, [s.queue_depth for s in samples], where="post", color="tab:red")
        executing = executing_over_time(result, times)
        busy.plot(
            times,
            [s.leased / s.alive if s.alive else 0.0 for s in samples],
            label="leased",
            drawstyle="steps-post",
        )
        busy.plot(
            times,
            [e / s.alive if s.alive else 0.0 for e, s in zip(executing, samples, strict=True)],
            label="executing (est.)",
            drawstyle="steps-post",
        )
        if utilisation is not None:
            busy.axhline(utilisation, color="grey", linestyle="--", label=f"run: {utilisation:.1%}")
        busy.legend(**outside)
    else:
        sizes.text(0.5, 0.5, "no timeline samples", ha="center", transform=sizes.transAxes)
    sizes.set_ylabel("sandboxes")
    sizes.set_title("Pool size by state")
    queue.set_ylabel("requests")
    queue.set_title("Queue depth")
    queue.yaxis.set_major_locator(MaxNLocator(integer=True))
    busy.set_ylabel("share of alive sandboxes")
    busy.set_title(
        "Utilisation (executing: each episode's exec time spread over its hold)", fontsize="medium"
    )
    busy.set_ylim(0, 1.02)
    busy.set_xlabel("replay time (s)")
    for axis in (sizes, queue, busy):
        axis.grid(True, alpha=0.3)
    path = Path(path)
    figure.savefig(path, dpi=100)
    return path


# --- writing and comparing ------------------------------------------------------------


def write_report(result: RunResult, out_dir: Path | str) -> Path:
    """Write report.json, latencies.json, report.md, latency_cdf.png and timeline.png into
    ``out_dir`` (made if missing); returns the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = build_report(result)
    latencies = schedule_latencies(result)
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    (out / LATENCIES_FILE).write_text(json.dumps(latencies) + "\n")
    (out / MARKDOWN_FILE).write_text(render_markdown(report))
    everything = [ms for values in latencies.values() for ms in values]
    # one line per path, and all of them together when there is more than one
    plot_latency_cdfs(
        {"all": everything, **latencies} if len(latencies) > 1 else {"all": everything},
        out / LATENCY_CDF_FILE,
    )
    plot_timeline(result, out / TIMELINE_FILE, report["utilisation"])
    return out


def load_report(report_dir: Path | str) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """A report directory's report.json and its latencies by path."""
    directory = Path(report_dir)
    report = json.loads((directory / REPORT_FILE).read_text())
    latencies = json.loads((directory / LATENCIES_FILE).read_text())
    return report, latencies


def _comparison_row(label: str, report: Mapping[str, Any]) -> dict[str, Any]:
    latency = report["schedule_latency_ms"]
    return {
        "report": label,
        "policy": report["policy"],
        "mode": report["mode"],
        "p50_ms": latency["p50"],
        "p95_ms": latency["p95"],
        "p99_ms": latency["p99"],
        "utilisation": report["utilisation"],
        "queue_wait_share": report["queue_wait_share"],
        "episodes_per_hour": report["episodes_per_hour"],
        "sandbox_seconds_local": report["sandbox_seconds"]["local"],
        "sandbox_seconds_cloud": report["sandbox_seconds"]["cloud"],
    }


def render_comparison(comparison: Mapping[str, Any]) -> str:
    """compare.md: one row per report."""
    headers = [
        "report",
        "policy",
        "mode",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "utilisation",
        "queue wait",
        "episodes/h",
        "sandbox-s local",
        "sandbox-s cloud",
    ]
    rows = [
        [
            row["report"],
            row["policy"],
            row["mode"],
            _ms(row["p50_ms"]),
            _ms(row["p95_ms"]),
            _ms(row["p99_ms"]),
            _percent(row["utilisation"]),
            _percent(row["queue_wait_share"]),
            _number(row["episodes_per_hour"]),
            _number(row["sandbox_seconds_local"]),
            _number(row["sandbox_seconds_cloud"]),
        ]
        for row in comparison["reports"]
    ]
    lines = ["# Policy comparison", ""] + _table(headers, rows)
    lines += ["", f"![schedule latency CDFs]({LATENCY_CDF_FILE})", ""]
    return "\n".join(lines)


def compare_reports(report_dirs: Sequence[Path | str], out_dir: Path | str) -> dict[str, Any]:
    """Overlay the reports' latency CDFs in ``out_dir/latency_cdf.png`` and tabulate them in
    compare.json and compare.md; returns what compare.json holds."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    series: dict[str, list[float]] = {}
    for directory in report_dirs:
        report, latencies = load_report(directory)
        label = f"{report['policy']} ({report['mode']})"
        if label in series:  # two runs of one policy and mode: tell them apart by directory
            label = f"{label} {Path(directory).name}"
        series[label] = [ms for values in latencies.values() for ms in values]
        rows.append(_comparison_row(label, report))
    comparison = {"reports": rows}
    (out / COMPARE_JSON_FILE).write_text(json.dumps(comparison, indent=2) + "\n")
    (out / COMPARE_MARKDOWN_FILE).write_text(render_comparison(comparison))
    plot_latency_cdfs(series, out / LATENCY_CDF_FILE)
    return comparison
