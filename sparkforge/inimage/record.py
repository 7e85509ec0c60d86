"""What the image records about itself: the base's protected packages, the wheel it installed,
each mod's result and the build record."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

from .contract import BuildRecord, KernelRecord, ModResult, RecordedMod, WheelNote, WheelOrigin, parse_json
from .run import IMPORT_TIMEOUT, python
from .seam import ComponentKind, read_plan


def installed(name: str) -> str | None:
    import importlib.metadata  # here, not at the top: the patcher child starts faster without it

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_cuda(limit: float = IMPORT_TIMEOUT) -> str:
    """torch.version.cuda of the installed torch ("None" for a CPU build); asked in a subprocess."""
    ok, out, why = python("import torch; print(torch.version.cuda)", limit=limit, what="import torch")
    return out.strip() if ok else f"import failed: {why}"


def protect(names: list[str], out_dir: Path) -> dict[str, str]:
    """Record the base's builds of the protected packages as pip constraints (torch's CUDA build too, which a PyPI
    torch would silently replace)."""
    found = {name: v for name in names if (v := installed(name)) is not None}
    out_dir.mkdir(parents=True, exist_ok=True)
    record = dict(found)
    if "torch" in found:
        record["torch.version.cuda"] = torch_cuda()
    (out_dir / "protected.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    (out_dir / "constraints.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(found.items())))
    return found


def check_protected(out_dir: Path) -> list[str]:
    """What differs from the base image's protected packages, one line each."""
    recorded = parse_json((out_dir / "protected.json").read_text())
    changed = []
    for name, version in sorted(recorded.items()):
        now = torch_cuda() if name == "torch.version.cuda" else (installed(name) or "absent")
        if now != version:
            changed.append(f"{name} {version} -> {now}")
    return changed


def note_wheel(wheel: Path, origin: WheelOrigin, key: str | None, compiled_for: str | None) -> WheelNote:
    """The note of the vLLM wheel the image installed: compiled here, from the wheel cache, or the recipe's."""
    digest = hashlib.sha256()
    with open(wheel, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return WheelNote(origin, wheel.name, digest.hexdigest(), key, compiled_for)


def base_vllm(release: str) -> tuple[str | None, str | None]:
    """(problem, installed version): the base's vLLM must be the recipe's release or a local build of it (`+nv26`)."""
    found = installed("vllm")
    if found is None:
        return "the base image has no vllm installed; use another vllm.source, or a base that carries one", None
    if found.split("+", 1)[0] != release:
        return (f"the base carries vllm {found}, but the recipe says vllm.version {release}; set the version the "
                "base carries (mods are checked against it)"), found
    return None, found


def mod_results(home: Path) -> list[ModResult]:
    """The result record of every mod applied in the image, in the order they were applied."""
    return [ModResult.from_json(p.read_bytes(), str(p)) for p in sorted((home / "record" / "mods").glob("*.json"))]


def write_record(home: Path) -> BuildRecord:
    """Gather the build record: the plan, every mod's result, and what is really installed."""
    plan = read_plan(home / "plan.json")
    results = {r.name: r.result for r in mod_results(home)}
    commit_file = home / "record" / "vllm-commit"
    wheel_file = home / "record" / "vllm-wheel.json"
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    built = int(epoch) if epoch.isdigit() else int(time.time())
    found = {"vllm": installed(plan.vllm.package)}
    for comp in plan.components:
        if comp.kind == ComponentKind.PIP and comp.package:
            name = comp.package.split("[")[0]
            found[name] = installed(name)
    for comp in plan.components:
        if comp.kind == ComponentKind.GIT and comp.dest:
            marker = Path(comp.dest) / ".sparkforge-commit"
            found[comp.name] = marker.read_text().strip() if marker.exists() else None
    built_commit = commit_file.read_text().strip() if commit_file.exists() else _release_commit()
    kernels_file = home / "record" / "kernels.json"
    wheel = WheelNote.from_json(wheel_file.read_bytes(), str(wheel_file)).to_dict() if wheel_file.exists() else None
    record = BuildRecord(
        variant=plan.variant, chain=list(plan.chain), tag=plan.tag, plan_hash=plan.plan_hash,
        base=plan.base.to_dict(), vllm=plan.vllm.to_dict() | {"built_commit": built_commit, "installed_wheel": wheel},
        components=[c.to_dict() for c in plan.components], installed=found, packages=installed_packages(),
        # a patch named by URL (or pull request) and its sha256: where the change came from
        mods=tuple(RecordedMod(m.name, m.digest, m.phase, results.get(m.name), m.patch.to_dict() if m.patch else None)
                   for m in plan.mods),
        protected=parse_json((home / "protect" / "protected.json").read_text()),
        build=plan.build.to_dict(), env=plan.env,
        built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(built)),
        source_date_epoch=int(epoch) if epoch.isdigit() else None,
        python=sys.version.split()[0], machine=platform.machine(), tool_version=plan.tool_version,
        unpinned=plan.unpinned,
        kernels=KernelRecord.from_json(kernels_file.read_bytes(), str(kernels_file)) if kernels_file.exists() else None,
    )
    (home / "build-record.json").write_text(record.to_json(indent=2))
    return record


def installed_packages() -> dict[str, str]:
    """Every distribution the image's Python sees, by normalized name, with its version (of two, the one imported)."""
    import importlib.metadata

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
