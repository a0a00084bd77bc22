"""Template images made here, with no registry: from Debian packages, a Dockerfile, or an
image the engine already has (`dsec template build`).

- `--debian SUITE --packages a,b [--pip x,y]`: Debian's `mmdebstrap` builds a root file
  system with the machine's own apt sources; pip packages go into it from the host's
  index (`pip install --target` its dist-packages, binary wheels for its Python), never
  from inside a container; it gets `/etc/passwd` and `/etc/group` entries for a non-root
  `sandbox` user (uid 1000) and a `/work` dir, and `docker import` makes it an image.
- `--dockerfile PATH`: the engine builds it (its context is the Dockerfile's folder, with
  no network), `FROM` any image the engine has, a built template included.
- `--image REF`: an image as it is.

The tag is `NAME:<content hash>` of the inputs (the suite, packages, pip packages, apt
sources and this builder's recipe; the Dockerfile, its context and the ids of the images
it starts from; the image's id), and `NAME:latest` follows it. Inputs already built are
a cache hit: the tag exists, and nothing is done.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import docker
from docker.errors import BuildError, DockerException, ImageNotFound
from tqdm import tqdm

from dsec.image import IMAGE_LABEL, image_exists
from dsec.progress import progress_bar

RECIPE_VERSION = "1"  # a change to how images are made below gives every template a new tag
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
IMPORT_CHANGES = (
    f"ENV PATH={PATH}",
    "ENV HOME=/work",
    "WORKDIR /work",
    'CMD ["sleep", "2147483647"]',
)
APT_SOURCES = ("/etc/apt/sources.list", "/etc/apt/sources.list.d/*")
SANDBOX_PASSWD = "sandbox:x:1000:1000:sandbox:/work:/bin/sh\n"
SANDBOX_GROUP = "sandbox:x:1000:\n"
TAIL_LINES = 15  # of a failing tool's output, in the error

# The python template (`dsec up --with-python`, bench.rollout): what SWE-style rollouts
# run, from Debian's own packages.
PYTHON_TEMPLATE = {
    "debian": "bookworm",
    "packages": (
        "python3",
        "python3-pytest",
        "python3-pip",
        "python3-venv",
        "git",
        "build-essential",
        "ca-certificates",
        "procps",
    ),
}


# on every command in a python sandbox: an edit of a Python file to one of the same size
# within the same second would otherwise run the stale .pyc that an earlier import left
PYTHON_TEMPLATE_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}


class TemplateBuildError(RuntimeError):
    """A build that failed: the message ends with the failing tool's last lines."""


@dataclass
class BuiltTemplate:
    name: str
    image: str  # NAME:<content hash>
    tag_latest: str  # NAME:latest, the same image
    cached: bool
    seconds: float
    size_mb: float

    def as_dict(self) -> dict:
        return asdict(self)


def build_template(
    name: str,
    *,
    debian: str | None = None,
    packages: Sequence[str] = (),
    pip: Sequence[str] = (),
    dockerfile: str | Path | None = None,
    image: str | None = None,
    client: docker.DockerClient | None = None,
    progress: bool = False,
) -> BuiltTemplate:
    """Build (or find built) the image of template `name` from exactly one source; with
    `progress`, a build (not a cache hit) draws its steps as a bar on stderr."""
    if sum(x is not None for x in (debian, dockerfile, image)) != 1:
        raise TemplateBuildError("give exactly one of --debian, --dockerfile, --image")
    if (packages or pip) and debian is None:
        raise TemplateBuildError("--packages and --pip go with --debian")
    started = time.monotonic()
    client = client or _engine()
    if debian is not None:
        digest = _digest(["debian", debian, *sorted(packages), "pip", *sorted(pip), *_sources()])
        make = partial(_from_debian, client, name, debian, packages, pip)
        steps = 4 if pip else 3
    elif dockerfile is not None:
        path = Path(dockerfile)
        if not path.is_file():
            raise TemplateBuildError(f"no Dockerfile at {path}")
        digest = _digest(["dockerfile", *_context(path), *_bases(client, path)])
        make = partial(_from_dockerfile, client, name, path)
        steps = 1
    else:
        assert image is not None
        digest = _digest(["image", _image_id(client, image)])
        make = partial(_from_image, client, image, name)
        steps = 1
    tag = digest[:16]
    ref = f"{name}:{tag}"
    cached = image_exists(client, ref)
    if not cached:
        with progress_bar(steps, f"template {name}", "step", shown=progress) as bar:
            make(tag, BuildSteps(bar))
    built = client.images.get(ref)
    built.tag(name, "latest")
    return BuiltTemplate(
        name, ref, f"{name}:latest", cached, time.monotonic() - started, built.attrs["Size"] / 1e6
    )


def build_python_template(
    client: docker.DockerClient | None = None, progress: bool = False
) -> BuiltTemplate:
    return build_template("python", client=client, progress=progress, **PYTHON_TEMPLATE)


class BuildSteps:
    """A build's steps on its progress bar: the one running named, each counted once done."""

    def __init__(self, bar: tqdm) -> None:
        self.bar = bar

    @contextmanager
    def step(self, what: str) -> Iterator[None]:
        self.bar.set_postfix_str(what)
        yield
        self.bar.update(1)


# --- inputs -----------------------------------------------------------------------


def _digest(parts: Iterable[str | bytes]) -> str:
    h = hashlib.sha256(f"dsec template recipe {RECIPE_VERSION}\0".encode())
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "big") + data)
    return h.hexdigest()


def _sources() -> list[bytes]:
    """The machine's apt sources: the same packages named come from them."""
    files = sorted(f for pattern in APT_SOURCES for f in glob.glob(pattern) if os.path.isfile(f))
    return [Path(f).read_bytes() for f in files]


def _context(dockerfile: Path) -> list[str | bytes]:
    parts: list[str | bytes] = []
    root = dockerfile.parent
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        parts += [str(path.relative_to(root)), path.read_bytes()]
    return [dockerfile.name, *parts]


def _bases(client: docker.DockerClient, dockerfile: Path) -> list[str]:
    """The ids of the images its FROM lines name (a stage's own name is not an image)."""
    stages: set[str] = set()
    ids = []
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if len(words) >= 2 and words[0].upper() == "FROM":
            base = next(w for w in words[1:] if not w.startswith("--"))
            if base not in stages and base != "scratch":
                ids.append(_image_id(client, base))
            if len(words) >= 4 and words[-2].upper() == "AS":
                stages.add(words[-1])
    return ids


def _image_id(client: docker.DockerClient, ref: str) -> str:
    try:
        return client.images.get(ref).id
    except ImageNotFound as e:
        raise TemplateBuildError(
            f"the engine has no image {ref!r} (nothing is pulled here: build or load it first)"
        ) from e


def _engine() -> docker.DockerClient:
    try:
        client = docker.from_env()
        client.ping()
        return client
    except DockerException as e:
        raise TemplateBuildError(f"no Docker engine answers: {e}") from e


def _tail(text: str) -> str:
    return "\n".join(text.strip().splitlines()[-TAIL_LINES:])


# --- the three ways ---------------------------------------------------------------


def _from_debian(
    client: docker.DockerClient,
    name: str,
    suite: str,
    packages: Sequence[str],
    pip: Sequence[str],
    tag: str,
    steps: BuildSteps,
) -> None:
    if shutil.which("mmdebstrap") is None:
        raise TemplateBuildError("mmdebstrap is not installed (apt-get install mmdebstrap)")
    with tempfile.TemporaryDirectory(prefix="dsec-template-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        cmd = ["mmdebstrap", "--variant=apt", "--quiet"]
        if packages:
            cmd.append("--include=" + ",".join(packages))
        with steps.step(f"mmdebstrap of {suite}"):
            _run([*cmd, suite, str(rootfs)], f"mmdebstrap of {suite}")
        if pip:
            with steps.step("pip install"):
                _pip_into(rootfs, pip)
        _add_sandbox_user(rootfs)
        archive = Path(tmp) / "rootfs.tar"
        with steps.step("tar"):
            _run(
                ["tar", "-C", str(rootfs), "-cf", str(archive), "."], "tar of the root file system"
            )
        changes = [*IMPORT_CHANGES, f"LABEL {IMAGE_LABEL}={name}"]
        try:
            with steps.step("docker import"):
                client.api.import_image_from_file(
                    str(archive), repository=name, tag=tag, changes=changes
                )
        except DockerException as e:
            raise TemplateBuildError(f"docker import failed: {e}") from e


def _pip_into(rootfs: Path, pip: Sequence[str]) -> None:
    """pip packages from the host's index into the root file system's own Python."""
    versions = sorted(rootfs.glob("usr/lib/python3.*"))
    if not versions:
        raise TemplateBuildError("--pip needs python3 among the --packages")
    version = versions[-1].name.removeprefix("python")
    target = rootfs / "usr/local/lib" / f"python{version}" / "dist-packages"
    cmd = ["python3", "-m", "pip", "install", "--quiet", "--no-warn-script-location"]
    cmd += ["--target", str(target), "--python-version", version, "--only-binary=:all:"]
    _run([*cmd, *pip], "pip install")


def _add_sandbox_user(rootfs: Path) -> None:
    for file, line in (("passwd", SANDBOX_PASSWD), ("group", SANDBOX_GROUP)):
        path = rootfs / "etc" / file
        text = path.read_text() if path.exists() else ""
        if not any(entry.startswith("sandbox:") for entry in text.splitlines()):
            path.write_text(text + line)
    work = rootfs / "work"
    work.mkdir(exist_ok=True)
    os.chown(work, 1000, 1000)


def _from_image(
    client: docker.DockerClient, image: str, name: str, tag: str, steps: BuildSteps
) -> None:
    with steps.step("docker tag"):
        client.images.get(image).tag(name, tag)


def _from_dockerfile(
    client: docker.DockerClient, name: str, path: Path, tag: str, steps: BuildSteps
) -> None:
    try:
        with steps.step("docker build"):
            client.images.build(
                path=str(path.parent),
                dockerfile=path.name,
                tag=f"{name}:{tag}",
                rm=True,
                forcerm=True,
                pull=False,
                network_mode="none",
                labels={IMAGE_LABEL: name},
            )
    except BuildError as e:
        log = "".join(str(c.get("stream") or c.get("error") or "") for c in e.build_log)
        raise TemplateBuildError(f"the Dockerfile's build failed: {e.msg}\n{_tail(log)}") from e
    except DockerException as e:
        raise TemplateBuildError(f"the engine refused the build: {e}") from e


def _run(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise TemplateBuildError(
            f"{what} failed (exit {done.returncode}):\n{_tail(done.stderr + done.stdout)}"
        )
