#!/usr/bin/env python3
"""Apply and verify mods: the one applier used both inside the image build and by check-mods.

Stdlib only: this file is copied into the image and runs on whatever Python the base has.
Every application has three outcomes: applied, already applied (detected, skipped, reported),
or failed. A failure names the mod and the file or hunk, and leaves every file untouched.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

APPLIED = "applied"
ALREADY = "already"
FAILED = "failed"


class ModFailure(Exception):
    """The mod cannot be applied; the message says which file or hunk and why."""


@dataclass(frozen=True)
class Result:
    mod: str
    state: str  # applied | already | failed
    detail: str = ""

    def line(self) -> str:
        text = {APPLIED: "applied", ALREADY: "already applied, skipped", FAILED: "FAILED"}[self.state]
        return f"mod {self.mod}: {text}" + (f": {self.detail}" if self.detail else "")


# ------------------------------------------------------------------ unified diffs


@dataclass(frozen=True)
class Hunk:
    header: str
    old_start: int
    old: tuple[str, ...]
    new: tuple[str, ...]


@dataclass(frozen=True)
class FilePatch:
    path: str  # relative to the component root, without the a/ b/ prefix
    create: bool
    hunks: tuple[Hunk, ...]


_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_diff(text: str) -> list[FilePatch]:
    """Parse a unified diff with a/ and b/ prefixes (as git diff writes it)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    patches: list[FilePatch] = []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("--- "):
            i += 1
            continue
        old_name = lines[i][4:].split("\t")[0].strip()
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise ModFailure(f"malformed diff near line {i + 1}: '---' without '+++'")
        new_name = lines[i + 1][4:].split("\t")[0].strip()
        if new_name == "/dev/null":
            raise ModFailure(f"deleting files is not supported ({old_name})")
        path = new_name[2:] if new_name.startswith("b/") else new_name
        i += 2
        hunks = []
        while i < len(lines) and lines[i].startswith("@@"):
            m = _HUNK_RE.match(lines[i])
            if not m:
                raise ModFailure(f"malformed hunk header: {lines[i]}")
            header, old_start = lines[i], int(m.group(1))
            old_count = int(m.group(2) or 1)
            new_count = int(m.group(4) or 1)
            old: list[str] = []
            new: list[str] = []
            i += 1
            while i < len(lines) and (len(old) < old_count or len(new) < new_count):
                line = lines[i]
                tag, body = (line[:1], line[1:]) if line else (" ", "")
                if tag == " ":
                    old.append(body)
                    new.append(body)
                elif tag == "-":
                    old.append(body)
                elif tag == "+":
                    new.append(body)
                elif tag != "\\":
                    raise ModFailure(f"{path}: malformed line in hunk {header}: {line!r}")
                i += 1
            while i < len(lines) and lines[i].startswith("\\"):
                i += 1
            hunks.append(Hunk(header, old_start, tuple(old), tuple(new)))
        patches.append(FilePatch(path, old_name == "/dev/null", tuple(hunks)))
    if not patches:
        raise ModFailure("the patch file holds no file changes")
    return patches


def _find(lines: list[str], block: tuple[str, ...], expected: int, start: int) -> int:
    """Index of block in lines at or after start, the one nearest to expected; -1 if absent."""
    if not block:
        return max(expected, start)
    best = -1
    for pos in range(start, len(lines) - len(block) + 1):
        if lines[pos:pos + len(block)] == list(block):
            if best < 0 or abs(pos - expected) < abs(best - expected):
                best = pos
            if pos > expected:
                break
    return best


def _apply_hunks(path: str, lines: list[str], hunks: tuple[Hunk, ...], reverse: bool) -> list[str] | str:
    """Apply hunks exactly (no fuzz); return the new lines, or the header of the first hunk that fails."""
    out = list(lines)
    start, shift = 0, 0
    for h in hunks:
        old, new = (h.new, h.old) if reverse else (h.old, h.new)
        pos = _find(out, old, h.old_start - 1 + shift, start)
        if pos < 0:
            return h.header
        out[pos:pos + len(old)] = list(new)
        start = pos + len(new)
        shift += len(new) - len(old)
    return out


def _split(text: str) -> tuple[list[str], bool]:
    lines = text.split("\n")
    if lines and lines[-1] == "":
        return lines[:-1], True
    return lines, False


def plan_patch(name: str, diff_text: str, root: Path) -> tuple[str, dict[Path, str]]:
    """Decide the state of a diff against root and compute the new file texts (nothing written)."""
    patches = parse_diff(diff_text)
    forward: dict[Path, str] = {}
    states = []
    for fp in patches:
        target = root / fp.path
        if fp.create:
            body = "\n".join(fp.hunks[0].new) + "\n" if fp.hunks else ""
            if not target.exists():
                forward[target] = body
                states.append(APPLIED)
            elif target.read_text(encoding="utf-8") == body:
                states.append(ALREADY)
            else:
                raise ModFailure(f"{fp.path}: the patch creates this file, but it exists with other content")
            continue
        if not target.is_file():
            raise ModFailure(f"{fp.path}: file to patch not found")
        lines, final_nl = _split(target.read_text(encoding="utf-8"))
        if isinstance(_apply_hunks(fp.path, lines, fp.hunks, reverse=True), list):
            states.append(ALREADY)
            continue
        result = _apply_hunks(fp.path, lines, fp.hunks, reverse=False)
        if isinstance(result, str):
            raise ModFailure(f"{fp.path}: hunk {result} does not match the file")
        forward[target] = "\n".join(result) + ("\n" if final_nl else "")
        states.append(APPLIED)
    if all(s == ALREADY for s in states):
        return ALREADY, {}
    if any(s == ALREADY for s in states):
        done = [fp.path for fp, s in zip(patches, states) if s == ALREADY]
        raise ModFailure(f"partly applied already ({', '.join(done)}); refusing to mix")
    return APPLIED, forward


# ------------------------------------------------------------------ patchers and files


def _load_patcher(path: Path):
    spec = importlib.util.spec_from_file_location(f"sparkforge_patcher_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise ModFailure(f"cannot load patcher {path.name}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for attr in ("TARGETS", "is_applied", "transform"):
        if not hasattr(module, attr):
            raise ModFailure(f"patcher {path.name} does not define {attr}")
    return module


def plan_patcher(name: str, patcher: Path, root: Path) -> tuple[str, dict[Path, str]]:
    module = _load_patcher(patcher)
    sources = {}
    for rel in module.TARGETS:
        target = root / rel
        if not target.is_file():
            raise ModFailure(f"{rel}: file to patch not found")
        sources[rel] = target.read_text(encoding="utf-8")
    if module.is_applied(dict(sources)):
        return ALREADY, {}
    try:
        result = module.transform(dict(sources))
    except ValueError as exc:
        raise ModFailure(str(exc)) from None
    if set(result) - set(sources):
        raise ModFailure(f"patcher changed files it does not list in TARGETS: {sorted(set(result) - set(sources))}")
    if not module.is_applied({**sources, **result}):
        raise ModFailure("patcher ran, but is_applied() is still false on its result")
    return APPLIED, {root / rel: text for rel, text in result.items() if text != sources[rel]}


def _dest(root: Path, dest: str) -> Path:
    return root / dest.lstrip("/")


def plan_files(spec: dict, folder: Path, root: Path) -> tuple[str, dict[Path, bytes], dict[Path, int]]:
    writes: dict[Path, bytes] = {}
    modes: dict[Path, int] = {}
    states = []
    for item in spec["files"]:
        body = (folder / item["src"]).read_bytes()
        target = _dest(root, item["dest"])
        mode = int(item.get("mode", "0644"), 8)
        if target.exists():
            if target.read_bytes() != body:
                raise ModFailure(f"{item['dest']}: exists with other content; refusing to overwrite")
            states.append(ALREADY)
        else:
            writes[target] = body
            modes[target] = mode
            states.append(APPLIED)
    if all(s == ALREADY for s in states):
        return ALREADY, {}, {}
    return APPLIED, writes, modes


def _write_all(writes: dict[Path, str | bytes], modes: dict[Path, int] | None = None) -> None:
    """Write every file to a temporary sibling first, then rename them all into place."""
    staged: list[tuple[Path, Path]] = []
    try:
        for target, body in writes.items():
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
            with os.fdopen(fd, "wb") as fh:
                fh.write(body.encode("utf-8") if isinstance(body, str) else body)
            mode = (modes or {}).get(target)
            if mode is None:
                mode = target.stat().st_mode & 0o7777 if target.exists() else 0o644
            os.chmod(tmp, mode)
            staged.append((Path(tmp), target))
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, target in staged:
        os.replace(tmp, target)


def apply_mod(spec: dict, folder: Path, root: Path) -> Result:
    """Apply one mod to the tree at root: applied, already applied, or failed (nothing written)."""
    name = spec["name"]
    try:
        if spec["kind"] == "patch":
            state, writes = plan_patch(name, (folder / spec["patch"]).read_text(encoding="utf-8"), root)
            modes = None
        elif spec["kind"] == "patcher":
            state, writes = plan_patcher(name, folder / spec["patcher"], root)
            modes = None
        elif spec["kind"] == "files":
            state, writes, modes = plan_files(spec, folder, root)
        else:
            raise ModFailure(f"unknown kind {spec['kind']!r}")
        if state == APPLIED:
            _write_all(writes, modes)
        return Result(name, state)
    except ModFailure as exc:
        return Result(name, FAILED, str(exc))
    except (OSError, UnicodeDecodeError, SyntaxError) as exc:
        return Result(name, FAILED, f"{type(exc).__name__}: {exc}")


def verify_mod(spec: dict, root: Path, *, in_image: bool) -> list[tuple[str, str, str]]:
    """Run a mod's verify checks: (check, ok|failed|skipped, detail) for each."""
    out = []
    for check in spec.get("verify", []):
        if check.get("python") is not None:
            label = f"python: {check['python']}"
            if not in_image:
                out.append((label, "skipped", "runs only inside a built image"))
                continue
            missing = [n for n in check.get("needs", []) if importlib.util.find_spec(n) is None]
            if missing:
                out.append((label, "skipped", f"needs {', '.join(missing)}, not installed here"))
                continue
            proc = subprocess.run([sys.executable, "-c", check["python"]], capture_output=True, text=True,
                                  cwd=root)
            tail = (proc.stderr.strip().splitlines() or [""])[-1]
            out.append((label, "ok" if proc.returncode == 0 else "failed", tail))
        else:
            label = f"{check['file']} contains {check['contains']!r}"
            target = _dest(root, check["file"])
            if not target.is_file():
                out.append((label, "failed", f"{check['file']} not found"))
            elif check["contains"] in target.read_text(encoding="utf-8", errors="replace"):
                out.append((label, "ok", ""))
            else:
                out.append((label, "failed", "string not found"))
    return out


# ------------------------------------------------------------------ in the image


def component_root(component: str) -> Path:
    """Where an installed component's tree is rooted: the folder that holds its package."""
    if component == "image":
        return Path("/")
    spec = importlib.util.find_spec(component.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise ModFailure(f"component {component!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0]).parent


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_cuda() -> str:
    """torch.version.cuda of the installed torch ("None" for a CPU build); asked in a subprocess."""
    proc = subprocess.run([sys.executable, "-c", "import torch; print(torch.version.cuda)"],
                          capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else f"import failed: {last_line(proc.stderr)}"


def last_line(text: str, default: str = "") -> str:
    """The last non-blank line of a command's output: usually the error that matters."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else default


def protect(names: list[str], out_dir: Path) -> dict[str, str]:
    """Record the base image's builds of the protected packages, as pip constraints; for torch
    also its CUDA build, which a PyPI torch would silently replace."""
    found = {name: v for name in names if (v := _installed(name)) is not None}
    out_dir.mkdir(parents=True, exist_ok=True)
    record = dict(found)
    if "torch" in found:
        record["torch.version.cuda"] = _torch_cuda()
    (out_dir / "protected.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    (out_dir / "constraints.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(found.items())))
    return found


def check_protected(out_dir: Path) -> list[str]:
    """What differs from the base image's protected packages, one line each."""
    recorded = json.loads((out_dir / "protected.json").read_text())
    changed = []
    for name, version in sorted(recorded.items()):
        now = _torch_cuda() if name == "torch.version.cuda" else (_installed(name) or "absent")
        if now != version:
            changed.append(f"{name} {version} -> {now}")
    return changed


# ------------------------------------------------------------------ build record and smoke tests


def write_record(home: Path) -> dict:
    """Gather the build record: the plan, every mod's result, and what is really installed."""
    plan = json.loads((home / "plan.json").read_text())
    mods = [json.loads(p.read_text()) for p in sorted((home / "record" / "mods").glob("*.json"))]
    commit_file = home / "record" / "vllm-commit"
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    built = int(epoch) if epoch.isdigit() else int(time.time())
    installed = {"vllm": _installed("vllm")}
    for comp in plan["components"]:
        if comp["kind"] == "pip":
            name = comp["package"].split("[")[0]
            installed[name] = _installed(name)
    for comp in plan["components"]:
        if comp["kind"] == "git":
            marker = Path(comp["dest"]) / ".sparkforge-commit"
            installed[comp["name"]] = marker.read_text().strip() if marker.exists() else None
    built_commit = commit_file.read_text().strip() if commit_file.exists() else _release_commit()
    record = {
        "variant": plan["variant"],
        "chain": plan["chain"],
        "tag": plan["tag"],
        "plan_hash": plan["plan_hash"],
        "base": plan["base"],
        "vllm": plan["vllm"] | {"built_commit": built_commit},
        "components": plan["components"],
        "installed": installed,
        "packages": installed_packages(),
        "mods": [{"name": m["name"], "digest": m["digest"], "phase": m["spec"]["phase"],
                  "result": next((r["result"] for r in mods if r["name"] == m["name"]), None)}
                 for m in plan["mods"]],
        "protected": json.loads((home / "protect" / "protected.json").read_text()),
        "build": plan["build"],
        "env": plan["env"],
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(built)),
        "source_date_epoch": int(epoch) if epoch.isdigit() else None,
        "python": sys.version.split()[0],
        "tool_version": plan["tool_version"],
        "unpinned": plan["unpinned"],
    }
    (home / "build-record.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record


def installed_packages() -> dict[str, str]:
    """Every Python distribution the image's Python sees, by normalized name, with its version;
    where a name is installed twice, the one found first on sys.path (the one imported) wins."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = re.sub(r"[-_.]+", "-", (dist.metadata["Name"] or "")).lower()
        if name and name not in found:
            found[name] = dist.version
    return dict(sorted(found.items()))


def _release_commit() -> str | None:
    """The commit an installed vLLM release records in vllm/_version.py, read without importing vllm."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return version_file_commit(Path(list(spec.submodule_search_locations)[0]) / "_version.py")


def version_file_commit(version_file: Path) -> str | None:
    """The short commit a setuptools-scm _version.py records (without its 'g'), or None."""
    if not version_file.exists():
        return None
    m = re.search(r"commit_id\s*=\s*['\"]g?([0-9a-f]{7,40})['\"]", version_file.read_text())
    return m.group(1) if m else None


def _public(version: str | None) -> str | None:
    return version.split("+")[0] if version else version


def smoke_static(home: Path) -> list[tuple[str, str, str]]:
    """The static smoke tier: (check, ok|failed|skipped, detail). Needs no GPU."""
    checks: list[tuple[str, str, str]] = []

    def add(name: str, ok: bool, detail: str = "") -> None:
        checks.append((name, "ok" if ok else "failed", detail))

    try:
        record = json.loads((home / "build-record.json").read_text())
        plan = json.loads((home / "plan.json").read_text())
    except (OSError, ValueError) as exc:
        return [("build record present", "failed", str(exc))]
    add("build record present", record.get("plan_hash") == plan["plan_hash"], str(home / "build-record.json"))
    want, have = plan["vllm"]["version"], _installed("vllm")
    add(f"vllm {want} installed", _public(have) == want, f"installed: {have}")
    for comp in plan["components"]:
        if comp["kind"] == "pip":
            name = comp["package"].split("[")[0]
            want, have = comp["version"]["value"], _installed(name)
            ok = have is not None and (want is None or _public(have) == want)
            add(f"{name} {want or '(unpinned)'} installed", ok, f"installed: {have}")
        else:
            marker = Path(comp["dest"]) / ".sparkforge-commit"
            have = marker.read_text().strip() if marker.exists() else None
            want = comp["commit"]["value"]
            add(f"{comp['name']} at {want or comp['ref']}", have is not None and (want is None or have == want),
                f"{comp['dest']}: {have}")
    changed = check_protected(home / "protect")
    protected = json.loads((home / "protect" / "protected.json").read_text())
    add("base packages not replaced by pip", not changed,
        "; ".join(changed) or ", ".join(f"{k} {v}" for k, v in sorted(protected.items())) or
        "the base has none of the protected packages")
    entries = [json.loads(p.read_text()) for p in (home / "record" / "mods").glob("*.json")]
    results = {entry["name"]: entry["result"] for entry in entries}
    for mod in plan["mods"]:
        name = mod["name"]
        add(f"mod {name} recorded", results.get(name) in (APPLIED, ALREADY), str(results.get(name)))
        spec = json.loads((home / "mods" / name / "mod.json").read_text())
        try:
            root = component_root(spec["component"])
        except ModFailure as exc:
            add(f"mod {name}: component root", False, str(exc))
            continue
        for label, state, detail in verify_mod(spec, root, in_image=True):
            if spec["phase"] == "source" and not label.startswith("python:"):
                # A source-phase mod edits the source tree before the compile; its file checks ran
                # there when it was applied (the record above), and the tree is not in the image.
                state, detail = "skipped", "checked in the source tree at build time"
            missing = re.fullmatch(r"ModuleNotFoundError: No module named '([\w.]+)'", detail)
            if (state == "failed" and missing and not plan["vllm"]["install_deps"]
                    and importlib.util.find_spec(missing.group(1).split(".")[0]) is None):
                # As `needs` does for declared modules: vLLM was installed --no-deps, so its own
                # dependencies are the base's to provide, and this base lacks one.
                state, detail = "skipped", (f"needs {missing.group(1)}, not installed (vllm was installed with "
                                            "--no-deps; the base provides its dependencies)")
            checks.append((f"mod {name}: {label}", state, detail))
    entry = shutil.which("vllm")
    add("vllm entry point on PATH", entry is not None, entry or "not found")
    if any(m["name"] == "serve-torchrun" for m in plan["mods"]):
        server = Path("/opt/sparkforge/serve_torchrun.py")
        add("torchrun server script", server.is_file() and os.access(server, os.X_OK), str(server))
    return checks


def smoke_gpu(home: Path) -> list[tuple[str, str, str]]:
    """The gpu smoke tier: CUDA works and the device's capability is covered by the arch list."""
    plan = json.loads((home / "plan.json").read_text())
    code = ("import json, torch; ok = torch.cuda.is_available(); "
            "print(json.dumps({'ok': ok, 'cap': list(torch.cuda.get_device_capability(0)) if ok else None, "
            "'name': torch.cuda.get_device_name(0) if ok else None}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        return [("torch.cuda.is_available()", "failed", last_line(proc.stderr))]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    checks = [("torch.cuda.is_available()", "ok" if info["ok"] else "failed", str(info["name"]))]
    if info["ok"]:
        major, minor = info["cap"]
        arches = plan["build"]["torch_cuda_arch_list"].split(";")
        covered = any(a.rstrip("afPTX+").rstrip(".") == f"{major}.{minor}" for a in arches)
        checks.append((f"sm_{major}{minor} in TORCH_CUDA_ARCH_LIST", "ok" if covered else "failed",
                       plan["build"]["torch_cuda_arch_list"]))
    return checks


def _cmd_apply(args: argparse.Namespace) -> int:
    folder = Path(args.mod)
    spec = json.loads((folder / "mod.json").read_text())
    try:
        root = Path(args.root) if args.root else component_root(spec["component"])
    except ModFailure as exc:
        print(f"mod {spec['name']}: FAILED: {exc}", file=sys.stderr)
        return 1
    result = apply_mod(spec, folder, root)
    print(result.line(), file=sys.stderr if result.state == FAILED else sys.stdout)
    if result.state == FAILED:
        return 1
    bad = [c for c in verify_mod(spec, root, in_image=False) if c[1] == "failed"]
    if bad:
        print(f"mod {spec['name']}: FAILED: verify: {bad[0][0]}: {bad[0][2]}", file=sys.stderr)
        return 1
    if args.record:
        record = Path(args.record)
        record.parent.mkdir(parents=True, exist_ok=True)
        entry = {"name": spec["name"], "result": result.state, "phase": spec["phase"], "root": str(root)}
        record.write_text(json.dumps(entry, sort_keys=True) + "\n")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    failed = 0
    for folder in args.mods:
        spec = json.loads((Path(folder) / "mod.json").read_text())
        root = Path(args.root) if args.root else component_root(spec["component"])
        for label, state, detail in verify_mod(spec, root, in_image=True):
            print(f"{spec['name']}\t{state}\t{label}" + (f"\t{detail}" if detail else ""))
            failed += state == "failed"
    return 1 if failed else 0


def _cmd_protect(args: argparse.Namespace) -> int:
    found = protect(args.names, Path(args.out))
    for name in args.names:
        print(f"protect {name}: {found.get(name, 'not installed in the base')}")
    return 0


def _cmd_check_protected(args: argparse.Namespace) -> int:
    changed = check_protected(Path(args.dir))
    for line in changed:
        print(f"protected package replaced: {line}", file=sys.stderr)
    return 1 if changed else 0


def _cmd_record(args: argparse.Namespace) -> int:
    record = write_record(Path(args.home))
    print(f"build record: {record['variant']} {record['tag']}")
    return 0


def _cmd_smoke(args: argparse.Namespace) -> int:
    checks = smoke_static(Path(args.home)) if args.tier == "static" else smoke_gpu(Path(args.home))
    for name, state, detail in checks:
        print(json.dumps({"check": name, "state": state, "detail": detail}))
    return 1 if any(state == "failed" for _, state, _ in checks) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="imagetool", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("apply", help="apply one mod (a folder holding mod.json and its assets)")
    p.add_argument("mod")
    p.add_argument("--root", help="the component root (default: found from the installed package)")
    p.add_argument("--record", help="write the result to this JSON file")
    p.set_defaults(func=_cmd_apply)
    p = sub.add_parser("verify", help="run the verify checks of mods")
    p.add_argument("mods", nargs="+")
    p.add_argument("--root")
    p.set_defaults(func=_cmd_verify)
    p = sub.add_parser("protect", help="record the base's versions of packages pip must not replace")
    p.add_argument("--out", required=True)
    p.add_argument("names", nargs="*")
    p.set_defaults(func=_cmd_protect)
    p = sub.add_parser("check-protected", help="fail if a protected package was replaced")
    p.add_argument("dir")
    p.set_defaults(func=_cmd_check_protected)
    p = sub.add_parser("record", help="write the build record into HOME/build-record.json")
    p.add_argument("home")
    p.set_defaults(func=_cmd_record)
    p = sub.add_parser("smoke", help="run a smoke tier inside the image; one JSON line per check")
    p.add_argument("--tier", choices=["static", "gpu"], default="static")
    p.add_argument("--home", default="/opt/sparkforge")
    p.set_defaults(func=_cmd_smoke)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
