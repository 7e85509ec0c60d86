"""Words that say exactly what was checked: what was not checked says "not checked", and what had nothing to
check says "skipped", never "ok", "up to date" or a plain pin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from sparkforge.build.builder import BuildResult
from sparkforge.build.pipeline import BuildOutcome
from sparkforge.build.render import context_files
from sparkforge.cli import views
from sparkforge.inimage.contract import CheckState
from sparkforge.inimage.smoke import smoke_static
from sparkforge.recipe.layout import Layout
from sparkforge.recipe.planner import plan_variant
from sparkforge.repro.checkmods import Row, RowState
from sparkforge.repro.outdated import Outdated, Report
from sparkforge.repro.verbs import ModsReport
from tests.support.cli import run_cli
from tests.support.paths import ROOT

LAYOUT = Layout.default(ROOT)


def row(state: RowState) -> Row:
    return Row("ng17", "m", state, "", "vllm 0.17.0 (PyPI)")


def test_the_check_mods_footer_names_unverified_rows_only_when_there_are_some() -> None:
    clean = views.check_summary(ModsReport((row(RowState.APPLIED), row(RowState.READ)))).plain
    assert clean == "2 results: 2 ok, 0 failed, 0 unverified"
    some = views.check_summary(ModsReport((row(RowState.APPLIED), row(RowState.UNVERIFIED)))).plain
    assert some == "2 results: 1 ok, 0 failed, 1 unverified (not checked from here; the detail says why)"


def test_a_variant_without_mods_is_skipped_in_the_check_mods_table() -> None:
    plan = plan_variant(LAYOUT, "ng17")
    table = views.check_table([], [SimpleNamespace(variant="bare", mods=())])
    cells = [str(next(iter(col.cells))) for col in table.columns]
    assert cells == ["bare", "-", "skipped", "", "the variant has no mods"]
    assert plan.mods  # a variant with mods gets its rows from the check instead


def test_outdated_says_what_it_did_not_try() -> None:
    plan = plan_variant(LAYOUT, "ng17")
    down = Outdated("vllm", "vllm", "0.17.0", (), "not checked: cannot fetch the index", checked=False)
    report = Report(plan, (down,), (), ("uf17-eager-allreduce",))
    assert [str(x.plain) for x in views.outdated_lines(report, tried_mods=True)[1:]] == [
        "mods: not tried, since the vLLM releases could not be read"]
    current = Report(plan, (Outdated("vllm", "vllm", "0.17.0", ()),), (), ("uf17-eager-allreduce",))
    assert views.outdated_lines(current, tried_mods=True)[1].plain == "mods: skipped, no newer vLLM release to try them on"
    assert views.outdated_lines(current, tried_mods=False)[1].plain == "mods: not tried (--no-mods)"
    table = views.outdated_table([down])
    assert list(table.columns[3].cells)[0].plain == "not checked"


def test_show_says_where_a_base_digest_comes_from() -> None:
    recipe = run_cli("show", "ng030")
    assert recipe.returncode == 0, recipe.stderr
    base = next(line for line in recipe.stdout.splitlines() if line.lstrip().startswith("base "))
    assert base.endswith("@sha256:6e8ccc607fc2a51e3741667b86316a0889418ba8b78ed0ba96e8d282b648a7a6  (digest as the "
                         "recipe gives it; not checked against the registry)"), base
    unpinned = run_cli("show", "ng17e")  # its lock could not resolve the digest: nothing to say where from
    line = next(line for line in unpinned.stdout.splitlines() if line.lstrip().startswith("base "))
    assert line.strip() == "base        nvcr.io/nvidia/vllm:26.02-py3"


def test_a_build_without_the_smoke_tier_says_so(tmp_path: Path) -> None:
    plan = plan_variant(LAYOUT, "ng17")
    result = BuildResult(plan, "sha256:" + "a" * 64, plan.tag + "-candidate", tmp_path / "log", 1.0)
    lines = [line.plain for line in views.build_lines(plan, BuildOutcome(result, None, False, (plan.tag,)))]
    assert "static smoke tier: not run (--no-smoke); the tags moved without it" in lines


def image_home(tmp_path: Path, protected: dict[str, str]) -> Path:
    """/opt/sparkforge of an image of ng17 as render and the build leave it, with the base's protected builds."""
    home = tmp_path / "opt-sparkforge"
    for rel, body in context_files(plan_variant(LAYOUT, "ng17"), LAYOUT).items():
        if rel.startswith("sparkforge/inimage/") or rel == "plan.json" or rel.startswith("mods/"):
            target = home / rel.removeprefix("sparkforge/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(body)
    (home / "protect").mkdir()
    (home / "protect" / "protected.json").write_text(json.dumps(protected))
    subprocess.run([sys.executable, "-I", str(home / "inimage"), "record", str(home)], check=True, timeout=120)
    return home


def test_the_static_tier_skips_the_protected_packages_when_the_base_had_none(tmp_path: Path) -> None:
    none = {name: (state, detail) for name, state, detail in smoke_static(image_home(tmp_path / "a", {}))}
    assert none["base packages not replaced by pip"] == (
        CheckState.SKIPPED, "the base has none of the protected packages (torch, torchvision, torchaudio, triton, numpy)")
    replaced = {name: (state, detail) for name, state, detail in
                smoke_static(image_home(tmp_path / "b", {"pip": "0.0.1"}))}
    state, detail = replaced["base packages not replaced by pip"]
    assert state is CheckState.FAILED and detail.startswith("pip 0.0.1 -> "), detail
