"""Bad recipes and mods: each gives one line naming the file and the field, exit code 2, no traceback."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.support.recipes import pypi_recipe

GOOD = pypi_recipe("0.16.0", ("good-mod",))

GOOD_MOD = """\
name: good-mod
summary: a test mod
description: a test mod
component: vllm
targets: {versions: ">=0.16.0"}
phase: install
kind: patch
patch: fix.patch
verify:
  - {file: vllm/x.py, contains: y}
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "good.yaml").write_text(GOOD)
    mod = tmp_path / "mods" / "good-mod"
    mod.mkdir(parents=True)
    (mod / "mod.yaml").write_text(GOOD_MOD)
    (mod / "fix.patch").write_text("--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1 +1 @@\n-x\n+y\n")
    return tmp_path


def write(project: Path, rel: str, text: str) -> None:
    path = project / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def replace(project: Path, old: str, new: str, rel: str = "images/good.yaml") -> None:
    path = project / rel
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new))


def child(body: str) -> str:
    return "extends: good\n" + textwrap.dedent(body)


# Each case: (how to break the project, variant to show, file named, field or words named)
CASES = {
    "malformed yaml": (lambda p: write(p, "images/good.yaml", "base: [unclosed\n"), "good",
                       "images/good.yaml", "malformed YAML: line"),
    "not a mapping": (lambda p: write(p, "images/good.yaml", "- a\n- b\n"), "good",
                      "images/good.yaml", "must be a YAML mapping"),
    "unknown top key": (lambda p: replace(p, "mods:", "colour: red\nmods:"), "good",
                        "images/good.yaml", "colour: unknown key"),
    "unknown nested key": (lambda p: replace(p, '  tag: "1.0"', '  tag: "1.0"\n  tga: x'), "good",
                           "images/good.yaml", "base.tga: unknown key"),
    "wrong type": (lambda p: replace(p, '"12.1a"', "[12.1]"), "good",
                   "images/good.yaml", "build.torch_cuda_arch_list"),
    "unquoted version number": (lambda p: replace(p, 'version: "0.16.0"', "version: 0.16"), "good",
                                "images/good.yaml", "vllm.version"),
    "unknown variant": (lambda p: None, "nope", "images", "unknown variant 'nope'"),
    "unknown parent": (lambda p: write(p, "images/kid.yaml", "extends: ghost\n"), "kid",
                       "images/kid.yaml", "extends: unknown parent variant 'ghost'"),
    "extends cycle": (lambda p: (write(p, "images/a.yaml", "extends: b\n"), write(p, "images/b.yaml", "extends: a\n")),
                      "a", "images/b.yaml", "extends: extends forms a cycle: a -> b -> a"),
    "self cycle": (lambda p: write(p, "images/a.yaml", "extends: a\n"), "a", "images/a.yaml", "cycle"),
    "short commit": (lambda p: replace(p, "  source: pypi\n", "  source: git\n  repo: https://github.com/x/y.git\n"
                                          "  ref: main\n  commit: 89a77b108\n"), "good",
                     "images/good.yaml", "vllm.commit"),
    "uppercase commit": (lambda p: replace(p, "  source: pypi\n", "  source: git\n  repo: https://github.com/x/y.git\n"
                                              "  ref: main\n  commit: 89A77B10846FD96273CCE78D86D2556EA582D26E\n"),
                         "good", "images/good.yaml", "vllm.commit"),
    "shell in version": (lambda p: replace(p, '"0.16.0"', '"0.16.0; rm -rf /"'), "good",
                         "images/good.yaml", "vllm.version"),
    "shell in ref": (lambda p: replace(p, "  source: pypi\n", "  source: git\n  repo: https://github.com/x/y.git\n"
                                          "  ref: $(reboot)\n  commit: {unknown: x}\n"), "good",
                     "images/good.yaml", "vllm.ref"),
    "shell in repo url": (lambda p: replace(p, "  source: pypi\n", "  source: git\n  repo: 'https://x.org/a`id`'\n"
                                               "  ref: main\n  commit: {unknown: x}\n"), "good",
                          "images/good.yaml", "vllm.repo"),
    "shell in env value": (lambda p: replace(p, "mods:", "env:\n  A: '$(id)'\nmods:"), "good",
                           "images/good.yaml", "env.A"),
    "bad env name": (lambda p: replace(p, "mods:", "env:\n  1A: x\nmods:"), "good", "images/good.yaml", "env"),
    "bad arch list": (lambda p: replace(p, '"12.1a"', '"sm_121"'), "good", "images/good.yaml",
                      "build.torch_cuda_arch_list"),
    "arch with a two-digit minor": (lambda p: replace(p, '"12.1a"', '"12.10a"'), "good", "images/good.yaml",
                                    "build.torch_cuda_arch_list: '12.10a' is not a valid TORCH_CUDA_ARCH_LIST"),
    "gpu with a two-digit minor": (lambda p: replace(p, "mods:", 'gpus: ["12.10"]\nmods:'), "good", "images/good.yaml",
                                   "gpus[0]: '12.10' is not a valid compute capability"),
    "protect twice": (lambda p: replace(p, "mods:", "protect: [torch, Torch]\nmods:"), "good", "images/good.yaml",
                      "protect: 'torch' and 'Torch' name one package"),
    "max_jobs out of range": (lambda p: replace(p, '"12.1a"', '"12.1a"\n  max_jobs: 0'), "good",
                              "images/good.yaml", "build.max_jobs"),
    "bad digest": (lambda p: replace(p, "{unknown: not resolved in this test}", "sha256:abc"), "good",
                   "images/good.yaml", "base.digest"),
    "empty unknown reason": (lambda p: replace(p, "{unknown: not resolved in this test}", "{unknown: ''}"),
                             "good", "images/good.yaml", "base.digest"),
    "missing field": (lambda p: replace(p, '  version: "0.16.0"\n', ""), "good", "images/good.yaml", "vllm.version"),
    "missing field in child chain": (lambda p: (replace(p, "base:\n  repository: example.org/base\n", "base:\n"),
                                                write(p, "images/kid.yaml", "extends: good\n")),
                                     "kid", "images/kid.yaml", "base.repository"),
    "unknown mod": (lambda p: replace(p, "[good-mod]", "[good-mod, ghost-mod]"), "good", "images/good.yaml",
                    "unknown mod 'ghost-mod'"),
    "mod listed twice": (lambda p: replace(p, "[good-mod]", "[good-mod, good-mod]"), "good", "images/good.yaml",
                         "mods: a mod is listed twice"),
    "remove a mod the parent lacks": (lambda p: write(p, "images/kid.yaml", child("mods: {remove: [other]}")),
                                      "kid", "images/kid.yaml", "mods.remove: cannot remove 'other'"),
    "add a mod twice": (lambda p: write(p, "images/kid.yaml", child("mods: {add: [good-mod]}")),
                        "kid", "images/kid.yaml", "mods.add: cannot add 'good-mod'"),
    "mod.yaml unknown key": (lambda p: replace(p, "phase: install", "phase: install\nphaze: x", "mods/good-mod/mod.yaml"),
                             "good", "mods/good-mod/mod.yaml", "phaze: unknown key"),
    "mod.yaml bad phase": (lambda p: replace(p, "phase: install", "phase: runtime", "mods/good-mod/mod.yaml"),
                           "good", "mods/good-mod/mod.yaml", "phase"),
    "mod.yaml missing asset": (lambda p: (p / "mods/good-mod/fix.patch").unlink(), "good",
                               "mods/good-mod/mod.yaml", "patch: 'fix.patch' is not a file"),
    "mod.yaml name mismatch": (lambda p: replace(p, "name: good-mod", "name: other-mod", "mods/good-mod/mod.yaml"),
                               "good", "mods/good-mod/mod.yaml", "name:"),
    "mod.yaml bad specifier": (lambda p: replace(p, '">=0.16.0"', '"sixteen"', "mods/good-mod/mod.yaml"),
                               "good", "mods/good-mod/mod.yaml", "targets.versions"),
    "mod outside its targets": (lambda p: replace(p, '">=0.16.0"', '">=0.17"', "mods/good-mod/mod.yaml"),
                                "good", "images/good.yaml", "mods: good-mod: targets vllm >=0.17"),
    "source mod on a pypi variant": (lambda p: replace(p, "phase: install", "phase: source", "mods/good-mod/mod.yaml"),
                                     "good", "images/good.yaml", "mods: good-mod: is a source-phase mod"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_gives_one_line_and_exit_2(case: str, project: Path, cli) -> None:
    breaker, variant, file_named, words = CASES[case]
    breaker(project)
    proc = cli("--images", str(project / "images"), "--mods", str(project / "mods"), "show", variant, cwd=project)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert lines[0].startswith(f"error: {file_named}"), lines[0]
    assert words in lines[0], lines[0]


def write_bytes(project: Path, rel: str, old: bytes, new: bytes) -> None:
    path = project / rel
    body = path.read_bytes()
    assert old in body, old
    path.write_bytes(body.replace(old, new))


LONG = "v" * 116  # its tag, v...v-<12 hex>, would be 129 characters

# Bad input found by trying the tool as a new user (issue 11): same contract, and nothing written.
NEW_CASES = {
    "recipe not utf-8": (lambda p: write_bytes(p, "images/good.yaml", b"base:", b"# caf\xe9\nbase:"), "good",
                         "images/good.yaml", "not UTF-8 text: byte 0xe9 on line 2"),
    "mod.yaml not utf-8": (lambda p: write_bytes(p, "mods/good-mod/mod.yaml", b"a test mod\ndescription",
                                                 b"a test mod\ndescription: \xff\xfe\nfoo"), "good",
                           "mods/good-mod/mod.yaml", "not UTF-8 text: byte 0xff on line 3"),
    "newline after an arch list": (lambda p: replace(p, '"12.1a"', '"12.1a\\n"'), "good", "images/good.yaml",
                                   "build.torch_cuda_arch_list: '12.1a\\n' is not a valid TORCH_CUDA_ARCH_LIST"),
    "newline after a version": (lambda p: replace(p, '"0.16.0"', '"0.16.0\\n"'), "good", "images/good.yaml",
                                "vllm.version: '0.16.0\\n'"),
    "newline after a mod name": (lambda p: replace(p, "[good-mod]", '["good-mod\\n"]'), "good",
                                 "images/good.yaml", "mods[0]: 'good-mod\\n' is not a valid name"),
    "field path of a list item": (lambda p: replace(p, "[good-mod]", "[good-mod, Bad_Mod]"), "good",
                                  "images/good.yaml", "mods[1]: 'Bad_Mod' is not a valid name"),
    "field path of an added mod": (lambda p: write(p, "images/kid.yaml", child("mods: {add: [Bad]}")), "kid",
                                   "images/kid.yaml", "mods.add[0]: 'Bad' is not a valid name"),
    "markup in a bad value": (lambda p: replace(p, "mods:", "env:\n  A: '[/]x[bold]'\nmods:"), "good",
                              "images/good.yaml", "env.A: '[/]x[bold]' is not a valid environment value"),
    "variant name too long for a tag": (lambda p: write(p, f"images/{LONG}.yaml", child("")), LONG,
                                        f"images/{LONG}.yaml", "variant name: the variant name is 116 characters"),
    "variant name with a newline": (lambda p: None, "good\n", "images", "'good\\n' is not a variant name"),
    "patch path climbs out": (lambda p: replace(p, "patch: fix.patch", "patch: sub/../../x.patch",
                                                "mods/good-mod/mod.yaml"), "good",
                              "mods/good-mod/mod.yaml", "patch: 'sub/../../x.patch' is not a valid relative path"),
    "absolute patch path": (lambda p: replace(p, "patch: fix.patch", "patch: /etc/passwd", "mods/good-mod/mod.yaml"),
                            "good", "mods/good-mod/mod.yaml", "patch: '/etc/passwd' is not a valid relative path"),
    "verify file climbs out": (lambda p: replace(p, "file: vllm/x.py", "file: ../../etc/passwd",
                                                 "mods/good-mod/mod.yaml"), "good",
                               "mods/good-mod/mod.yaml", "verify[0].file: '../../etc/passwd' is not a valid path"),
    "repository too long": (lambda p: replace(p, "example.org/base", "example.org/" + "b" * 250), "good",
                            "images/good.yaml", "base.repository: "),
}


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", sorted(NEW_CASES))
def test_bad_input_renders_nothing(case: str, project: Path, cli) -> None:
    breaker, variant, file_named, words = NEW_CASES[case]
    breaker(project)
    before = tree(project)
    proc = cli("--images", str(project / "images"), "--mods", str(project / "mods"), "render", variant,
               "-o", str(project / "out"), cwd=project)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and proc.stderr.endswith("\n") and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "function-after" not in proc.stderr
    assert lines[0].startswith(f"error: {file_named}"), lines[0]
    assert words in lines[0], lines[0]
    assert proc.stdout == ""
    assert tree(project) == before
    assert not (project / "out").exists()


def test_the_good_project_is_good(project: Path, cli) -> None:
    proc = cli("--images", str(project / "images"), "--mods", str(project / "mods"), "show", "good", cwd=project)
    assert proc.returncode == 0, proc.stderr
    assert "good-mod" in proc.stdout


def test_render_refuses_a_folder_it_did_not_write(tmp_path: Path, cli) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    proc = cli("render", "ng17", "-o", str(tmp_path))
    assert proc.returncode == 2
    assert "was not rendered by sparkforge" in proc.stderr
    assert (tmp_path / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("ref", ["not a ref!", "example.org/base:1.0\n", "example.org/base:1.0\n@sha256:" + "a" * 64])
def test_bad_base_reference(cli, ref: str) -> None:
    proc = cli("show", "ng17", "--base", ref)
    assert proc.returncode == 2
    assert proc.stderr == f"error: --base: {ref!r} is not an image reference REPOSITORY:TAG[@sha256:DIGEST]\n"


# Bad options of the commands: (arguments, words of the one line). {p} is the project folder.
OPTION_CASES = {
    "render onto a file": (["render", "good", "-o", "{p}/afile"], "error: afile: --output: is a file, not a folder"),
    "render below a file": (["render", "good", "-o", "{p}/afile/sub"], "error: afile: --output: is a file"),
    "check-mods --since abc": (["check-mods", "good", "--since", "abc"],
                               "error: --since: 'abc' is not a release version such as 0.17.0"),
    "check-mods --until before --since": (["check-mods", "good", "--matrix", "--since", "0.17.0", "--until", "0.16.0"],
                                          "error: --until: 0.16.0 is before --since 0.17.0"),
    "check-mods without a variant": (["check-mods"], "error: check-mods: name at least one variant, or use --all"),
    "outdated --until abc": (["outdated", "good", "--until", "abc"], "error: --until: 'abc' is not a release version"),
    "build --network": (["build", "good", "--network", "bridge0"],
                        "error: build: --network: 'bridge0' is not one of 'host', 'none', 'default'; usage: "),
    "build --ca-cert missing": (["build", "good", "--ca-cert", "{p}/nope.pem"],
                                "error: nope.pem: --ca-cert: CA bundle not found"),
    "test --tier": (["test", "good", "--tier", "warp"], "error: test: --tier: 'warp' is not one of 'static', 'gpu'"),
    "usage: --max-jobs 0": (["build", "good", "--max-jobs", "0"],
                            "error: build: --max-jobs: input should be greater than or equal to 1; usage: "),
    "usage: unknown option": (["show", "good", "--colour"], "error: show: no such option --colour; usage: "),
    "usage: missing argument": (["show"], "error: show: missing argument VARIANT; usage: "),
    "usage: missing second argument": (["diff", "good"], "error: diff: missing argument B; usage: "),
    "usage: missing argument of a sub-verb": (["mod", "new"], "error: mod new: missing argument NAME; usage: "),
    "usage: no such command": (["nosuch"], "error: no such command 'nosuch'; usage: "),
}


@pytest.mark.parametrize("case", sorted(OPTION_CASES))
def test_a_bad_option_gives_one_line_and_changes_nothing(case: str, project: Path, cli) -> None:
    args, words = OPTION_CASES[case]
    (project / "afile").write_text("mine\n")
    before = tree(project)
    proc = cli("--images", str(project / "images"), "--mods", str(project / "mods"),
               *(a.replace("{p}", str(project)) for a in args), cwd=project)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(words), proc.stderr
    assert tree(project) == before


def test_text_from_files_is_printed_as_written(project: Path, cli) -> None:
    """Rich markup in a recipe, or in a file name, is text: never styled, eaten, or a crash."""
    replace(project, "base:", "description: '[bold]kept[/bold], [/] and [red'\nbase:")
    (project / "images" / "[b]odd.yaml").write_text("extends: good\n")
    args = ("--images", str(project / "images"), "--mods", str(project / "mods"))
    shown = cli(*args, "show", "good", cwd=project, check=True)
    assert "[bold]kept[/bold], [/] and [red" in shown.stdout
    names = cli(*args, "list", "--names", cwd=project, check=True)
    assert names.stdout.splitlines() == ["[b]odd", "good"]
    proc = cli(*args, "show", "[b]odd", cwd=project)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "'[b]odd' is not a variant name" in proc.stderr


def test_version_answers_without_a_command(cli) -> None:
    from sparkforge import __version__

    proc = cli("--version")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"sparkforge {__version__}\n", "")
