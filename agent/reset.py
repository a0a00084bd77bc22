"""Recycling a released sandbox: what a reset runs inside its container, and its check.

A reset is one command in two parts, run as the sandbox's own user (the template's
`user`).
Not as root: the container has every capability dropped, so its root could neither
signal the user's processes (no CAP_KILL) nor delete in the user's work dir (no
CAP_DAC_OVERRIDE); the user itself can do both, and nothing in the sandbox runs as
anyone else (no-new-privileges, no setuid).

1. `kill_and_empty`: finds the template's main command (the child of PID 1, docker's
   init, that started first: processes orphaned later are adopted by PID 1 too, but
   start after it), stops and kills every other process until none is left, then
   empties the work dir, /tmp, /dev/shm and /dev/mqueue (dotfiles included, unreadable
   directories made readable first) and removes SysV IPC objects when the image has
   `ipcrm`.
2. `verify`, in the same shell right after: lists, with shell builtins only (so it
   sees no process of its own but itself), every process still there, every entry
   left in those directories and every SysV IPC object. The agent accepts the reset
   only when that is PID 1 and the main command, and nothing else.

The image needs `sh` (with `kill`, `read`, `echo` and `[` built in), `rm` and `chmod`,
as the base image's busybox has: a template says so with `recyclable: true`. Whatever
goes wrong (a process that will not die, a file that stays, an image without a shell,
a main command that died) fails the reset, and the agent removes the sandbox.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable

from agent.docker_driver import RESIDENT_MOUNT

# The fields of /proc/PID/stat after "comm)": comm itself may hold spaces, parentheses
# or a newline, so the fields are read after the LAST ") " (and a line cut short by a
# newline in comm has too few fields and is skipped).
_STAT_FIELDS = """\
read -r s 2>/dev/null < "$d/stat" || continue
set -- ${s##*') '}
"""

_FIND_MAIN = """\
main= best=
for d in /proc/[0-9]*; do
  @STAT@[ $# -ge 20 ] && [ "$2" = 1 ] || continue
  case ${20} in ''|*[!0-9]*) continue ;; esac
  if [ -z "$best" ] || [ "${20}" -lt "$best" ]; then main=${d#/proc/} best=${20}; fi
done
[ -n "$main" ] || { echo "no main process: the sandbox's command has exited"; exit 3; }
echo "main $main"
""".replace("@STAT@", _STAT_FIELDS.replace("\n", "\n  "))

_KILL_ALL_BUT_MAIN = """\
self=$$ round=0
while :; do
  left=
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    case $p in 1|"$main"|"$self") continue ;; esac
    @STAT@[ "$1" = Z ] && continue  # a zombie holds nothing: its reaper takes it
    left="$left $p"
  done
  [ -z "$left" ] && break
  round=$((round + 1))
  [ $round -gt 100 ] && { echo "processes that will not die:$left"; exit 4; }
  kill -STOP $left 2>/dev/null  # stopped first: nothing forks while the rest are killed
  kill -KILL $left 2>/dev/null
  [ $round -gt 3 ] && usleep 10000 2>/dev/null
done
""".replace("@STAT@", _STAT_FIELDS.replace("\n", "\n    "))

_EMPTY = """\
for dir in @DIRS@; do
  [ -d "$dir" ] || continue
  chmod -R u+rwx -- "$dir"/* "$dir"/.[!.]* "$dir"/..?* 2>/dev/null
  rm -rf -- "$dir"/* "$dir"/.[!.]* "$dir"/..?* 2>/dev/null
  set -- "$dir"/* "$dir"/.[!.]* "$dir"/..?*
  for f; do  # too many names for one command line: one at a time
    if [ -e "$f" ] || [ -L "$f" ]; then
      find "$dir" -mindepth 1 -maxdepth 1 -exec chmod -R u+rwx {} \\; -exec rm -rf {} \\; \\
        2>/dev/null
      break
    fi
  done
done
if command -v ipcrm >/dev/null 2>&1; then
  for t in shm:m sem:s msg:q; do
    f=/proc/sysvipc/${t%:*}
    [ -r "$f" ] || continue
    { read -r _; while read -r _ id _; do ipcrm -${t#*:} "$id" 2>/dev/null; done; } < "$f"
  done
fi
echo emptied
"""

_VERIFY = """\
for d in /proc/[0-9]*; do
  p=${d#/proc/}
  [ "$p" = $$ ] && continue
  @STAT@[ "$1" = Z ] && continue
  echo "process $p"
done
for dir in @DIRS@; do
  for f in "$dir"/* "$dir"/.[!.]* "$dir"/..?*; do
    if [ -e "$f" ] || [ -L "$f" ]; then echo "file $f"; fi
  done
done
for t in shm sem msg; do
  f=/proc/sysvipc/$t
  [ -r "$f" ] || continue
  { read -r _; while read -r _ id _; do echo "ipc $t $id"; done; } < "$f"
done
@AFTER@echo checked
"""
# The sandbox's resident command loop (agent/resident.py) was killed with the rest: it
# starts again here, once the check has looked, so the next lease's commands need no
# engine exec to start it. Orphaned at once, it outlives this command.
# In the node's execute-only shell where its directory has one (agent/resident.py).
START_LOOP = (
    f"[ -r {RESIDENT_MOUNT}/serve ] && "
    f"(setsid $(command -v {RESIDENT_MOUNT}/sh || echo sh) {RESIDENT_MOUNT}/serve "
    "</dev/null >/dev/null 2>&1 &)\n"
)


def reset_dirs(workdir: str) -> list[str]:
    """What a reset empties: the template's work dir, /tmp and /dev/shm, and /dev/mqueue
    (Docker mounts the IPC namespace's POSIX message queues there, writable by all: a
    file made there is a queue, and removing it deletes the queue)."""
    return list(dict.fromkeys([workdir, "/tmp", "/dev/shm", "/dev/mqueue"]))


def _words(dirs: Iterable[str]) -> str:
    return " ".join(shlex.quote(d) for d in dirs)


def kill_and_empty_script(dirs: Iterable[str]) -> str:
    """Prints "main PID" first and "emptied" last; exits non-zero when it cannot."""
    return _FIND_MAIN + _KILL_ALL_BUT_MAIN + _EMPTY.replace("@DIRS@", _words(dirs))


def verify_script(dirs: Iterable[str], after: str = "") -> str:
    """Prints what is left ("process PID", "file PATH", "ipc KIND ID"), runs `after`,
    then prints "checked"."""
    stat = _STAT_FIELDS.replace("\n", "\n  ")
    return _VERIFY.replace("@STAT@", stat).replace("@DIRS@", _words(dirs)).replace("@AFTER@", after)


def reset_script(dirs: Iterable[str]) -> str:
    """Kill, empty, check, then start the command loop again, in one command (one exec:
    the engine's costliest call here): what `kill_and_empty_script` prints up to
    "emptied", then what `verify_script` prints (`split_reset_output` takes them
    apart)."""
    dirs = list(dirs)
    return kill_and_empty_script(dirs) + verify_script(dirs, START_LOOP)


def split_reset_output(output: str) -> tuple[str, str]:
    """(what the kill and empty said, what the check said)."""
    killed, _, checked = output.partition("emptied\n")
    return killed, checked


def main_of(output: str) -> str | None:
    """The main command's PID, as `kill_and_empty_script` found it."""
    for line in output.splitlines():
        if line.startswith("main "):
            return line.removeprefix("main ").strip()
    return None


def leftovers(output: str, main: str) -> list[str]:
    """What `verify_script` found that a clean sandbox does not have: empty when clean."""
    lines = output.splitlines()
    if not lines or lines[-1] != "checked":
        return [f"the check did not finish: {output[-200:]!r}"]
    found = []
    processes = set()
    for line in lines[:-1]:
        if line.startswith("process "):
            processes.add(line.removeprefix("process "))
        else:
            found.append(line)
    if processes != {"1", main}:
        extra = sorted(processes - {"1", main}, key=lambda p: (len(p), p))
        missing = sorted({"1", main} - processes)
        if extra:
            found.append(f"processes left: {extra}")
        if missing:
            found.append(f"processes gone: {missing} (PID 1 and the main command must run)")
    return found
