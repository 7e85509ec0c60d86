"""The non-root user that walks the users' paths: a member of the `docker` group (`sparkforge-user`, which
.ci/provision adds; SPARKFORGE_TEST_USER names another), and the plain environment of its login."""

from __future__ import annotations

import pwd

from tests.support.needs import TEST_USER, require

USER = TEST_USER


def docker_user() -> pwd.struct_passwd:
    """The user; without it the test skips (or, where its tier is required, fails) by the table of needs."""
    require("test-user")
    return pwd.getpwnam(USER)


def login_env(entry: pwd.struct_passwd, **extra: str) -> list[str]:
    """`NAME=value` words of a login's plain environment for `env -i` (no variable of the caller's)."""
    path = "/usr/local/bin:/usr/bin:/bin" if entry.pw_uid else "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    env = {"HOME": entry.pw_dir, "USER": entry.pw_name, "LOGNAME": entry.pw_name, "LANG": "C.UTF-8", "PATH": path}
    return [f"{k}={v}" for k, v in (env | extra).items()]
