"""The non-root user that walks the users' paths: a member of the `docker` group (`sparkforge-user`, which
.ci/provision adds; SPARKFORGE_TEST_USER names another), and the plain environment of its login."""

from __future__ import annotations

import grp
import os
import pwd
import shutil

import pytest

USER = os.environ.get("SPARKFORGE_TEST_USER", "sparkforge-user")


def docker_user() -> pwd.struct_passwd:
    """The user, or a skip saying why it cannot be used here (no root to switch to it, no such user, ...)."""
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        pytest.skip("switching to the non-root user needs root and runuser")
    try:
        entry = pwd.getpwnam(USER)
    except KeyError:
        pytest.skip(f"no user {USER} (`.ci/provision` adds it, in the docker group)")
    try:
        group = grp.getgrnam("docker")
    except KeyError:
        pytest.skip("no docker group here")
    if entry.pw_uid == 0 or not (entry.pw_name in group.gr_mem or entry.pw_gid == group.gr_gid):
        pytest.skip(f"{USER} must be a non-root member of the docker group")
    return entry


def login_env(entry: pwd.struct_passwd, **extra: str) -> list[str]:
    """`NAME=value` words of a login's plain environment for `env -i` (no variable of the caller's)."""
    path = "/usr/local/bin:/usr/bin:/bin" if entry.pw_uid else "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    env = {"HOME": entry.pw_dir, "USER": entry.pw_name, "LOGNAME": entry.pw_name, "LANG": "C.UTF-8", "PATH": path}
    return [f"{k}={v}" for k, v in (env | extra).items()]
