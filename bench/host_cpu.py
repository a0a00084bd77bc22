"""The machine's CPU time as /proc/stat counts it, in clock ticks: how busy the host
was between two readings, whatever process was busy (the engine, the agents, the
client, the sandboxes)."""

from __future__ import annotations

from pathlib import Path


def busy_jiffies(stat_line: str) -> tuple[int, int]:
    """(busy, all) clock ticks of the `cpu` line of /proc/stat: busy is all but idle and
    iowait (of its first eight fields: guest time is counted in user time too)."""
    fields = [int(v) for v in stat_line.split()[1:9]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def host_jiffies() -> tuple[int, int]:
    """The machine's busy and total CPU time so far."""
    return busy_jiffies(Path("/proc/stat").read_text().split("\n", 1)[0])
