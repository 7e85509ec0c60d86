"""The seam host -> image: plan.json and mod.json are written from the types the image reads them into,
parse back equal for every real variant, and are refused in one line naming the file when a field is
missing, renamed, of another type, or the version is not the image's. And every command the image side
runs ends at its time limit, with what it started."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparkforge.build.pipeline import load_plan
from sparkforge.build.render import context_files, plan_document
from sparkforge.inimage import record, smoke
from sparkforge.inimage.apply import verify_mod
from sparkforge.inimage.contract import CheckState, ContractError
from sparkforge.inimage.run import TimeLimit, run
from sparkforge.inimage.seam import MOD_VERSION, PLAN_VERSION, ModDoc, PlanDoc, read_mod, read_plan
from sparkforge.recipe.layout import Layout
from sparkforge.recipe.remote import materialize
from tests.support.limits import ended
from tests.support.paths import IMAGES, MODS, ROOT, TEST_MODS, VARIANTS
from tests.support.seam import image_home

VARIANT_FILES = sorted(IMAGES.glob("*.yaml")) + sorted(VARIANTS.glob("*.yaml"))


@pytest.mark.parametrize("recipe", VARIANT_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_what_render_writes_parses_back_equal(recipe: Path, tmp_path: Path) -> None:
    mods = tmp_path / "mods"  # the project's mods and those of the test variants
    for folder in sorted(MODS.iterdir()) + sorted(TEST_MODS.iterdir()):
        if folder.is_dir():
            shutil.copytree(folder, mods / folder.name)
    layout = Layout.default(ROOT, images_dir=recipe.parent, mods_dir=mods)
    plan = load_plan(layout, recipe.stem).plan
    files = context_files(plan, layout)
    doc = PlanDoc.from_json(files["plan.json"], "plan.json")
    assert doc == plan_document(plan) and doc.schema == PLAN_VERSION
    # The parts the build record copies keep the shape the resolved plan gives them (records stay comparable).
    whole = plan.to_dict()
    assert {k: getattr(doc, k).to_dict() for k in ("base", "vllm", "build")} == {k: whole[k] for k in ("base", "vllm",
                                                                                                     "build")}
    assert [c.to_dict() for c in doc.components] == whole["components"]
    assert [m.name for m in doc.mods] == [m.name for m in plan.mods]
    for mod in plan.mods:
        spec = ModDoc.from_json(files[f"mods/{mod.name}/mod.json"], f"{mod.name}/mod.json")
        assert spec == materialize(mod)[0] and spec.schema == MOD_VERSION
        assert (spec.name, spec.component, spec.phase.value, spec.kind.value) == (
            mod.name, mod.spec.component, mod.spec.phase, mod.spec.kind)


def rendered() -> tuple[dict, dict]:
    """plan.json and the mod.json of serve-torchrun (a files mod) as render writes them for ng17."""
    layout = Layout.default(ROOT)
    files = context_files(load_plan(layout, "ng17").plan, layout)
    return json.loads(files["plan.json"]), json.loads(files["mods/serve-torchrun/mod.json"])


def edited(doc: dict, path: str, value: object = "<drop>", rename: str | None = None) -> dict:
    """doc with the field at path (dots and list indexes: `components.0.kind`) set, dropped or renamed."""
    out = json.loads(json.dumps(doc))
    *parents, last = path.split(".")
    holder = out
    for key in parents:
        holder = holder[int(key)] if isinstance(holder, list) else holder[key]
    if rename:
        holder[rename] = holder.pop(last)
    elif value == "<drop>":
        holder.pop(last)
    else:
        holder[last] = value
    return out


PLAN_CASES = {
    "renamed": (dict(path="plan_hash", rename="hash"), "field 'plan_hash' is missing"),
    "missing-nested": (dict(path="vllm.install_deps"), "vllm: field 'install_deps' is missing"),
    "unknown": (dict(path="description", value="a field no image reads"), "field 'description' is not one"),
    "wrong-type": (dict(path="protect", value="torch"), "protect is a string, not a list"),
    "wrong-type-nested": (dict(path="components.0.pip_install", value="no"),
                          "components[0].pip_install is a string, not true or false"),
    "wrong-item": (dict(path="env", value=[["A", 1]]), "env[0][1] is a number, not a string"),
    "wrong-state": (dict(path="vllm.source", value="svn"), "vllm.source 'svn' is not one of git, pypi, wheel, base"),
    "newer": (dict(path="schema", value=PLAN_VERSION + 1),
              f"schema {PLAN_VERSION + 1} is not one this sparkforge reads ({PLAN_VERSION}); it was written by a newer"),
    "older": (dict(path="schema", value=PLAN_VERSION - 1),
              f"schema {PLAN_VERSION - 1} is not one this sparkforge reads ({PLAN_VERSION}); it was written by an older"),
    "no-version": (dict(path="schema"), "field 'schema' is missing: a document without a version"),
}


@pytest.mark.parametrize("case", PLAN_CASES)
def test_a_plan_the_image_cannot_read_is_one_line_naming_the_file(case: str, tmp_path: Path) -> None:
    change, words = PLAN_CASES[case]
    plan, _ = rendered()
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(edited(plan, **change)))
    with pytest.raises(ContractError) as info:
        read_plan(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and words in message and "\n" not in message, message


MOD_CASES = {
    "renamed": (dict(path="kind", rename="type"), "field 'kind' is missing"),
    "missing-nested": (dict(path="files.0.mode"), "files[0]: field 'mode' is missing"),
    "wrong-type": (dict(path="verify", value={"file": "x"}), "verify is an object, not a list"),
    "wrong-kind": (dict(path="kind", value="script"), "kind 'script' is not one of patch, patcher, files"),
    "unknown": (dict(path="summary", value="mod.yaml's summary"), "field 'summary' is not one"),
    "newer": (dict(path="schema", value=MOD_VERSION + 1), "it was written by a newer sparkforge"),
    "not-a-number": (dict(path="schema", value="2"), "schema '2' is not one this sparkforge reads"),
}


@pytest.mark.parametrize("case", MOD_CASES)
def test_a_mod_json_the_image_cannot_read_is_one_line_naming_the_file(case: str, tmp_path: Path) -> None:
    change, words = MOD_CASES[case]
    _, mod = rendered()
    path = tmp_path / "mod.json"
    path.write_text(json.dumps(edited(mod, **change)))
    with pytest.raises(ContractError) as info:
        read_mod(path, "serve-torchrun/mod.json")
    message = str(info.value)
    assert message.startswith("serve-torchrun/mod.json: ") and words in message and "\n" not in message, message


def test_the_image_tool_refuses_a_newer_mod_or_plan_in_one_line(tmp_path: Path) -> None:
    home = image_home(tmp_path)
    mod = home / "mods" / "serve-torchrun" / "mod.json"
    mod.write_text(json.dumps(json.loads(mod.read_text()) | {"schema": MOD_VERSION + 1}))
    (home / "root").mkdir()
    proc = subprocess.run([sys.executable, "-I", str(home / "inimage"), "apply", str(mod.parent), "--root",
                           str(home / "root")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and not any((home / "root").iterdir())
    assert proc.stderr.startswith("mod serve-torchrun: FAILED: serve-torchrun/mod.json: schema 3 is not one")
    assert proc.stderr.count("\n") == 1, proc.stderr
    plan = home / "plan.json"
    plan.write_text(json.dumps(edited(json.loads(plan.read_text()), "tag", rename="image_tag")))
    proc = subprocess.run([sys.executable, "-I", str(home / "inimage"), "record", str(home)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and not (home / "build-record.json").exists()
    assert proc.stderr == f"build record: {plan}: field 'tag' is missing\n"


# ------------------------------------------------------------------ time limits

NEVER_ENDS = "import signal; signal.pause()"  # a process that waits for a signal that never comes


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, killed and not yet reaped by its new parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != b"Z"


def test_a_command_that_never_ends_is_stopped_at_its_limit_with_what_it_started(tmp_path: Path) -> None:
    # The command starts a process of its own that holds its output open, and waits forever too.
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys; child = subprocess.Popen([sys.executable, '-c', sys.argv[1]]); "
            f"open({str(pid_file)!r}, 'w').write(str(child.pid)); " + NEVER_ENDS)
    outcome, seconds = ended(lambda: run([sys.executable, "-c", code, NEVER_ENDS], limit=2, what="the command"))
    assert isinstance(outcome, TimeLimit) and str(outcome) == "the command did not finish within 2 s; stopped"
    assert seconds >= 2
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10  # SIGKILL is sent to the group; on a busy machine the child ends a moment later
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child), f"process {child}, started by the command, still runs 10 s after it was killed"


def test_a_python_check_that_never_ends_fails_at_its_limit(tmp_path: Path) -> None:
    spec = ModDoc.from_dict(edited(rendered()[1], "verify", [{"file": None, "contains": None, "python": NEVER_ENDS,
                                                             "needs": []}]))
    outcome, _ = ended(lambda: verify_mod(spec, tmp_path, in_image=True, limit=1))
    assert outcome == [(f"python: {NEVER_ENDS}", CheckState.FAILED, "the check did not finish within 1 s; stopped")]


@pytest.fixture
def torch_never_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch whose import never ends, first on the path of every Python the image side starts."""
    (tmp_path / "hangs").mkdir()
    (tmp_path / "hangs" / "torch.py").write_text(NEVER_ENDS + "\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "hangs"), os.environ.get("PYTHONPATH", "")]))


def test_the_torch_and_cuda_questions_end_at_their_limits(torch_never_imports: None, tmp_path: Path) -> None:
    outcome, _ = ended(lambda: record.torch_cuda(limit=1))
    assert outcome == "import failed: import torch did not finish within 1 s; stopped"
    home = image_home(tmp_path)
    outcome, _ = ended(lambda: smoke.smoke_gpu(home, limit=1))
    assert outcome == [("torch.cuda.is_available()", CheckState.FAILED,
                        "the CUDA check did not finish within 1 s; stopped")]
