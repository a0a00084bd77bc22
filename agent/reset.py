"""Recycling a released sandbox: what a reset runs inside its container, and its check.

A reset is one command in two parts, run as the sandbox's own user. Not as root: the
container's root holds no capability but the command loop's two (LOOP_CAPS), so it
could neither signal the user's processes (no CAP_KILL) nor delete in the user's work
dir (no CAP_DAC_OVERRIDE); the user itself can do both. What runs as anyone else is
the agent's (init and the main command of a recyclable template as KEEPER_USER, the
command loop and its copies as LOOP_USER: the tenant can become neither, with
no-new-privileges and no setuid), and is left alone; the loop so outlives the reset.

1. `kill_and_empty`: finds the template's main command (the child of PID 1, docker's
   init, that started first: processes orphaned later are adopted by PID 1 too, but
   start after it), stops and kills every other process until none is left, then
   empties the work dir, /tmp, /dev/shm and /dev/mqueue (dotfiles included, unreadable
   directories made readable first; the work dir, the one the user owns, gets back
   its mode: a lease's `chmod 0` would fail the next lease's commands) and removes
   SysV IPC objects when the image has `ipcrm`.
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

from agent.users import WORKDIR_MODE

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
    [ -O "$d" ] || continue  # not the tenant's: the command loop's (LOOP_USER)
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
  # the one of them the tenant owns (the work dir) gets back the mode it was made with
  [ -O "$dir" ] && chmod @MODE@ -- "$dir"
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
  [ -O "$d" ] || [ "$p" = 1 ] || [ "$p" = "$main" ] || continue  # the loop's: see above
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
echo checked
"""


def reset_dirs(workdir: str) -> list[str]:
    """What a reset empties: the template's work dir, /tmp and /dev/shm, and /dev/mqueue
    (Docker mounts the IPC namespace's POSIX message queues there, writable by all: a
    file made there is a queue, and removing it deletes the queue)."""
    return list(dict.fromkeys([workdir, "/tmp", "/dev/shm", "/dev/mqueue"]))


def _words(dirs: Iterable[str]) -> str:
    return " ".join(shlex.quote(d) for d in dirs)


def kill_and_empty_script(dirs: Iterable[str]) -> str:
    """Prints "main PID" first and "emptied" last; exits non-zero when it cannot."""
    empty = _EMPTY.replace("@DIRS@", _words(dirs)).replace("@MODE@", f"{WORKDIR_MODE:o}")
    return _FIND_MAIN + _KILL_ALL_BUT_MAIN + empty


def verify_script(dirs: Iterable[str]) -> str:
    """Prints what is left ("process PID", "file PATH", "ipc KIND ID"), then "checked"."""
    stat = _STAT_FIELDS.replace("\n", "\n  ")
    return _VERIFY.replace("@STAT@", stat).replace("@DIRS@", _words(dirs))


def reset_script(dirs: Iterable[str]) -> str:
    """Kill, empty and check in one command (one exec: the engine's costliest call
    here): what `kill_and_empty_script` prints up to "emptied", then what
    `verify_script` prints (`split_reset_output` takes them apart)."""
    dirs = list(dirs)
    return kill_and_empty_script(dirs) + verify_script(dirs)


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
