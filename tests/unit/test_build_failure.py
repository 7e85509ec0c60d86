"""What a failed build shows: the failing step's own last lines above the one error line (BuildKit's plain
progress, as the build log holds it)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from sparkforge.build.builder import SHOWN_LINES, _BuildLog

LOG = """\
#4 [base 2/3] RUN true
#4 DONE 0.1s
#5 [runtime 3/9] RUN pip install foo
#5 0.512 Collecting foo
{noise}#4 0.9 a line of another step
#5 1.207 ERROR: Could not find a version that satisfies the requirement foo
#5 1.208 ERROR: No matching distribution found for foo
#5 ERROR: process "/bin/sh -c pip install foo" did not complete successfully: exit code: 1
"""


def failure(text: str):
    log = _BuildLog(progress=lambda step, seconds: None)
    for line in text.splitlines():
        log.feed(line)
    return log.failure(SimpleNamespace(variant="v"), 1, Path("/logs/v.log"))  # only the variant's name is read


def test_the_failing_steps_last_lines_go_with_the_error() -> None:
    exc = failure(LOG.format(noise=""))
    assert str(exc) == ('v: build failed at step [runtime 3/9] RUN pip install foo: process "/bin/sh -c pip install '
                        'foo" did not complete successfully: exit code: 1 (build log: /logs/v.log)')
    assert exc.context == ("step [runtime 3/9] RUN pip install foo, its last lines:", "Collecting foo",
                           "ERROR: Could not find a version that satisfies the requirement foo",
                           "ERROR: No matching distribution found for foo")


def test_only_the_last_lines_of_a_long_step_are_kept() -> None:
    noise = "".join(f"#5 0.6 line {i}\n" for i in range(1000))
    exc = failure(LOG.format(noise=noise))
    assert len(exc.context) == 1 + SHOWN_LINES
    assert exc.context[-1] == "ERROR: No matching distribution found for foo"


def test_a_failure_without_a_failed_step_shows_nothing_above_it() -> None:
    assert failure("#1 [internal] load build definition\n").context == ()

