"""The base sandbox image, built here because no registry is reachable.

FROM scratch with the host's static busybox (Debian's `busybox-static`) and one
symlink per applet, plus /etc/passwd and /etc/group (root and `sandbox`, uid 1000:
Docker refuses to start a container whose named user is unknown), /tmp and /work.
The build context is a tar made in memory, so building needs no files on disk.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile

import docker
from docker.errors import ImageNotFound

BASE_IMAGE = "dsec-base:latest"
IMAGE_LABEL = "dsec.image"
BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")

PASSWD = "root:x:0:0:root:/root:/bin/sh\nsandbox:x:1000:1000:sandbox:/work:/bin/sh\n"
GROUP = "root:x:0:\nsandbox:x:1000:\n"
DOCKERFILE = f"""FROM scratch
COPY rootfs/ /
COPY --chown=1000:1000 work/ /work/
ENV PATH=/bin HOME=/work
WORKDIR /work
LABEL {IMAGE_LABEL}=base
CMD ["sleep", "2147483647"]
"""


class ImageBuildError(RuntimeError):
    pass


def find_static_busybox() -> str:
    for path in (shutil.which("busybox"), *BUSYBOX_CANDIDATES):
        if path and _is_static(path):
            return path
    raise ImageBuildError(
        "no static busybox found: install Debian's busybox-static (apt-get install busybox-static)"
    )


def _is_static(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            elf = f.read(1 << 20)
    except OSError:
        return False
    # A dynamic ELF names its interpreter; a static one has no PT_INTERP string.
    return elf.startswith(b"\x7fELF") and b"/lib64/ld-linux" not in elf and b"/lib/ld-" not in elf


def _applets(busybox: str) -> list[str]:
    out = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True)
    return [a for a in out.stdout.split() if a and a != "busybox"]


def build_context(busybox: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:

        def add_dir(name: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)

        def add_file(name: str, data: bytes, mode: int = 0o644) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))

        dockerfile = DOCKERFILE.encode()
        add_file("Dockerfile", dockerfile)
        for d in ("rootfs", "rootfs/bin", "rootfs/etc", "rootfs/root"):
            add_dir(d)
        add_dir("rootfs/tmp", 0o1777)
        add_dir("work", 0o755)
        with open(busybox, "rb") as f:
            add_file("rootfs/bin/busybox", f.read(), 0o755)
        for applet in _applets(busybox):
            link = tarfile.TarInfo(f"rootfs/bin/{applet}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(link)
        add_file("rootfs/etc/passwd", PASSWD.encode())
        add_file("rootfs/etc/group", GROUP.encode())
    return buf.getvalue()


def image_exists(client: docker.DockerClient, ref: str) -> bool:
    try:
        client.images.get(ref)
    except ImageNotFound:
        return False
    return True


def ensure_base_image(client: docker.DockerClient, ref: str = BASE_IMAGE) -> bool:
    """Build the base image unless it exists. Returns True when it built one."""
    if image_exists(client, ref):
        return False
    context = build_context(find_static_busybox())
    try:
        client.images.build(
            fileobj=io.BytesIO(context), custom_context=True, tag=ref, rm=True, network_mode="none"
        )
    except docker.errors.BuildError as e:
        raise ImageBuildError(f"building {ref} failed: {e}") from e
    return True
