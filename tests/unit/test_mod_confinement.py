"""Hostile mods: every path a mod names stays in its root, links are never followed out, and a
patcher runs in a child process with a time limit.

Each case is refused with one line naming the mod and the path, by `check-mods` (exit 1), by
`render` where the mod folder itself is at fault, and by the image-side package run as the image build
runs it; a check after each shows that nothing outside the scratch root was created or changed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparkforge import inimage
from sparkforge.recipe import sources
from sparkforge.repro.checkmods import check_variant
from sparkforge.recipe.layout import Layout
from sparkforge.recipe.planner import plan_variant
from tests.support.limits import ended
from tests.support.seam import mod_doc
from tests.support.paths import IMAGES, MODS, ROOT

MOD = "hostile-mod"


def spec_for(kind: str, **fields) -> dict:
    spec = {"name": MOD, "summary": "a hostile test mod", "description": "a hostile test mod",
            "component": "vllm", "targets": {"versions": ">=0.17.0"}, "phase": "install", "kind": kind,
            "verify": [{"file": "vllm/__init__.py", "contains": "vllm"}]}
    spec.update(fields)
    return spec


def make_project(tmp: Path, spec: dict, files: dict[str, str]) -> tuple[Path, Path]:
    """An images folder (ng17, and the variant `hostile` that lists only the mod) and a mods folder."""
    images, folder = tmp / "images", tmp / "mods" / MOD
    images.mkdir()
    shutil.copy(IMAGES / "ng17.yaml", images)
    (images / "hostile.yaml").write_text(f"extends: ng17\nmods: [{MOD}]\n")
    folder.mkdir(parents=True)
    (folder / "mod.yaml").write_text(json.dumps(spec, indent=2))  # JSON is YAML
    for rel, body in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(body)
    return images, tmp / "mods"


@pytest.fixture(autouse=True)
def wide_tables(monkeypatch) -> None:
    """Wide enough that the check-mods table keeps each row on one line."""
    monkeypatch.setenv("COLUMNS", "400")


@pytest.fixture
def outside(tmp_path: Path):
    """A folder outside every root, with a sentinel file; the test fails if anything in it changes."""
    place = tmp_path / "outside"
    place.mkdir()
    (place / "sentinel.txt").write_text("untouched\n")

    def snapshot() -> dict[str, bytes]:
        return {p.relative_to(place).as_posix(): p.read_bytes() for p in place.rglob("*") if p.is_file()}

    before = snapshot()
    yield place
    assert snapshot() == before, "a mod changed or created a file outside its root"


def up_to_slash(path: Path) -> str:
    """A relative path that climbs from any folder up to / and down to path."""
    return "../" * 16 + str(path).lstrip("/")


def assert_one_line_refusal(proc: subprocess.CompletedProcess, *needles: str, config: str = "") -> None:
    """The mod is refused as bad input before any tree is touched: exit 2 and one line naming its mod.yaml,
    the field (config) where the schema refuses it, else the reason (needles) the static check gives."""
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{MOD}/mod.yaml: " in lines[0], proc.stderr
    if config:
        assert f"{MOD}/mod.yaml: {config}" in lines[0], lines[0]
        return
    for needle in needles:
        assert needle in lines[0], lines[0]


# ------------------------------------------------------------------ check-mods, against the real vLLM 0.17.0


def patch_to(path: str) -> str:
    return f"--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n-untouched\n+written by a mod\n"


def test_patch_header_that_climbs_out_is_refused(tmp_path: Path, outside: Path, cli) -> None:
    target = up_to_slash(outside / "sentinel.txt")
    images, mods = make_project(tmp_path, spec_for("patch", patch="p.diff"), {"p.diff": patch_to(target)})
    proc = cli("--images", str(images), "--mods", str(mods), "check-mods", "hostile")
    assert_one_line_refusal(proc, "patch header", "climbs out of its root")


def test_absolute_patch_header_is_refused(tmp_path: Path, outside: Path, cli) -> None:
    target = str(outside / "sentinel.txt")
    diff = f"--- {target}\n+++ {target}\n@@ -1 +1 @@\n-untouched\n+written by a mod\n"
    images, mods = make_project(tmp_path, spec_for("patch", patch="p.diff"), {"p.diff": diff})
    proc = cli("--images", str(images), "--mods", str(mods), "check-mods", "hostile")
    assert_one_line_refusal(proc, "patch header", "absolute path")


PATCHER = """\
TARGETS = [{target!r}]
def is_applied(sources):
    return all("written by a mod" in text for text in sources.values())
def transform(sources):
    return {{path: "written by a mod\\n" for path in sources}}
"""


@pytest.mark.parametrize("how", ["absolute", "climbing"])
def test_patcher_targets_outside_are_refused(how: str, tmp_path: Path, outside: Path, cli) -> None:
    sentinel = outside / "sentinel.txt"
    target = str(sentinel) if how == "absolute" else up_to_slash(sentinel)
    images, mods = make_project(tmp_path, spec_for("patcher", patcher="patcher.py"),
                                {"patcher.py": PATCHER.format(target=target)})
    proc = cli("--images", str(images), "--mods", str(mods), "check-mods", "hostile")
    assert_one_line_refusal(proc, "patcher TARGETS entry")


def test_files_src_outside_the_mod_folder_is_refused(tmp_path: Path, outside: Path, cli) -> None:
    spec = spec_for("files", component="image", files=[{"src": "sub/../../secret.txt", "dest": "/opt/x"}],
                    verify=[{"file": "/opt/x", "contains": "secret"}])
    images, mods = make_project(tmp_path, spec, {"sub/keep.txt": "a folder for the path to pass through\n"})
    (mods / "secret.txt").write_text("secret\n")
    proc = cli("--images", str(images), "--mods", str(mods), "check-mods", "hostile")
    assert_one_line_refusal(proc, "files[0].src", "climbs out of its root", config="files[0].src")


def test_verify_file_outside_the_tree_is_refused_before_anything_is_applied(tmp_path: Path, outside: Path,
                                                                            cli) -> None:
    spec = spec_for("patch", patch="p.diff", verify=[{"file": "../../etc/passwd", "contains": "root"}])
    images, mods = make_project(tmp_path, spec, {"p.diff": patch_to("vllm/__init__.py")})
    proc = cli("--images", str(images), "--mods", str(mods), "check-mods", "hostile")
    assert_one_line_refusal(proc, "verify[0].file", "'../../etc/passwd'", config="verify[0].file")


def test_link_in_a_mod_folder_is_refused_by_check_mods_and_render(tmp_path: Path, outside: Path, cli) -> None:
    spec = spec_for("patch", patch="p.diff")
    images, mods = make_project(tmp_path, spec, {"p.diff": patch_to("vllm/__init__.py")})
    host = tmp_path / "host"
    host.mkdir()
    (host / "host-secret.txt").write_text("a host file that must never reach a build context\n")
    os.symlink(host / "host-secret.txt", mods / MOD / "extra.txt")
    # The plan stage reads the mod folder first (its digest is part of the plan), and refuses the link there.
    proc = cli("--images", str(images), "--mods", str(mods), "check-mods", "hostile")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert "extra.txt is a link" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    ctx = tmp_path / "ctx"
    proc = cli("--images", str(images), "--mods", str(mods), "render", "hostile", "-o", str(ctx))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "extra.txt is a link" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not ctx.exists()


# ------------------------------------------------------------------ as the image build runs the package


def run_inimage(folder: Path, root: Path, *extra: str) -> subprocess.CompletedProcess:
    """Run the image-side package from a folder of its own, as the image holds it in /opt/sparkforge."""
    tool = folder.parents[1] / "sparkforge" / "inimage"
    shutil.copytree(ROOT / "sparkforge" / "inimage", tool, ignore=shutil.ignore_patterns("__pycache__"))
    return subprocess.run([sys.executable, "-I", str(tool), "apply", str(folder), "--root", str(root), *extra],
                          capture_output=True, text=True, timeout=120)


def image_mod(tmp: Path, spec: dict, files: dict[str, str]) -> Path:
    """A mod folder as the build context holds it: mod.json and its assets (no config check on the way)."""
    folder = tmp / "ctx" / "mods" / MOD
    folder.mkdir(parents=True)
    (folder / "mod.json").write_text(mod_doc(spec).to_json() if spec else "{}")
    for rel, body in files.items():
        (folder / rel).write_text(body)
    return folder


@pytest.mark.parametrize("case", ["patch-header", "patch-absolute", "files-dest", "files-dest-absolute-climb",
                                  "files-src", "verify-file", "patcher-targets"])
def test_in_image_applier_refuses_paths_out_of_the_root(case: str, tmp_path: Path, outside: Path) -> None:
    root = tmp_path / "root"
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("untouched\n")
    sentinel = outside / "sentinel.txt"
    spec, files, needle = {
        "patch-header": (spec_for("patch", patch="p.diff"), {"p.diff": patch_to(up_to_slash(sentinel))},
                         "climbs out"),
        "patch-absolute": (spec_for("patch", patch="p.diff"),
                           {"p.diff": f"--- {sentinel}\n+++ {sentinel}\n@@ -1 +1 @@\n-untouched\n+x\n"},
                           "absolute path"),
        "files-dest": (spec_for("files", files=[{"src": "f.txt", "dest": up_to_slash(outside / "new.txt")}]),
                       {"f.txt": "dropped\n"}, "files[0].dest"),
        "files-dest-absolute-climb": (spec_for("files", files=[{"src": "f.txt", "dest": "/opt/../../new.txt"}]),
                                      {"f.txt": "dropped\n"}, "files[0].dest"),
        "files-src": (spec_for("files", files=[{"src": "../../../outside/sentinel.txt", "dest": "/opt/copy.txt"}]),
                      {}, "files[0].src"),
        "verify-file": (spec_for("patch", patch="p.diff", verify=[{"file": up_to_slash(sentinel),
                                                                   "contains": "untouched"}]),
                        {"p.diff": patch_to("vllm/__init__.py")}, "verify[0].file"),
        "patcher-targets": (spec_for("patcher", patcher="patcher.py"),
                            {"patcher.py": PATCHER.format(target=str(sentinel))}, "patcher TARGETS entry"),
    }[case]
    before = (root / "vllm" / "__init__.py").read_bytes()
    proc = run_inimage(image_mod(tmp_path, spec, files), root)
    assert proc.returncode == 1
    assert proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"mod {MOD}: FAILED: ") and needle in proc.stderr
    assert (root / "vllm" / "__init__.py").read_bytes() == before
    assert sorted(p.name for p in root.rglob("*")) == ["__init__.py", "vllm"]


def test_links_in_the_tree_are_not_followed_out_of_it(tmp_path: Path, outside: Path) -> None:
    root = tmp_path / "root"
    (root / "vllm").mkdir(parents=True)
    os.symlink(outside, root / "vllm" / "escape")  # a folder link out of the tree
    os.symlink(outside / "sentinel.txt", root / "vllm" / "sentinel.txt")  # a file link out of the tree
    for target in ("vllm/escape/sentinel.txt", "vllm/sentinel.txt"):
        result = inimage.apply_mod(mod_doc(spec_for("patch", patch="p.diff")),
                                     image_mod(tmp_path / target.replace("/", "-"), {},
                                               {"p.diff": patch_to(target)}), root)
        assert result.state == "failed" and "is a link in the tree" in result.detail, result
        assert target in result.line()


def test_links_that_stay_in_the_tree_are_followed(tmp_path: Path) -> None:
    """A merged-/usr image has /bin -> usr/bin; a drop-in file through it lands in usr/bin."""
    root = tmp_path / "root"
    (root / "usr" / "bin").mkdir(parents=True)
    os.symlink("usr/bin", root / "bin")
    folder = image_mod(tmp_path, {}, {"tool": "#!/bin/sh\n"})
    spec = spec_for("files", component="image", files=[{"src": "tool", "dest": "/bin/tool", "mode": "0755"}],
                    verify=[{"file": "/bin/tool", "contains": "#!/bin/sh"}])
    assert inimage.apply_mod(mod_doc(spec), folder, root).state == "applied"
    assert (root / "usr" / "bin" / "tool").read_text() == "#!/bin/sh\n" and (root / "bin").is_symlink()
    assert [c[1] for c in inimage.verify_mod(mod_doc(spec), root, in_image=False)] == ["ok"]


# ------------------------------------------------------------------ patchers in a child process


BAD_PATCHERS = {
    "raises": ("TARGETS = ['vllm/__init__.py']\ndef is_applied(s):\n    return False\n"
               "def transform(s):\n    raise KeyError('boom')\n", "raised KeyError during run: 'boom'"),
    "exits-at-import": ("import sys\nsys.exit(3)\n", "called sys.exit(3) during import"),
    "hard-exit": ("import os\nos._exit(7)\n", "exited with code 7 without a result"),
    "loops": ("TARGETS = ['vllm/__init__.py']\ndef is_applied(s):\n    while True:\n        pass\n"
              "def transform(s):\n    return s\n", "did not finish within 2 s"),
    "bad-result": ("TARGETS = ['vllm/__init__.py']\ndef is_applied(s):\n    return False\n"
                   "def transform(s):\n    return {'vllm/__init__.py': 42}\n", "must return a dict of path -> text"),
    "prints-a-lot": ("import sys\nsys.stderr.write('x' * 300_000)\nprint('y' * 300_000)\n"
                     "TARGETS = ['vllm/__init__.py']\ndef is_applied(s):\n    return 'ok' in s['vllm/__init__.py']\n"
                     "def transform(s):\n    return {'vllm/__init__.py': 'ok\\n'}\n", ""),
    "prints": ("print('noise')\nTARGETS = ['vllm/__init__.py']\ndef is_applied(s):\n    return 'ok' in "
               "s['vllm/__init__.py']\ndef transform(s):\n    print('more noise')\n    return {'vllm/__init__.py': "
               "'ok\\n'}\n", ""),
}


@pytest.mark.parametrize("name", sorted(BAD_PATCHERS))
def test_a_patcher_that_raises_exits_or_hangs_fails_with_its_reason(name: str, tmp_path: Path) -> None:
    code, reason = BAD_PATCHERS[name]
    root = tmp_path / "root"
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("untouched\n")
    folder = image_mod(tmp_path, {}, {"patcher.py": code})
    # Only the patcher that loops meets its limit; the others end on their own, well within the default one.
    limit = 2 if name == "loops" else inimage.PATCHER_TIMEOUT
    result, seconds = ended(lambda: inimage.apply_mod(mod_doc(spec_for("patcher", patcher="patcher.py")), folder, root,
                                                      patcher_timeout=limit))
    assert type(result) is inimage.Result, result
    assert seconds >= 2 or name != "loops"
    if not reason:  # a patcher that only prints still works: its output never mixes with the answer
        assert result.state == "applied" and (root / "vllm" / "__init__.py").read_text() == "ok\n"
        return
    assert result.state == "failed" and reason in result.detail, result
    assert "\n" not in result.line()
    assert (root / "vllm" / "__init__.py").read_text() == "untouched\n"


@pytest.mark.network  # a real vLLM release from the package index
def test_a_hanging_patcher_in_check_mods_fails_in_time_and_leaves_no_scratch(tmp_path: Path) -> None:
    spec = spec_for("patcher", patcher="patcher.py")
    images, mods = make_project(tmp_path, spec, {"patcher.py": BAD_PATCHERS["loops"][0]})
    plan = plan_variant(Layout.default(ROOT, images_dir=images, mods_dir=mods), "hostile")
    sources.release_tree("vllm", "0.17.0")  # fetched (or found in the cache) before the clock starts
    work = tmp_path / "work"
    work.mkdir()
    rows, seconds = ended(lambda: check_variant(plan, work, patcher_timeout=2))
    assert seconds >= 2
    assert [(r.mod, r.state) for r in rows] == [(MOD, "failed")]
    assert "did not finish within 2 s" in rows[0].detail
    assert list(work.iterdir()) == []


@pytest.mark.network  # a real vLLM release from the package index
def test_the_shipped_patcher_still_applies_through_the_child(tmp_path: Path) -> None:
    tree = sources.release_tree("vllm", "0.17.0")
    root = tmp_path / "root"
    for rel in ("vllm/model_executor/models/qwen3_next.py", "vllm/model_executor/models/qwen3_5.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(tree / rel, root / rel)
    folder = MODS / "fix-qwen35-tp4-marlin"
    from sparkforge.recipe.config import load_mod
    spec = load_mod(MODS, folder.name)[0].model_dump(mode="json")
    assert inimage.apply_mod(mod_doc(spec), folder, root).state == "applied"
    assert inimage.apply_mod(mod_doc(spec), folder, root).state == "already"


# ------------------------------------------------------------------ the patcher's child: bounded, not sandboxed


def _patcher_tree(tmp: Path, code: str) -> tuple[Path, Path]:
    root = tmp / "root"
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("untouched\n")
    return image_mod(tmp, {}, {"patcher.py": code}), root


def _folder_state(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_patcher_runs_in_a_scratch_folder_with_only_path_and_locale(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPARKFORGE_SECRET_OF_THE_CALLER", "x")
    code = ("import os\nTARGETS = ['vllm/__init__.py']\n"
            "def is_applied(s):\n    return s['vllm/__init__.py'].startswith('cwd ')\n"
            "def transform(s):\n    open('relative.txt', 'w').write('stray')\n"
            "    return {'vllm/__init__.py': f\"cwd {os.getcwd()}\\nenv {sorted(os.environ)}\\n\"}\n")
    folder, root = _patcher_tree(tmp_path, code)
    before = _folder_state(folder)
    result = inimage.apply_mod(mod_doc(spec_for("patcher", patcher="patcher.py")), folder, root)
    assert result.state == "applied", result
    cwd, env = (root / "vllm" / "__init__.py").read_text().splitlines()
    assert env == "env ['LANG', 'LC_ALL', 'PATH']"
    scratch = Path(cwd.removeprefix("cwd "))
    assert scratch not in (folder, root) and folder not in scratch.parents and not scratch.exists()
    assert _folder_state(folder) == before  # the relative write went to the scratch folder, now gone


def test_a_process_the_patcher_starts_does_not_outlive_it(tmp_path: Path) -> None:
    code = ("import subprocess\nTARGETS = ['vllm/__init__.py']\n"
            "def is_applied(s):\n    return s['vllm/__init__.py'].startswith('pid ')\n"
            "def transform(s):\n    p = subprocess.Popen(['sleep', '300'])\n"
            "    return {'vllm/__init__.py': f'pid {p.pid}\\n'}\n")
    folder, root = _patcher_tree(tmp_path, code)
    assert inimage.apply_mod(mod_doc(spec_for("patcher", patcher="patcher.py")), folder, root).state == "applied"
    pid = int((root / "vllm" / "__init__.py").read_text().split()[1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            break
        if state in ("Z", "X"):  # killed; its new parent has not reaped it yet
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"sleep {pid}, started by the patcher, still runs after the mod was applied")


def test_is_applied_must_return_a_real_bool(tmp_path: Path) -> None:
    code = ("TARGETS = ['vllm/__init__.py']\ndef is_applied(s):\n    return 'no'\n"
            "def transform(s):\n    return {'vllm/__init__.py': 'changed\\n'}\n")
    folder, root = _patcher_tree(tmp_path, code)
    result = inimage.apply_mod(mod_doc(spec_for("patcher", patcher="patcher.py")), folder, root)
    assert result.state == "failed"
    assert result.line().startswith(f"mod {MOD}: FAILED: patcher patcher.py: is_applied() returned str 'no'")
    assert (root / "vllm" / "__init__.py").read_text() == "untouched\n"


def test_a_patcher_named_through_a_relative_mods_folder_works(tmp_path: Path, monkeypatch) -> None:
    code = ("TARGETS = ['vllm/__init__.py']\ndef is_applied(s):\n    return s['vllm/__init__.py'] == 'ok\\n'\n"
            "def transform(s):\n    return {'vllm/__init__.py': 'ok\\n'}\n")
    folder, root = _patcher_tree(tmp_path, code)
    monkeypatch.chdir(folder.parent)
    result = inimage.apply_mod(mod_doc(spec_for("patcher", patcher="patcher.py")), Path(folder.name), root)
    assert result.state == "applied", result
    assert (root / "vllm" / "__init__.py").read_text() == "ok\n"


# ------------------------------------------------------------------ what a patcher starts ends with its run


SPAWNER = """\
import os, subprocess
TARGETS = ['vllm/__init__.py']
def is_applied(s):
    return s['vllm/__init__.py'].startswith('ok')
def _daemon():
    # the classic daemon: fork, a session of its own, fork again, the middle one gone (an orphan)
    read, write = os.pipe()
    if os.fork() == 0:
        os.setsid()
        pid = os.fork()
        if pid == 0:
            os.execvp('sleep', ['sleep', '300'])
        os.write(write, str(pid).encode())
        os._exit(0)
    os.close(write)
    return int(os.read(read, 32))
def transform(s):
    pids = [subprocess.Popen(['sleep', '300']).pid,  # holds the runner's pipe
            subprocess.Popen(['sleep', '300'], stdout=subprocess.DEVNULL, start_new_session=True).pid,
            subprocess.Popen(['sleep', '300'], start_new_session=True).pid,  # a session of its own, with the pipe
            _daemon()]
    subprocess.run(['sh', '-c', 'setsid sleep 300 >/dev/null 2>&1 & echo $! > bg.pid; sleep 300 & echo $! >> bg.pid'])
    pids += [int(p) for p in open('bg.pid').read().split()]
    open({pidfile!r}, 'a').write(' '.join(map(str, pids)) + '\\n')
    return {{'vllm/__init__.py': 'ok\\n'}}
"""


def running(pids: list[int]) -> list[int]:
    """The pids of the list whose process still runs (a zombie, killed and not yet reaped, does not)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state not in ("Z", "X"):
            alive.append(pid)
    return alive


def spawned(pidfile: Path) -> list[int]:
    pids = [int(p) for p in pidfile.read_text().split()]
    assert len(pids) >= 6, pids
    return pids


def assert_all_gone(pids: list[int]) -> None:
    """Every process is gone at once (within a second: SIGKILL is delivered, not waited for)."""
    deadline = time.monotonic() + 1
    while running(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = running(pids)
    for pid in left:  # the test's own cleanup, before it fails
        os.kill(pid, 9)
    assert not left, f"processes the patcher started outlive its run: {left}"


def test_nothing_a_patcher_starts_outlives_apply(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    folder, root = _patcher_tree(tmp_path, SPAWNER.format(pidfile=str(pidfile)))
    started = time.monotonic()
    result = inimage.apply_mod(mod_doc(spec_for("patcher", patcher="patcher.py")), folder, root)
    assert result.state == "applied", result
    assert_all_gone(spawned(pidfile))
    assert time.monotonic() - started < 30  # nothing waited on a pipe a sleeping process held


def test_nothing_a_patcher_starts_outlives_the_image_side_apply(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    root = tmp_path / "root"
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("untouched\n")
    folder = image_mod(tmp_path, spec_for("patcher", patcher="patcher.py", phase="install", verify=[]),
                       {"patcher.py": SPAWNER.format(pidfile=str(pidfile))})
    proc = run_inimage(folder, root)
    assert proc.returncode == 0 and proc.stdout.startswith(f"mod {MOD}: applied"), proc.stdout + proc.stderr
    assert_all_gone(spawned(pidfile))


def test_nothing_a_hanging_patcher_starts_outlives_its_time_limit(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    code = SPAWNER.format(pidfile=str(pidfile)).replace("    return {'vllm/__init__.py'", "    import time\n"
                                                        "    time.sleep(300)\n    return {'vllm/__init__.py'")
    folder, root = _patcher_tree(tmp_path, code)
    result = inimage.apply_mod(mod_doc(spec_for("patcher", patcher="patcher.py")), folder, root, patcher_timeout=5)
    assert result.state == "failed" and "did not finish within 5 s" in result.detail, result
    assert_all_gone(spawned(pidfile))


@pytest.mark.network  # a real vLLM release from the package index
def test_nothing_a_patcher_starts_outlives_check_mods(tmp_path: Path, cli) -> None:
    pidfile = tmp_path / "pids"
    spec = spec_for("patcher", patcher="patcher.py", verify=[{"file": "vllm/__init__.py", "contains": "ok"}])
    images, mods = make_project(tmp_path, spec, {"patcher.py": SPAWNER.format(pidfile=str(pidfile))})
    proc = cli("--images", str(images), "--mods", str(mods), "check-mods", "hostile", timeout=900)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert_all_gone(spawned(pidfile))


# ------------------------------------------------------------------ drop-in files and mod folders


def test_two_files_entries_with_one_dest_are_bad_input_naming_both(tmp_path: Path, cli) -> None:
    spec = spec_for("files", component="image", files=[{"src": "a.txt", "dest": "/opt/x"},
                                                        {"src": "b.txt", "dest": "opt/x"}],
                    verify=[{"file": "/opt/x", "contains": "a"}])
    images, mods = make_project(tmp_path, spec, {"a.txt": "a\n", "b.txt": "b\n"})
    proc = cli("--images", str(images), "--mods", str(mods), "check-mods", "hostile")
    assert_one_line_refusal(proc, "files[0].dest (/opt/x) and files[1].dest (opt/x) name one file")
    proc = cli("--images", str(images), "--mods", str(mods), "render", "hostile", "-o", str(tmp_path / "ctx"))
    assert_one_line_refusal(proc, "files[0].dest (/opt/x) and files[1].dest (opt/x) name one file")
    assert not (tmp_path / "ctx").exists()


def test_two_files_entries_with_one_dest_through_a_link_fail_naming_both(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr" / "bin").mkdir(parents=True)
    os.symlink("usr/bin", root / "bin")
    folder = image_mod(tmp_path, {}, {"a": "a\n", "b": "b\n"})
    spec = spec_for("files", component="image", files=[{"src": "a", "dest": "/bin/tool"},
                                                        {"src": "b", "dest": "/usr/bin/tool"}])
    result = inimage.apply_mod(mod_doc(spec), folder, root)
    assert result.state == "failed" and "files[0].dest (/bin/tool) and files[1].dest (/usr/bin/tool)" in result.detail, \
        result
    assert list((root / "usr" / "bin").iterdir()) == []


def test_a_file_name_that_is_not_utf8_in_a_mod_folder_is_one_line(tmp_path: Path, cli) -> None:
    images, mods = make_project(tmp_path, spec_for("patch", patch="p.diff"), {"p.diff": patch_to("vllm/__init__.py")})
    (mods / MOD / os.fsdecode(b"notes-\xff.txt")).write_text("x\n")
    for verb in (["show", "hostile"], ["check-mods", "hostile"], ["render", "hostile", "-o", str(tmp_path / "ctx")]):
        proc = cli("--images", str(images), "--mods", str(mods), *verb)
        assert_one_line_refusal(proc, "notes-\\xff.txt", "not UTF-8")
    assert not (tmp_path / "ctx").exists()


@pytest.mark.parametrize("odd", ["fifo", "socket", "folder"])
def test_an_odd_file_in_a_mod_folder_is_refused_without_opening_it(odd: str, tmp_path: Path, cli) -> None:
    import socket

    images, mods = make_project(tmp_path, spec_for("patch", patch="p.diff"), {"p.diff": patch_to("vllm/__init__.py")})
    place = mods / MOD / "odd"
    if odd == "fifo":
        os.mkfifo(place)
    elif odd == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(place))
        sock.close()
    else:
        (mods / MOD / "p.diff").unlink()
        (mods / MOD / "p.diff").mkdir()
    proc = cli("--images", str(images), "--mods", str(mods), "show", "hostile", timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
