"""The synthetic Python repository a `bench.rollout` episode works on, and its tool calls.

A group's repository is deterministic in its seed (the K rollouts of a group get the
same one, each group another): a package of modules, a small pytest suite that passes,
two scripts and incompressible data blobs, about `size_mb` in all, as one tar whose
members sit under `repo/` (unpacked into the work dir) and belong to uid 1000, the image's
sandbox user. `tool_calls` is an episode's 20 commands, run in `repo/`: the last writes
`result.json`, whose content `expected_result` says in advance, so reading it back proves
the episode ran, the data arrived whole and the notes were written.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import tarfile
from dataclasses import dataclass

MODULES = 12
BLOB_MB = 1  # each blob; the blobs make up the size past the sources
ROOT = "repo"
RESULT = "result.json"
OWNER = 1000  # the image's sandbox user (uid and gid)
MTIME = 1_700_000_000  # fixed: the same seed gives the same bytes

TESTS = """\
import pkg
from pkg import mod_00, mod_01


def test_version():
    assert pkg.VERSION == "{version}"


def test_compute_is_deterministic():
    assert mod_00.compute_0(7) == mod_00.compute_0(7)


def test_compute_in_range():
    assert 0 <= mod_01.compute_1(123) < {modulus}


def test_every_module_imports():
    assert len(pkg.modules()) == {modules}
"""

INIT = '''\
"""A synthetic package (bench.rollout_repo, seed {seed})."""

import importlib

VERSION = "{version}"


def modules():
    return [importlib.import_module(f"pkg.mod_{{i:02d}}") for i in range({modules})]
'''

STATS = '''\
"""Counts the package's lines and functions."""
import pathlib

lines = funcs = 0
for path in sorted(pathlib.Path("pkg").glob("*.py")):
    text = path.read_text()
    lines += text.count("\\n")
    funcs += text.count("def compute")
print(f"lines {lines} functions {funcs}")
'''

REPORT = '''\
"""Writes result.json: the group, the blobs' digest, the notes' line count."""
import hashlib
import json
import pathlib

digest = hashlib.sha256()
for path in sorted(pathlib.Path("data").glob("blob_*.bin")):
    digest.update(path.read_bytes())
notes = pathlib.Path("notes.txt").read_text().count("\\n")
result = {{"group": {group}, "blobs_sha256": digest.hexdigest(), "notes": notes}}
pathlib.Path("result.json").write_text(json.dumps(result, sort_keys=True))
print("wrote result.json")
'''


@dataclass(frozen=True)
class ToolCall:
    kind: str  # python, pytest, grep, cat, write, ls
    argv: list[str]


@dataclass(frozen=True)
class Repo:
    group: int
    tar: bytes
    blobs_sha256: str

    @property
    def size_bytes(self) -> int:
        return len(self.tar)


def module_source(rng: random.Random, index: int, modulus: int) -> str:
    factor = rng.randrange(3, 97)
    lines = [f'"""Module {index}: arithmetic for the tests and greps."""', ""]
    lines += [f"def compute_{index}(x):", f"    return (x * {factor} + {index}) % {modulus}", ""]
    for j in range(rng.randrange(20, 40)):
        words = " ".join(rng.choice(("alpha", "beta", "gamma", "delta")) for _ in range(6))
        if j % 7 == 0:
            lines.append(f"# TODO({index}.{j}): {words}")
        lines += [f"def helper_{index}_{j}(v):", f'    """{words}"""', f"    return v + {j}", ""]
    return "\n".join(lines) + "\n"


def make_repo(group: int, size_mb: float = 5.0) -> Repo:
    """Group `group`'s repository, about `size_mb` MB as a tar."""
    rng = random.Random(f"bench.rollout group {group}")
    version = f"0.{group}.{rng.randrange(100)}"
    modulus = 1000 + rng.randrange(1000)
    files: dict[str, bytes] = {
        "README.md": f"# repo of group {group}\n\nA synthetic package.\n".encode(),
        "pkg/__init__.py": INIT.format(seed=group, version=version, modules=MODULES).encode(),
        "tests/test_pkg.py": TESTS.format(
            version=version, modulus=modulus, modules=MODULES
        ).encode(),
        "scripts/stats.py": STATS.encode(),
        "scripts/report.py": REPORT.format(group=group).encode(),
        "notes.txt": b"",
    }
    for i in range(MODULES):
        files[f"pkg/mod_{i:02d}.py"] = module_source(rng, i, modulus).encode()
    sources = sum(len(b) for b in files.values())
    blobs = max(1, round((size_mb * 1e6 - sources) / (BLOB_MB * 1e6)))
    digest = hashlib.sha256()
    for i in range(blobs):
        blob = rng.randbytes(int(BLOB_MB * 1e6))
        files[f"data/blob_{i}.bin"] = blob
        digest.update(blob)  # in name order, as report.py reads them (fewer than 10)
    return Repo(group, tar_of(files), digest.hexdigest())


def tar_of(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = sorted({f"{ROOT}/{p.rsplit('/', 1)[0]}" for p in files if "/" in p} | {ROOT})
        for d in dirs:
            tar.addfile(member(d, tarfile.DIRTYPE, 0o755, 0))
        for path in sorted(files):
            data = files[path]
            tar.addfile(member(f"{ROOT}/{path}", tarfile.REGTYPE, 0o644, len(data)),
                        io.BytesIO(data))  # fmt: skip
    return buf.getvalue()


def member(name: str, kind: bytes, mode: int, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.mtime = kind, mode, size, MTIME
    info.uid = info.gid = OWNER
    return info


def tool_calls() -> list[ToolCall]:
    """An episode's 20 commands, in order, each run in the repository's directory: 5
    python, 3 pytest, 3 grep, 3 cat, 3 writes through a shell, 3 ls."""
    pytest = ToolCall("pytest", ["python3", "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                                 "tests"])  # fmt: skip
    stats = ToolCall("python", ["python3", "scripts/stats.py"])
    version = ToolCall("python", ["python3", "-c", "import pkg; print(pkg.VERSION)"])

    def note(i: int) -> ToolCall:
        return ToolCall(
            "write", ["sh", "-c", f"echo 'note {i}: looked at the package' >> notes.txt"]
        )

    return [
        ToolCall("ls", ["ls", "-la"]),
        ToolCall("cat", ["cat", "README.md"]),
        ToolCall("grep", ["grep", "-rn", "TODO", "pkg"]),
        version,
        pytest,
        note(1),
        ToolCall("cat", ["cat", "pkg/mod_03.py"]),
        ToolCall("grep", ["grep", "-rn", "def compute", "pkg"]),
        stats,
        ToolCall("write", ["sh", "-c", "printf '\\n# patched by the agent\\n' >> pkg/mod_01.py"]),
        pytest,
        ToolCall("ls", ["ls", "-l", "data"]),
        stats,
        ToolCall("grep", ["grep", "-rn", "import", "pkg"]),
        ToolCall("cat", ["cat", "notes.txt"]),
        note(2),
        version,
        ToolCall("ls", ["ls", "pkg"]),
        pytest,
        ToolCall("python", ["python3", "scripts/report.py"]),
    ]


NOTES = 2  # the notes tool_calls writes, which result.json counts


def expected_result(repo: Repo) -> dict:
    return {"group": repo.group, "blobs_sha256": repo.blobs_sha256, "notes": NOTES}


def check_result(repo: Repo, raw: bytes) -> str | None:
    """What is wrong with a result file read back, or None."""
    try:
        got = json.loads(raw)
    except ValueError:
        return f"result.json is not JSON: {raw[:80]!r}"
    want = expected_result(repo)
    return None if got == want else f"result.json says {got}, expected {want}"


def check_output(call: ToolCall, code: int | None, stdout: bytes) -> str | None:
    """What is wrong with a tool call's answer, or None: each must exit 0, and a pytest
    run must say its tests passed."""
    if code != 0:
        return f"{call.kind} {call.argv[:3]} exited {code}: {stdout[-200:]!r}"
    if call.kind == "pytest" and b" passed" not in stdout:
        return f"pytest said {stdout[-200:]!r}"
    return None
