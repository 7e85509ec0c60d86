"""Help that teaches, usage errors with their usage, and hints that can be pasted.

Help names values as a user types them: a flag shows no value type, an argument its metavar (`VARIANT`, not
`{variant}` or `<str>`), an option its metavar (`--base REF`, not `<str>`), and `[@sha256:DIGEST]` is shown,
not eaten as Rich markup. Every usage error is one line in the style of every other error, with the usage.
A hint to run a command repeats the options the user gave that the hinted verb takes.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from sparkforge.cli.app import program
from tests.support.cli import BUILD, assert_one_line, run_cli
from tests.support.paths import CA

# Every verb, as `--help` is asked of it; the ten that take --base.
VERBS = [("list",), ("show",), ("render",), ("check-mods",), ("build",), ("test",), ("inspect",), ("push",),
         ("deploy",), ("status",), ("registry",), ("history",), ("lock",), ("verify-repro",), ("diff",),
         ("outdated",), ("wheels", "list"), ("wheels", "prune"), ("mod", "new"), ("mod", "save"), ("wheels",),
         ("mod",), ()]
WITH_BASE = {"show", "render", "build", "test", "push", "deploy", "status", "history", "lock", "verify-repro"}
WIDE = {"COLUMNS": "250"}  # one option a line: nothing of a help text is cut at the edge of the table


def help_text(*verb: str) -> str:
    proc = run_cli(*verb, "--help", env=WIDE)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return proc.stdout


@pytest.mark.parametrize("verb", VERBS, ids=lambda v: " ".join(v) or "build.py")
def test_help_names_values_as_they_are_typed(verb: tuple[str, ...]) -> None:
    text = help_text(*verb)
    usage = next(line for line in text.splitlines() if "Usage:" in line)
    assert not set("{}<>") & set(usage), usage
    panels = "\n".join(line for line in text.splitlines() if "│" in line)  # the rows of arguments and options
    for unreadable in ("<bool>", "<str>", "<path>", "<int", "<float", "<list"):
        assert unreadable not in panels, (unreadable, text)
    assert re.search(r"--help +Show this message", text), text  # the flag, and no type beside it
    if verb and verb[0] in WITH_BASE:
        assert "--base" in text and "REPOSITORY:TAG, with @sha256:DIGEST after it to pin it (changes the tag)" in text, text


def test_usage_lines_name_arguments_by_their_metavar() -> None:
    assert "Usage: build.py check-mods [OPTIONS] [VARIANTS]..." in help_text("check-mods")
    assert "Usage: build.py diff [OPTIONS] A B" in help_text("diff")
    assert "Usage: build.py mod new [OPTIONS] NAME" in help_text("mod", "new")
    build = help_text("build")
    assert re.search(r"--max-jobs +N \[x>=1\]", build) and re.search(r"--no-cache +Rebuild every step", build)
    assert re.search(r"--network +<host\|none\|default>", build), build  # a closed choice lists its words


# Each usage error: its arguments and the start of its one line; the usage to follow comes after.
USAGE = {
    "a missing argument": (("diff", "ng17"), "error: diff: missing argument B; usage: ", "diff [OPTIONS] A B"),
    "a missing argument of a sub-verb": (("mod", "save"), "error: mod save: missing argument NAME; usage: ",
                                         "mod save [OPTIONS] NAME"),
    "an unknown option": (("show", "ng17", "--jsn"), "error: show: no such option --jsn (did you mean --json?); usage: ",
                          "show [OPTIONS] VARIANT"),
    "a closed choice": (("deploy", "ng17", "--mode", "rsync"),
                        "error: deploy: --mode: 'rsync' is not one of 'registry', 'stream'; usage: ",
                        "deploy [OPTIONS] VARIANT"),
    "an out-of-range number": (("build", "ng17", "--max-jobs", "0"),
                               "error: build: --max-jobs: input should be greater than or equal to 1; usage: ",
                               "build [OPTIONS] VARIANT"),
    "an unknown verb": (("lsit",), "error: no such command 'lsit' (did you mean 'list'?); usage: ",
                        "[OPTIONS] COMMAND [ARGS]..."),
}


@pytest.mark.parametrize("case", sorted(USAGE))
def test_a_usage_error_is_one_line_with_its_usage(case: str) -> None:
    args, start, usage = USAGE[case]
    line = assert_one_line(run_cli(*args))
    assert line.startswith(start), line
    assert f"usage: {BUILD} {usage} (`{BUILD}" in line, line


# ------------------------------------------------------------------ hints


def test_a_hint_repeats_the_options_the_user_gave_that_its_verb_takes(tmp_path: Path) -> None:
    """build --locked without a lock: `lock` is hinted with the same recipes, mods, base and CA bundle, and
    without the options of build's own that lock does not take (or that name no plan)."""
    from tests.support.paths import IMAGES, MODS

    proc = run_cli("--images", str(IMAGES), "--mods", str(MODS), "build", "ng030", "--locked", "--no-cache",
                   "--base", "example.org/base:1.0", "--ca-cert", CA, "--max-jobs", "2", cwd=tmp_path)
    line = assert_one_line(proc)
    hinted = line.split("; write one with `", 1)[1].removesuffix("`")
    assert shlex.split(hinted) == [str(BUILD), "--images", str(IMAGES), "--mods", str(MODS), "lock", "ng030",
                                   "--base", "example.org/base:1.0", "--ca-cert", CA]


def test_a_hint_without_options_given_is_the_plain_command(tmp_path: Path) -> None:
    proc = run_cli("mod", "save", "no-such-mod", cwd=tmp_path)
    line = assert_one_line(proc, "no work tree of mod no-such-mod here")
    assert line.endswith(f"; make one with `{BUILD} mod new no-such-mod --variant VARIANT`"), line


def test_a_hint_names_this_program_as_it_was_started(monkeypatch) -> None:
    monkeypatch.setattr("sys.argv", ["build.py"])
    assert program() == "./build.py"
    monkeypatch.setattr("sys.argv", ["/opt/sparkforge/build.py"])
    assert program() == "/opt/sparkforge/build.py"


def test_the_readme_command_table_names_every_verb_and_only_options_its_verb_takes() -> None:
    """The README's words and --help's agree: each verb has a row, and an option a row names is the verb's."""
    from typer.main import get_command

    from sparkforge.cli import app
    from tests.support.paths import ROOT

    root = get_command(app)
    verbs: dict[str, object] = {}
    for name, command in root.commands.items():  # type: ignore[attr-defined]
        subs = getattr(command, "commands", None)
        verbs.update({f"{name} {sub}": c for sub, c in subs.items()} if subs else {name: command})
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| command | what it does |"):]
    rows = [line.split(" | ", 1)[0] for line in table.splitlines()[2:] if line.startswith("| `")]
    named: set[str] = set()
    for cell in rows:
        for usage in re.findall(r"`([^`]+)`", cell):
            words = usage.split()
            verb = next((v for v in (" ".join(words[:2]), words[0]) if v in verbs), None)
            assert verb is not None, f"README names an unknown verb: {usage}"
            named.add(verb)
            takes = {o for p in verbs[verb].params for o in (*p.opts, *p.secondary_opts)}  # type: ignore[attr-defined]
            stale = sorted(set(re.findall(r"--[a-z][a-z-]*", usage)) - takes)
            assert not stale, f"README: `{usage}` names {stale}, which `{verb} --help` does not have"
    assert sorted(set(verbs) - named) == [], "verbs without a row in the README's command table"


def _commands() -> list[tuple[str, ...]]:
    """Every command and group of the program, as the words that name it."""
    import typer.main

    from sparkforge.cli import app

    found: list[tuple[str, ...]] = []

    def walk(command: object, words: tuple[str, ...]) -> None:
        found.append(words)
        for name, sub in (getattr(command, "commands", None) or {}).items():
            walk(sub, (*words, name))

    walk(typer.main.get_command(app), ())
    return found


def test_help_at_80_columns_cuts_no_word() -> None:
    """Rich shortens a word longer than the help column with an ellipsis: no help text may hold such a word."""
    commands = _commands()
    assert {("prune",), ("launch",), ("bump",), ("mod", "new"), ("wheels", "prune")} <= set(commands)
    for words in commands:
        proc = run_cli(*words, "--help", env={"COLUMNS": "80"})
        assert proc.returncode == 0, proc.stderr
        cut = [line for line in proc.stdout.splitlines() if "…" in line]
        assert not cut, (words, cut)
