"""What the command line prints: text from files is shown as written, never read as Rich markup, and every
text is one line, with whatever is not text (a line break, an escape sequence, a bidirectional override, a
file name's undecodable byte) shown as its escape."""

from __future__ import annotations

import importlib
import io
import shutil
import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.table import Table
from rich.text import Text

from sparkforge.recipe.lock import make_lock
from sparkforge.recipe.lockfile import lock_path, write_lock
from sparkforge.recipe.planner import plan_variant
from tests.support.paths import IMAGES
from tests.support.recipes import layout, unlocked_images

app = importlib.import_module("sparkforge.cli.app")  # the module, not the typer app the package exports
NOT_TEXT = {"Cc", "Cf", "Cs", "Zl", "Zp"}


def test_markup_in_a_description_is_printed_as_written(cli, tmp_path: Path) -> None:
    images = tmp_path / "images"
    shutil.copytree(IMAGES, images)
    (images / "marked.yaml").write_text("extends: ng17\ndescription: '[bold]kept[/bold] and [/] too'\n")
    for args in (("show", "marked"), ("list",)):
        proc = cli("--images", str(images), *args)
        assert proc.returncode == 0, proc.stderr
    proc = cli("--images", str(images), "show", "marked", check=True)
    assert "[bold]kept[/bold] and [/] too" in proc.stdout


@pytest.fixture
def printed():
    """What the command line's own stdout console prints, captured."""
    console = app.out
    console.file = io.StringIO()
    try:
        yield console
    finally:
        console.file = None  # back to sys.stdout


def lines_of(console) -> list[str]:
    text = console.file.getvalue()
    assert text.endswith("\n")
    return text[:-1].split("\n")


def shown(ch: str) -> bool:
    return unicodedata.category(ch) not in NOT_TEXT


@given(st.text(st.characters(exclude_categories=()), max_size=40))  # surrogates too: undecodable file names
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_text_prints_as_one_line_of_text(printed, text: str) -> None:
    for form in (text, Text(text), Text.assemble(("x", "bold"), (text, "red"), "y")):
        printed.file = io.StringIO()
        printed.print(form, markup=False)
        (line,) = lines_of(printed)
        assert all(map(shown, line)), repr(line)
        if all(map(shown, text)):
            assert text in line
    printed.file = io.StringIO()
    table = Table("a", "b", box=None, pad_edge=False)
    table.add_row(Text(text), text)
    table.add_row("second", "row")
    printed.print(table)
    header, first, second = lines_of(printed)
    assert second.startswith("second") and all(map(shown, first))


def test_a_style_is_kept_on_the_text_around_an_escape() -> None:
    text = app.one_line(Text.assemble("plain ", ("red\nline", "red"), " tail"))
    assert text.plain == "plain red\\nline tail"
    assert [(s.start, s.end, str(s.style)) for s in text.spans] == [(6, 15, "red")]


def test_a_lines_reason_in_a_lock_is_one_line_in_show(tmp_path: Path, cli) -> None:
    images = unlocked_images(tmp_path / "images")
    plan = plan_variant(layout(images), "ng17")
    lock = make_lock(plan, {}, 1767225600, packages=None,
                     packages_unresolved="no build here\nsparkforge/vllm:ng17-000000000000 FORGED")
    write_lock(lock_path(images, "ng17"), lock)
    proc = cli("--images", str(images), "show", "ng17", check=True)
    assert "no build here\\nsparkforge/vllm:ng17-000000000000 FORGED" in proc.stdout
    assert not any(line.startswith("sparkforge/vllm") for line in proc.stdout.splitlines())


def test_status_names_the_compared_build_says_what_the_columns_mean_and_counts_a_silent_node_apart(printed) -> None:
    from sparkforge.cli import views
    from sparkforge.distribute.cluster import Node
    from sparkforge.distribute.deploy import ClusterStatus, NodeStatus

    old, new = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    nodes = (NodeStatus(Node("a", "ssh://a"), old, old, None, True, True),
             NodeStatus(Node("b", "ssh://b"), new, None, None, False, False),
             NodeStatus(Node("c", "ssh://c"), None, None, "ssh: connect to host c port 22: Connection refused"))
    status = ClusterStatus(None, "sparkforge/vllm:ng17e-aaaaaaaaaaaa", "sparkforge/vllm:ng17e", nodes,
                           "sparkforge/vllm:ng17e-bbbbbbbbbbbb")
    assert status.ids == {old, new} and not status.all_match
    for line in [*views.status_lines(status, "sparkforge/vllm:ng17e"), *views.status_summary(status)]:
        printed.print(line)
    text = printed.file.getvalue()
    assert "ng17e-aaaaaaaaaaaa" in text.splitlines()[0]  # the build compared with heads its column, not the newest
    row_c = next(line for line in text.splitlines() if line.startswith("c "))
    assert "no answer" in row_c and "Connection refused" in row_c
    assert "matches head: the node's image is the head's build" in " ".join(text.split())
    assert "nodes differ: the head has no image; 2 distinct images among the 2 that answered; 1 did not answer" \
        in " ".join(text.split())


def test_at_80_columns_the_names_a_row_is_about_stay_whole() -> None:
    from types import SimpleNamespace

    from rich.console import Console

    from sparkforge.cli import views
    from sparkforge.repro.checkmods import Row, RowState

    long_detail = "vllm/model_executor/models/qwen3_next.py: no in_proj_ba construction found " * 3
    rows = [Row("ng17e-with-a-long-name", "fix-qwen35-tp4-marlin", RowState.FAILED, long_detail,
                "vllm 0.17.1rc1.dev158 (git 600a039f572a)"),
            Row("ng17e-with-a-long-name", "env VLLM_UF_EAGER_ALLREDUCE", RowState.READ, long_detail, "vllm 0.17.0")]
    site = "/usr/local/lib/python3.11/dist-packages/"
    checks = [SimpleNamespace(name=f"kernels {site}vllm/vllm_flash_attn/_vllm_fa{n}_C.abi3.so", state="ok",
                              detail="sm_120 " * 12) for n in (2, 3)]
    smoke = [SimpleNamespace(tier="static", skipped=None, checks=checks)]
    console = Console(width=80, file=io.StringIO(), color_system=None)
    console.print(views.check_table(rows, []))
    console.print(views.smoke_table(smoke))
    text = console.file.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    for name in ("ng17e-with-a-long-name", "fix-qwen35-tp4-marlin", "env VLLM_UF_EAGER_ALLREDUCE"):
        assert name in text, text
    # A check's name may fold onto the next line, but it is never cut, and the common folder is left out.
    assert "/usr/local" not in text and "…" not in text
    assert ".../vllm/vllm_flash_attn/_vllm" in text and "_fa2_C.abi3.so" in text and "_fa3_C.abi3.so" in text, text
