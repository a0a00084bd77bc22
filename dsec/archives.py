"""Tars of files given as bytes: a claim's files (built by the SDK, or by the control
plane from files it was given one by one) and a SandboxFusion request's."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Mapping


def tar_of_files(files: Mapping[str, bytes], mtime: float) -> bytes:
    """An uncompressed tar of `files` ({path relative to where it is unpacked: bytes}),
    each a regular file of mode 0644 dated `mtime` to the second."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, data in files.items():
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(data), 0o644, int(mtime)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()
