"""The command lines of README.md and of every docs/*.md page, taken out of them and run as written on a
fresh clone, after the README's one set-up command (`make venv`), as root and as a non-root member of the
`docker` group; and the links between those pages.

A command line is a line of a code block that starts with `./build.py`, `make`, `sudo`, `python` or `git`
(a line ending in `\\` goes on). Each one is either run here (RUN: what needs no GPU, NGC, cluster, build or
download of its own), or named in SKIP with what it needs and the test that runs it instead. A line that is
neither fails the pure tier at once, naming its page and line (`README.md:LINE`, `docs/x.md:LINE`), so a
new line cannot go unchecked.

Every docs/*.md page is linked from README.md exactly once, and every relative link of these pages names a
file that exists and, with `#anchor`, a heading of that file (GitHub's anchors: lowercase, spaces to `-`,
punctuation dropped).

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
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
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
    number: int  # its first line in its page
    text: str  # as the shell gets it, continuation lines joined
    page: str = "README.md"  # the page, relative to the project's folder

    @property
    def command(self) -> str:
        """The command without its trailing comment."""
        return re.sub(r"\s+#.*$", "", self.text).strip()

    @property
    def where(self) -> str:
        return f"{self.page}:{self.number}"


def page_name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def command_lines(text: str, page: str = "README.md") -> list[Line]:
    """Every command line of a page's code blocks (indented by four spaces, or fenced)."""
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
                found.append(Line(start, joined, page))
            continue
        if code is None or not COMMAND.match(code.strip()):
            continue
        if code.rstrip().endswith("\\"):
            pending = (number, code.strip())
        else:
            found.append(Line(number, code.strip(), page))
    return found


def why_skipped(line: Line) -> str | None:
    return next((reason for pattern, reason in SKIP if re.search(pattern, line.command)), None)


LINES = [line for page in PAGES for line in command_lines(page.read_text(), page_name(page))]
RUNS = [line for line in LINES if RUN.match(line.command)]


def test_every_command_line_of_the_pages_is_run_or_says_why_not() -> None:
    unclassified = [f"{line.where}: {line.text}" for line in LINES
                    if not RUN.match(line.command) and why_skipped(line) is None]
    assert not unclassified, "no rule says whether these run in tests/unit/test_readme.py:\n" + "\n".join(unclassified)
    both = [line.where for line in RUNS if why_skipped(line)]
    assert not both, f"lines both run and skipped: {both}"
    assert [line.command for line in RUNS][:5] == ["make venv", "./build.py --help", "./build.py list",
                                                   "./build.py show ng17e", "./build.py build ng17e --dry-run"]


def test_the_reader_finds_continued_and_fenced_lines() -> None:
    text = "para\n\n    ./build.py a \\\n        --b c   # note\n\n```sh\nmake x\n```\n    not a command\n"
    assert command_lines(text) == [Line(3, "./build.py a --b c   # note"), Line(7, "make x")]
    assert Line(3, "./build.py a --b c   # note").command == "./build.py a --b c"
    assert [line.where for line in command_lines(text, "docs/x.md")] == ["docs/x.md:3", "docs/x.md:7"]


# ------------------------------------------------------------------ the links between the pages


def prose(text: str) -> str:
    """The page without its fenced blocks and inline code, where a link is only text."""
    kept, fenced = [], False
    for raw in text.splitlines():
        if raw.lstrip().startswith("```"):
            fenced = not fenced
            kept.append("")
            continue
        kept.append("" if fenced else raw)
    return re.sub(r"(?<!`)(`+)(?!`)[\s\S]*?(?<!`)\1(?!`)", "", "\n".join(kept))


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: a link's text kept, lowercase, punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings (a repeated one gets GitHub's -1, -2, ...)."""
    found: set[str] = set()
    fenced = False
    for raw in text.splitlines():
        if raw.lstrip().startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", raw)
        if heading:
            name, n = anchor(heading.group(1)), 0
            while (name if n == 0 else f"{name}-{n}") in found:
                n += 1
            found.add(name if n == 0 else f"{name}-{n}")
    return found


LINK = re.compile(r"\[[^\]]*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_links(page: Path) -> list[tuple[Path, str]]:
    """Each relative link of a page: the file it names (the page itself for `#anchor`) and its anchor."""
    found = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        found.append(((page.parent / path).resolve() if path else page, fragment))
    return found


def test_the_link_reader_finds_links_outside_code_and_github_anchors() -> None:
    text = "# A `b`: c, d\n\n[x](docs/y.md#z) `[no](code.md)` [w](https://e.org)\n```\n[no](fenced.md)\n```\n## A b c d\n"
    assert LINK.findall(prose(text)) == ["docs/y.md#z", "https://e.org"]
    assert anchors(text) == {"a-b-c-d", "a-b-c-d-1"}
    assert anchor("Recipes: `images/<variant>.yaml`") == "recipes-imagesvariantyaml"
    assert anchor("A new vLLM release: `bump`") == "a-new-vllm-release-bump"


def test_every_docs_page_is_linked_from_the_readme_exactly_once() -> None:
    assert PAGES[1:], "no docs/*.md page"
    linked = [path for path, _ in relative_links(README)]
    counts = {page_name(page): linked.count(page.resolve()) for page in PAGES[1:]}
    wrong = {name: n for name, n in counts.items() if n != 1}
    assert not wrong, f"README.md must link each docs page once; times linked: {wrong}"


@pytest.mark.parametrize("page", PAGES, ids=page_name)
def test_every_relative_link_names_a_file_and_heading_that_exist(page: Path) -> None:
    broken = []
    for path, fragment in relative_links(page):
        if not path.exists():
            broken.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: no such file")
        elif fragment and fragment not in (anchors(path.read_text()) if path.suffix == ".md" else set()):
            broken.append(f"{page_name(path)}#{fragment}: no such heading")
    assert not broken, f"{page_name(page)} links to what is not there:\n" + "\n".join(broken)


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
@pytest.mark.parametrize("line", RUNS, ids=lambda line: line.where)
def test_the_readme_line_runs_as_written_on_a_fresh_clone(line: Line, clone: Path, user: pwd.struct_passwd) -> None:
    for who in (user, pwd.getpwuid(0)):
        proc = _as(who, clone, line.text, timeout=900)
        if who.pw_uid == 0:  # what root wrote (build/, __pycache__) goes back to the user, whose clone it is
            subprocess.run(["chown", "-R", f"{user.pw_uid}:{user.pw_gid}", str(clone)], check=True, timeout=600)
        said = f"{line.where}, as {who.pw_name}: `{line.text}` exited {proc.returncode}:\n" \
               f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, said
        assert not any(out.startswith("error:") for out in proc.stderr.splitlines()), said
