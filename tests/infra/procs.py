"""The processes a fault test acts on, found by their arguments, environment and parent; and how much
each has read.

A test freezes or kills one real process (a node's `docker load`, the head's `docker save`, a
`docker pull` run by a node's sshd), so it must find exactly that one among the machine's. Stdlib only.
"""

from __future__ import annotations

import os


def processes(*args: str, env: str | None = None, parent: int | None = None,
              program: str | None = None) -> list[int]:
    """Pids whose argv holds each of args (as whole arguments), whose environment holds the entry env
    (NAME=value), whose parent is parent and whose argv[0] ends with program; each when given."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if parent is not None:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) != parent:
                        continue
            if env is not None:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if env.encode() not in f.read().split(b"\0"):
                        continue
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if program is not None and not argv[0].endswith(program.encode()):
            continue
        if all(a.encode() in argv for a in args):
            found.append(int(entry))
    return sorted(found)


def read_bytes(pid: int) -> int:
    """The bytes a process has read so far (any file, pipe or socket); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/io") as f:
            return int(next(line for line in f if line.startswith("rchar:")).split()[1])
    except (OSError, StopIteration):
        return 0
