"""The README's command lines, taken out of it and run as written on a fresh clone, after its one set-up
command (`make venv`), as root and as a non-root member of the `docker` group.

A command line is a line of a code block that starts with `./build.py`, `make`, `sudo`, `python` or `git`
(a line ending in `\\` goes on). Each one is either run here (RUN: what needs no GPU, NGC, cluster, build or
download of its own), or named in SKIP with what it needs and the test that runs it instead. A line that is
neither fails the pure tier at once, naming its line in README.md, so a new line cannot go unchecked.

The runs share one clone per test session (`make venv` takes minutes): it belongs to the user
(`sparkforge-user`, which `.ci/provision` adds; SPARKFORGE_TEST_USER names another), and root's runs give
what they write back to the user.
"""

from __future__ import annotations

import pwd
import re
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.paths import ROOT
from tests.support.users import USER, docker_user, login_env

README = ROOT / "README.md"
COMMAND = re.compile(r"^(\./build\.py|make|sudo|python3?|git)( |$)")

# Lines that run here: the set-up command, help, and the verbs that read recipes and write only build/.
RUN = re.compile(r"^(make venv|\./build\.py( --images \S+)?( --help| list| show \S+| render \S+( -o \S+)?"
                 r"| diff \S+ \S+| build \S+ --dry-run| wheels list))$")
# Lines that do not, with what they need and where they run instead.
SKIP = [
    (r"^make image ", "a real BuildKit build on a base this engine has (tests/docker/test_build.py; "
                      "tests/cluster/test_user_path.py runs make image as the user)"),
    (r"^make test$", "the whole test suite"),
    (r"^sudo make base-local$", "root and debootstrap (tests/conftest.py, base_image)"),
    (r"^make registry$", "the registry of a cluster file (tests/cluster)"),
    (r"^\./build\.py (push|deploy|status) ", "a cluster (tests/cluster/test_cluster.py, test_user_path.py)"),
    (r"^\./build\.py launch ", "a cluster whose nodes hold the image (tests/cluster/test_launch.py)"),
    (r"^\./build\.py make-model /srv/", "a folder outside the checkout (tests/unit/test_tinymodel.py makes the model; "
                                        "the serving tests use it)"),
    (r"^\./build\.py lock ng17e$", "a GB10 machine that reaches nvcr.io and GitHub"),
    (r"^\./build\.py build ng17e --locked$", "a GB10 machine that reaches nvcr.io"),
    (r"^\./build\.py --images tests/variants verify-repro ", "a dockerd on the containerd image store "
                                                             "(tests/docker/test_repro.py)"),
    (r"^\./build\.py outdated ", "every newer vLLM release's source from PyPI (tests/unit/test_lock.py)"),
    (r"^\./build\.py bump ", "a newer vLLM release's source from PyPI, and GitHub for a git source's tag "
     "(tests/unit/test_bump.py bumps a test variant between real releases)"),
    (r"^\./build\.py mod new \S+ (--pr|--from-url) ", "GitHub, or the URL's server (tests/unit/test_remote_patch.py "
                                                     "serves the diff itself)"),
    (r"^\./build\.py (mod new \S+ --variant|mod save|check-mods) ", "the vLLM release source from PyPI "
                                                                    "(tests/unit/test_mod_workflow.py)"),
]


@dataclass(frozen=True)
class Line:
    number: int  # its first line in README.md
    text: str  # as the shell gets it, continuation lines joined

    @property
    def command(self) -> str:
        """The command without its trailing comment."""
        return re.sub(r"\s+#.*$", "", self.text).strip()


def command_lines(text: str) -> list[Line]:
    """Every command line of the README's code blocks (indented by four spaces, or fenced)."""
    found: list[Line] = []
    fenced = False
    pending: tuple[int, str] | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.lstrip().startswith("```"):
            fenced = not fenced
            continue
        code = raw[4:] if raw.startswith("    ") else raw if fenced else None
        if pending is not None:
            start, joined = pending
            joined = joined[:-1].rstrip() + " " + (code or raw).strip()
            pending = (start, joined) if joined.endswith("\\") else None
            if pending is None:
                found.append(Line(start, joined))
            continue
        if code is None or not COMMAND.match(code.strip()):
            continue
        if code.rstrip().endswith("\\"):
            pending = (number, code.strip())
        else:
            found.append(Line(number, code.strip()))
    return found


def why_skipped(line: Line) -> str | None:
    return next((reason for pattern, reason in SKIP if re.search(pattern, line.command)), None)


LINES = command_lines(README.read_text())
RUNS = [line for line in LINES if RUN.match(line.command)]


def test_every_command_line_of_the_readme_is_run_or_says_why_not() -> None:
    unclassified = [f"README.md:{line.number}: {line.text}" for line in LINES
                    if not RUN.match(line.command) and why_skipped(line) is None]
    assert not unclassified, "no rule says whether these run in tests/unit/test_readme.py:\n" + "\n".join(unclassified)
    both = [line.number for line in RUNS if why_skipped(line)]
    assert not both, f"README.md lines both run and skipped: {both}"
    assert [line.command for line in RUNS][:5] == ["make venv", "./build.py --help", "./build.py list",
                                                   "./build.py show ng17e", "./build.py build ng17e --dry-run"]


def test_the_reader_finds_continued_and_fenced_lines() -> None:
    text = "para\n\n    ./build.py a \\\n        --b c   # note\n\n```sh\nmake x\n```\n    not a command\n"
    assert command_lines(text) == [Line(3, "./build.py a --b c   # note"), Line(7, "make x")]
    assert Line(3, "./build.py a --b c   # note").command == "./build.py a --b c"


# ------------------------------------------------------------------ the runs, on a fresh clone


def _as(who: pwd.struct_passwd, clone: Path, command: str, timeout: float) -> subprocess.CompletedProcess:
    """command run by bash in the clone, as `who` with a login's plain environment."""
    runner = ["runuser", "-u", who.pw_name, "--"] if who.pw_uid else []
    return subprocess.run([*runner, "env", "-i", *login_env(who), "bash", "-c", command], cwd=clone,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def user() -> pwd.struct_passwd:
    return docker_user()


@pytest.fixture(scope="session")
def clone(user: pwd.struct_passwd):
    """A fresh clone of this checkout's commit in the user's home, set up with the README's one command."""
    where = Path(user.pw_dir) / f"sparkforge-readme-{uuid.uuid4().hex[:8]}"
    try:
        subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(where)], check=True,
                       capture_output=True, timeout=600)
        subprocess.run(["chown", "-R", f"{user.pw_uid}:{user.pw_gid}", str(where)], check=True, timeout=600)
        setup = _as(user, where, "make venv", timeout=3600)
        assert setup.returncode == 0, f"README's set-up, `make venv`, failed as {USER}:\n{setup.stdout[-3000:]}" \
                                      f"\n{setup.stderr[-3000:]}"
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.network  # make venv installs requirements.lock from PyPI
@pytest.mark.root  # and the lines run as a second user too
@pytest.mark.parametrize("line", RUNS, ids=lambda line: f"README.md:{line.number}")
def test_the_readme_line_runs_as_written_on_a_fresh_clone(line: Line, clone: Path, user: pwd.struct_passwd) -> None:
    for who in (user, pwd.getpwuid(0)):
        proc = _as(who, clone, line.text, timeout=900)
        if who.pw_uid == 0:  # what root wrote (build/, __pycache__) goes back to the user, whose clone it is
            subprocess.run(["chown", "-R", f"{user.pw_uid}:{user.pw_gid}", str(clone)], check=True, timeout=600)
        said = f"README.md line {line.number}, as {who.pw_name}: `{line.text}` exited {proc.returncode}:\n" \
               f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, said
        assert not any(out.startswith("error:") for out in proc.stderr.splitlines()), said
