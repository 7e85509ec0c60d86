"""A hint can be pasted: when the image a verb needs is not on the engine, the command it suggests repeats the
--images, --mods and --base the user gave (the tag depends on them), so it builds the image that was missing.

Only `docker image inspect` runs here: the base named is one no build ever used, so no image has its tag.
"""

from __future__ import annotations

import shlex

import pytest

from tests.support.cli import BUILD, assert_one_line, run_cli
from tests.support.paths import TEST_MODS, VARIANTS

pytestmark = pytest.mark.docker

BASE = "sparkforge-test/never-built-base:none"
GIVEN = ("--images", str(VARIANTS), "--mods", str(TEST_MODS))
BUILD_IT = [str(BUILD), *GIVEN, "build", "testsmall", "--base", BASE]


def hinted(line: str, lead: str) -> list[str]:
    assert f"; {lead} `" in line, line
    return shlex.split(line.split(f"; {lead} `", 1)[1].removesuffix("`"))


@pytest.mark.parametrize("verb", [
    ("test", "testsmall", "--tier", "static"),
    ("push", "testsmall", "--registry", "127.0.0.1:9"),
    ("deploy", "testsmall", "--mode", "stream", "--nodes", "unix:///nonexistent/docker.sock"),
], ids=lambda verb: verb[0])
def test_a_missing_image_hints_the_build_with_the_options_given(verb: tuple[str, ...]) -> None:
    line = assert_one_line(run_cli(*GIVEN, *verb, "--base", BASE), code=1)
    assert "testsmall-" in line and ("not found" in line or "not on this machine" in line), line
    assert hinted(line, "build it first with") == BUILD_IT


def test_a_missing_build_to_go_back_to_hints_history_with_the_same_plan() -> None:
    line = assert_one_line(run_cli(*GIVEN, "deploy", "testsmall", "--mode", "stream", "--nodes",
                                   "unix:///nonexistent/docker.sock", "--base", BASE, "--to", "no-such-build"), code=1)
    assert hinted(line, "its builds are in") == [str(BUILD), *GIVEN, "history", "testsmall", "--base", BASE]
