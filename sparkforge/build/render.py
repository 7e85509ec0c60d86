"""Render stage: a Plan becomes a build context (Dockerfile, plan.json, mods, the image-side package).

The same Plan always gives byte-identical files, without Docker; the context is swapped in whole, so a failed
render never leaves a half-written folder behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import jinja2

from ..errors import ConfigError, SparkforgeError
from ..inimage.contract import Phase, Unpinned
from ..inimage.seam import (BaseDoc, BuildDoc, ComponentDoc, ComponentKind, PatchOrigin, PinDoc, PlanDoc, PlannedMod,
                            VllmDoc, VllmSource, WheelDoc)
from ..recipe.layout import Layout
from ..recipe.plan import Pin, Plan
from ..recipe.schema import RemotePatch
from ..recipe.remote import materialize
from ..recipe.sources import cache_dir
from ..recipe.wheelset import requirements_txt
from .prebuilt import planned_wheel
from .wheels import WheelInput

DOCKERFILE = "Dockerfile"
MANAGED_MARK = ".sparkforge-context"


@dataclass(frozen=True)
class Context:
    """A rendered build context on disk."""

    path: Path
    files: tuple[str, ...]

    @property
    def dockerfile(self) -> Path:
        return self.path / DOCKERFILE


class _BytecodeCache(jinja2.FileSystemBytecodeCache):
    """Jinja's bytecode in the cache folder; a full or read-only cache never fails a render."""

    def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        with contextlib.suppress(OSError):
            super().dump_bytecode(bucket)


def _environment(template_dir: Path) -> jinja2.Environment:
    # Compiling the template costs more than rendering it; keep the bytecode between runs.
    cache = cache_dir() / "jinja"
    with contextlib.suppress(OSError):  # compiled on every render instead
        cache.mkdir(parents=True, exist_ok=True)
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir)),
        bytecode_cache=_BytecodeCache(str(cache)) if cache.is_dir() else None,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env


def render_dockerfile(plan: Plan, layout: Layout, wheel: WheelInput | None = None) -> str:
    """The Dockerfile of a plan: a git source compiles unless `wheel` (from the wheel cache) is given."""
    env = _environment(layout.template.parent)
    template = env.get_template(layout.template.name)
    gits = [c for c in plan.components if c.kind == "git"]
    pips = [c for c in plan.components if c.kind == "pip"]
    if wheel is None and plan.vllm.source == "wheel":
        wheel = planned_wheel(plan)
    compiles = plan.vllm.source == "git" and wheel is None
    text = template.render(
        plan=plan,
        compiles=compiles,
        wheel=wheel,
        # A wheel from the host is mounted alone (not its folder), at a path of its own name.
        wheel_path="/wheels/vllm-*.whl" if compiles or wheel is None else "/wheels/" + shlex.quote(
            wheel.wheel.rpartition("/")[2]),
        git_components=gits,
        pip_components=pips,
        cutlass_dest=next((c.dest for c in gits if c.name == "cutlass"), None),
        source_mods=plan.mods_in("source"),
        install_mods=plan.mods_in("install"),
        # What the kernel scan reads: the installed distributions' libraries, and the git components' trees.
        scan_dists=list(dict.fromkeys([plan.vllm.package, *(str(c.package).split("[")[0] for c in pips),
                                       *plan.kernels_scan])),
        scan_roots=[c.dest for c in gits],
        # A base's own vLLM is protected too: no later pip install may replace the one the mods were checked on.
        protect=plan.protect + (("vllm",) if plan.vllm.source == "base" and "vllm" not in plan.protect else ()),
        mod_labels=",".join(f"{m.name}@{m.digest.removeprefix('sha256:')[:12]}" for m in plan.mods),
    )
    # Collapse runs of blank lines left by template conditionals.
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(line.rstrip() for line in text.splitlines()))
    return text.strip("\n") + "\n"


def context_files(plan: Plan, layout: Layout, wheel: WheelInput | None = None, *,
                  ca_cert: Path | None = None) -> dict[str, bytes]:
    """Every file of the build context, by relative path (a mod's patch named by URL fetched with ca_cert)."""
    files: dict[str, bytes] = {
        DOCKERFILE: render_dockerfile(plan, layout, wheel).encode(),
        "plan.json": plan_document(plan).to_json(indent=2).encode(),
        "sparkforge/gitfetch.py": layout.gitfetch.read_bytes(),
        MANAGED_MARK: f"rendered by sparkforge for {plan.tag}\n".encode(),
    }
    for rel, path in layout.inimage_files():
        files[f"sparkforge/inimage/{rel}"] = path.read_bytes()
    if plan.pins:
        files["lock/constraints.txt"] = "".join(f"{name}=={version}\n" for name, version in plan.pins).encode()
    if plan.wheel_set:
        files["lock/requirements.txt"] = requirements_txt(plan.wheel_set).encode()
    for mod in plan.mods:
        spec, folder = materialize(mod, ca_cert)
        for rel, body in mod_files(mod.name, folder).items():
            files[f"mods/{mod.name}/{rel}"] = body
        files[f"mods/{mod.name}/mod.json"] = spec.to_json(indent=2).encode()
    return dict(sorted(files.items()))


def plan_document(plan: Plan) -> PlanDoc:
    """The plan as the image reads it (plan.json): what its smoke tiers check and its build record copies."""
    v, b = plan.vllm, plan.build
    wheel = (WheelDoc(filename=v.wheel.filename, sha256=v.wheel.sha256, url=v.wheel.url, path=v.wheel.path)
             if v.wheel else None)
    return PlanDoc(
        variant=plan.variant, chain=plan.chain, tag=plan.tag, plan_hash=plan.plan_hash,
        base=BaseDoc(repository=plan.base.repository, tag=plan.base.tag, digest=_pin(plan.base.digest)),
        vllm=VllmDoc(source=VllmSource(v.source), version=v.version, repo=v.repo, ref=v.ref, commit=_pin(v.commit),
                     install_deps=v.install_deps, wheel=wheel, package=v.package),
        components=tuple(ComponentDoc(name=c.name, kind=ComponentKind(c.kind), package=c.package,
                                      version=_pin(c.version), repo=c.repo, ref=c.ref, commit=_pin(c.commit),
                                      dest=c.dest, pip_install=c.pip_install) for c in plan.components),
        protect=plan.protect,
        build=BuildDoc(torch_cuda_arch_list=b.torch_cuda_arch_list, max_jobs=b.max_jobs, nvcc_threads=b.nvcc_threads,
                       env=b.env),
        env=plan.env,
        mods=tuple(PlannedMod(name=m.name, digest=m.digest, phase=Phase(m.spec.phase), patch=_origin(m.spec.patch))
                   for m in plan.mods),
        tool_version=plan.tool_version,
        unpinned=tuple(Unpinned(field=f, reason=r) for f, r in plan.unpinned()),
    )


def _pin(pin: Pin) -> PinDoc:
    return PinDoc(value=pin.value, unknown=pin.unknown)


def _origin(patch: object) -> PatchOrigin | None:
    """A patch named by URL or pull request, as the recipe pins it; None for a file of the mod folder."""
    return PatchOrigin(url=patch.url, pr=patch.pr, sha256=patch.sha256) if isinstance(patch, RemotePatch) else None


def mod_files(name: str, folder: Path) -> dict[str, bytes]:
    """The files of a mod folder for the context; a link is refused, wherever it points (it could carry any file)."""
    found: dict[str, bytes] = {}
    for parent, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" or Path(parent, d).is_symlink())
        for entry in dirs + sorted(names):
            path = Path(parent) / entry
            rel = path.relative_to(folder).as_posix()
            if path.is_symlink():
                raise ConfigError(f"{rel} is a link; a mod folder holds only regular files (copy the file in)",
                                  path=folder, field=f"mods.{name}")
            if entry in dirs or rel == "mod.yaml":
                continue
            if not path.is_file():
                raise ConfigError(f"{rel} is not a regular file", path=folder, field=f"mods.{name}")
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as fh:
                found[rel] = fh.read()
    return found


def render_context(plan: Plan, layout: Layout, out_dir: Path, wheel: WheelInput | None = None, *,
                   ca_cert: Path | None = None) -> Context:
    """Write the build context to out_dir, replacing a context that sparkforge rendered there before."""
    out_dir = out_dir.resolve()
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / MANAGED_MARK).exists():
        raise SparkforgeError("exists and was not rendered by sparkforge; choose an empty or new folder",
                              path=out_dir)
    files = context_files(plan, layout, wheel, ca_cert=ca_cert)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging: Path | None = None
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
        for rel, body in files.items():
            target = staging / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(body)
            os.chmod(target, 0o755 if rel.endswith(".py") and body.startswith(b"#!") else 0o644)
        os.chmod(staging, 0o755)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
            try:
                os.replace(out_dir, old / "ctx")
                try:
                    os.replace(staging, out_dir)
                except BaseException:
                    os.replace(old / "ctx", out_dir)  # the context that was there stays
                    raise
            finally:
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, out_dir)
    except BaseException as exc:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError):  # about out_dir, not a temporary name (a full disk names no file at all)
            exc.filename, exc.filename2 = str(out_dir), None
        raise
    return Context(out_dir, tuple(files))
