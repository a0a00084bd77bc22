"""Personalised claims: an acquire's own `env`, `files` and `setup`, checked here, where
the acquire is made and before any sandbox is taken, and carried to the node in the
lease's grant. The node applies them to the warm sandbox it hands out (agent/node.py,
`Agent.lease`) before it answers, so the claim stays a warm hit.

Files come as {path: bytes} or as a tar, in the acquire's JSON (base64) or as parts of a
multipart/form-data acquire (their bytes as they are: docs/contracts.md); either way the
node gets one uncompressed tar whose every member lands in the template's work dir, sent
as a part of the grant's own form. A compressed tar is refused: its names could only be
checked by unpacking it here.
"""

from __future__ import annotations

import io
import posixpath
import tarfile
from dataclasses import dataclass
from urllib.parse import unquote

from pydantic import TypeAdapter, ValidationError

from dsec.archives import tar_of_files
from dsec.httpkit import ApiError, FormPart, parse_model
from dsec.models import (
    ACQUIRE_FILE_PART,
    ACQUIRE_PART,
    ACQUIRE_TAR_PART,
    AcquireRequest,
    ClaimPath,
    ForkSource,
    LeaseGrant,
    TemplateSpec,
)

MAX_TAR_MEMBERS = 100_000
_FILE_PATHS = TypeAdapter(dict[ClaimPath, bytes])


@dataclass(frozen=True)
class Personal:
    """What a claim asks its sandbox to be, as the grant carries it."""

    env: dict[str, str]
    files_tar: bytes | None
    setup: list[str] | None
    timeout_s: float  # the acquire's: its setup ends by then
    fork_from: ForkSource | None = None  # a fork's: where its node reads the copy

    def applied_to(self, grant: LeaseGrant, waited_s: float) -> LeaseGrant:
        """`grant` carrying this claim, after the acquire waited `waited_s`. Its setup
        ends a little before the acquire's time does (a fifth of what is left, 2 s at
        most), so that a setup that overran is answered as one, not as a timeout."""
        left = self.timeout_s - waited_s
        # (a copy that sets, not validates: checked here already, and the tar as bytes,
        # where validation of a Base64Bytes field would take base64)
        return grant.model_copy(
            update={
                "env": self.env,
                "files_tar": self.files_tar,
                "setup": self.setup,
                "fork_from": self.fork_from,
                "setup_timeout_s": max(0.001, left - min(2.0, left / 5)),
            }
        )


def acquire_of_form(parts: list[FormPart]) -> tuple[bytes, AcquireRequest]:
    """A multipart acquire's JSON request and the request with its files: the first
    part is the request (without `files`), then either a `file` part per file (its
    filename the path) or one `tar` part. A 422 says what is wrong with the parts."""
    if not parts or parts[0].name != ACQUIRE_PART:
        raise _refused("form", f"the first part must be {ACQUIRE_PART!r}, the request's JSON")
    raw = parts[0].data
    body = parse_model(raw, AcquireRequest)
    rest = parts[1:]
    if not rest:
        return raw, body
    if body.files is not None:
        raise _refused("files", "given in the request's JSON and as parts: give them once")
    if len(rest) == 1 and rest[0].name == ACQUIRE_TAR_PART:
        return raw, body.model_copy(update={"files": rest[0].data})
    if any(p.name != ACQUIRE_FILE_PART or not p.filename for p in rest):
        expected = f"a {ACQUIRE_FILE_PART!r} part per file (its filename the path)"
        raise _refused("form", f"after the request: {expected}, or one {ACQUIRE_TAR_PART!r} part")
    try:
        # (a filename is percent-encoded, as RFC 7578 lets a client send one)
        files = _FILE_PATHS.validate_python({unquote(p.filename): p.data for p in rest})
    except ValidationError as e:
        raise _refused("files", f"a file's path is invalid: {e.errors()[0]['msg']}") from e
    return raw, body.model_copy(update={"files": files})


def personal_of(
    body: AcquireRequest, template: TemplateSpec, max_bytes: int, mtime: float
) -> Personal | None:
    """The claim `body` makes of a sandbox of `template` (None: a plain one), or a 422
    saying which of its files is wrong. `mtime` is what files given as bytes are dated."""
    if not body.personalised:
        return None
    files = body.files
    if isinstance(files, dict):
        _check_size(sum(len(data) for data in files.values()), max_bytes, template)
        tar = tar_of_files(
            {_checked(path, template.workdir): data for path, data in files.items()}, mtime
        )
    elif files:
        _check_size(_tar_files_bytes(files, template.workdir), max_bytes, template)
        tar = files
    else:
        tar = None
    setup = list(body.setup) if body.setup else None
    return Personal(dict(body.env), tar, setup, body.timeout_s)


def _refused(loc: str, msg: str, code: str = "validation_error") -> ApiError:
    return ApiError(422, code, f"{loc}: {msg}", [{"loc": loc, "msg": msg}])


def _check_size(size: int, max_bytes: int, template: TemplateSpec) -> None:
    """Files of `size` bytes within the control plane's limit and the work dir."""
    if size > max_bytes:
        limit = f"{size} bytes, past {max_bytes} (the control plane's max_claim_files_bytes)"
        raise _refused("files", limit, "files_too_large")
    if size > template.workdir_mb * 1024 * 1024:
        raise _refused("files", f"{size} bytes: past the work dir's {template.workdir_mb} MB")


def _checked(path: str, workdir: str) -> str:
    """`path` relative to the work dir: given relative, or absolute inside it."""
    relative = path
    if path.startswith("/"):
        if not path.startswith(workdir.rstrip("/") + "/"):
            raise _refused(
                f"files.{path}", f"outside the work dir {workdir}", "path_outside_workdir"
            )
        relative = path[len(workdir.rstrip("/")) + 1 :]
    parts = relative.split("/")
    if ".." in parts or not relative or relative.endswith("/"):
        raise _refused(
            f"files.{path}", f"not a file's path in the work dir {workdir}", "path_outside_workdir"
        )
    return posixpath.normpath(relative)


def _tar_files_bytes(data: bytes, workdir: str) -> int:
    """The bytes of an uncompressed tar's files, all of which land in the work dir; its
    headers count only toward the body's limit, so that a tar of files is held to the
    limit their bytes as parts would be."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            size = 0
            for count, member in enumerate(tar, 1):
                if count > MAX_TAR_MEMBERS:
                    raise _refused("files", f"more than {MAX_TAR_MEMBERS} members")
                name = member.name
                if name.startswith("/") or ".." in name.split("/"):
                    raise _refused(
                        f"files.{name[:200]}",
                        f"tar member outside the work dir {workdir}",
                        "path_outside_workdir",
                    )
                if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
                    raise _refused(f"files.{name[:200]}", "only files, directories and links")
                size += member.size
    except tarfile.TarError as e:
        raise _refused("files", f"not an uncompressed tar archive ({e})") from e
    return size
