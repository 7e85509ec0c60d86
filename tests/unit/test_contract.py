"""The documents across the host/image seam: written by the image-side tool run as the image runs
it, read by the host's readers, field by field; unknown versions and missing fields refused in one line."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sparkforge.cli import views
from sparkforge.inimage.contract import (
    SCHEMA,
    BuildRecord,
    ContractError,
    ModResult,
    ModState,
    RecordedMod,
    WheelNote,
    WheelOrigin,
)
from sparkforge.recipe.layout import Layout
from sparkforge.recipe.planner import plan_variant
from sparkforge.build.render import context_files
from tests.support.paths import ROOT


def names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """An image's /opt/sparkforge as render and the build leave it, the tool run from its own copy."""
    files = context_files(plan_variant(Layout.default(ROOT), "ng17"), Layout.default(ROOT))
    home = tmp_path / "opt-sparkforge"
    for rel, body in files.items():
        if rel.startswith("sparkforge/inimage/") or rel == "plan.json" or rel.startswith("mods/"):
            target = home / rel.removeprefix("sparkforge/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(body)
    return home


def tool(home: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-I", str(home / "inimage"), *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_every_document_written_in_the_image_reads_back_on_the_host_field_by_field(home: Path, tmp_path: Path):
    wheel = tmp_path / "vllm-0.17.0-cp38-abi3-linux_aarch64.whl"
    wheel.write_bytes(b"not really a wheel, but bytes with a sha256")
    tool(home, "note-wheel", str(wheel), "--origin", "cache", "--key", "k" * 64, "--compiled-for", "ng17-abc at T",
         "--out", str(home / "record" / "vllm-wheel.json"))
    raw = json.loads((home / "record" / "vllm-wheel.json").read_text())
    assert set(raw) == names(WheelNote) and raw["schema"] == SCHEMA
    note = WheelNote.from_dict(raw)
    assert note.origin is WheelOrigin.CACHE and note.filename == wheel.name and note.to_dict() == raw

    # A files mod (serve-torchrun) applied to a root of its own, its result recorded as the image records it.
    root = tmp_path / "root"
    root.mkdir()
    result_file = home / "record" / "mods" / "01-serve-torchrun.json"
    tool(home, "apply", str(home / "mods" / "serve-torchrun"), "--root", str(root), "--record", str(result_file))
    raw = json.loads(result_file.read_text())
    assert set(raw) == names(ModResult)
    result = ModResult.from_dict(raw)
    assert (result.name, result.result, result.root) == ("serve-torchrun", ModState.APPLIED, str(root))
    assert result.to_dict() == raw

    (home / "protect").mkdir()
    (home / "protect" / "protected.json").write_text('{"numpy": "1.26.4"}\n')
    tool(home, "record", str(home))
    raw = json.loads((home / "build-record.json").read_text())
    assert set(raw) == names(BuildRecord)
    record = BuildRecord.from_json((home / "build-record.json").read_bytes())
    assert record.to_dict() == raw
    plan = json.loads((home / "plan.json").read_text())
    assert (record.variant, record.tag, record.plan_hash) == (plan["variant"], plan["tag"], plan["plan_hash"])
    by_name = {m.name: m for m in record.mods}
    assert set(by_name) == {m["name"] for m in plan["mods"]}
    assert by_name["serve-torchrun"].result is ModState.APPLIED and by_name["uf17-eager-allreduce"].result is None
    assert all(set(m) <= names(RecordedMod) for m in raw["mods"])
    assert record.wheel == note
    text = "\n".join(line.plain for line in views.record_lines("img", record, {}))
    assert f"vllm wheel   {wheel.name} sha256 {note.sha256}; from the wheel cache" in text
    assert "mod          serve-torchrun (install)" in text and "-> applied" in text


def old_record() -> dict:
    """A build record as sparkforge wrote it before documents carried a version."""
    return {"variant": "ng17", "chain": ["ng17"], "tag": "sparkforge/vllm:ng17-0123456789ab", "plan_hash": "0" * 64,
            "base": {"repository": "nvcr.io/nvidia/vllm", "tag": "26.02-py3", "digest": {"value": None}},
            "vllm": {"version": "0.17.0", "source": "git", "ref": "v0.17.0", "commit": {"value": "b" * 40},
                     "installed_wheel": {"origin": "compiled", "filename": "vllm.whl", "sha256": "c" * 64,
                                         "cache_key": None, "compiled_for": None}},
            "components": [], "installed": {"vllm": "0.17.0"},
            "mods": [{"name": "uf17", "digest": "sha256:" + "d" * 64, "phase": "install", "result": "already"}],
            "protected": {}, "build": {"torch_cuda_arch_list": "12.1a"}, "env": [], "built_at": "2026-01-01T00:00:00Z",
            "python": "3.12.3", "tool_version": "0.1.0", "unpinned": [], "source_date_epoch": None}


def test_a_record_of_an_older_sparkforge_still_reads() -> None:
    record = BuildRecord.from_dict(old_record())
    assert record.schema == 0 and record.packages is None and record.mods[0].result is ModState.ALREADY
    assert record.wheel.origin is WheelOrigin.COMPILED
    assert any("-> already" in line.plain for line in views.record_lines("img", record, {}))


@pytest.mark.parametrize("change, message", [
    ({"schema": SCHEMA + 1}, f"schema {SCHEMA + 1} is not one this sparkforge reads"),
    ({"tag": None, "drop": "tag"}, "field 'tag' is missing (written by an older sparkforge: rebuild the image)"),
    ({"mods": [{"name": "m", "digest": "d", "phase": "install", "result": "maybe"}]},
     "mods[0]: result 'maybe' is not one of applied, already, failed"),
])
def test_an_unknown_version_or_a_missing_field_is_one_line(change: dict, message: str) -> None:
    data = old_record() | {k: v for k, v in change.items() if k != "drop"}
    data.pop(change.get("drop", "-"), None)
    with pytest.raises(ContractError) as info:
        BuildRecord.from_dict(data, "img: /opt/sparkforge/build-record.json")
    assert message in str(info.value) and "\n" not in str(info.value)
    assert str(info.value).startswith("img: /opt/sparkforge/build-record.json")


def test_the_tool_runs_isolated_from_a_copy_with_nothing_else_on_its_path(home: Path, tmp_path: Path) -> None:
    """-I: no PYTHONPATH, no working folder; the folder alone is the package (a sibling named like a
    standard module does not shadow it)."""
    (home / "inspect.py").write_text("raise SystemExit('shadowed')\n")
    shutil.copy(home / "inspect.py", home / "inimage" / "inspect.py")
    proc = subprocess.run([sys.executable, "-I", str(home / "inimage"), "smoke", "--help"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 0 and "--tier" in proc.stdout, proc.stderr
