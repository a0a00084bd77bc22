"""Who a sandbox's commands run as: a uid and gid of its own, from the node's range.

The kernel counts some limits per user, across every container of the host: inotify
instances and watches, processes against RLIMIT_NPROC, message queues, keys. Sandboxes
that shared one uid shared those too, so one could use up what every other needed (128
inotify instances took them all), and with them the host's own user of that uid. So a
template whose user is the default (`OWN_USER`) gets, per sandbox, a uid that no other
sandbox of the node holds, with the same number as its gid; the node's range is its own
(`sandbox_uid_base`, by default derived from the node id, so several agents on one host
do not meet). Such a uid has no entry in the image's /etc/passwd: its home is the work
dir (HOME, set in the container's environment), and `whoami` answers nothing.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

from dsec.models import OWN_USER

WORKDIR_MODE = 0o755  # a sandbox's work dir, its user's: a reset sets it again
FIRST_UID = 100_000  # above any uid a distribution gives its own users
RANGES = 16_384  # ranges a default base is chosen among, by the node id's hash


def default_uid_base(node_id: str, count: int) -> int:
    """Where a node's range starts when its config says nothing: by its id's hash, so
    agents sharing a host (a local pool's nodes) almost surely get disjoint ranges,
    and below 2**31 (some tools take uids for signed)."""
    slot = zlib.crc32(node_id.encode()) % RANGES
    return FIRST_UID + (slot * count) % (2**31 - FIRST_UID - count)


def numeric_user(user: str) -> tuple[int, int] | None:
    """A "uid:gid" (or bare "uid") user as numbers; None for a name."""
    uid, _, gid = user.partition(":")
    if not uid.isascii() or not uid.isdigit() or (gid and not (gid.isascii() and gid.isdigit())):
        return None
    return int(uid), int(gid or uid)


class UserRange:
    """The node's sandbox uids: [base, base + count)."""

    def __init__(self, base: int, count: int) -> None:
        self.base, self.count = base, count

    def user_for(self, template_user: str, taken: Iterable[str]) -> str:
        """The user a new sandbox of a template with `template_user` runs as: its own
        uid, the lowest of the range that no sandbox in `taken` holds, where the template
        asks for the default; else the template's own."""
        if template_user != OWN_USER:
            return template_user
        held = {ids[0] for user in taken if (ids := numeric_user(user)) is not None}
        for uid in range(self.base, self.base + self.count):
            if uid not in held:
                return f"{uid}:{uid}"
        raise RuntimeError(f"every uid of {self.base}..{self.base + self.count - 1} is held")
