"""What the command line prints: results of the library as Rich tables and lines, every value from a file, an image
or a remote as a `Text`, never markup, so a description holding `[bold]` prints as written."""

from __future__ import annotations

import re
import shlex
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterable, Sequence

from rich.table import Table
from rich.text import Text

from ..build.builder import BASE_LABEL
from ..build.pipeline import LoadedPlan
from ..imageref import ImageRef
from ..inimage.contract import BuildRecord, KernelRecord, WheelOrigin
from ..inimage.kernels import exempt, verdicts
from ..recipe.plan import Plan, platform_of
from ..recipe.wheelset import download_bytes
from ..repro.checkmods import RowState, applies_ranges
from ..repro.verbs import BumpResult

if TYPE_CHECKING:  # annotations only: repro.diff, .outdated, .repro and distribute.deploy load for their verbs
    from pathlib import Path

    from ..build.pipeline import BuildOutcome, DryRun
    from ..build.smoke import TierResult
    from ..distribute.deploy import ClusterStatus, Deployment
    from ..recipe.lockfile import Lock
    from ..repro.checkmods import MatrixCell, Row
    from ..repro.diff import Diff
    from ..repro.outdated import Outdated, Report
    from ..repro.repro import ReproResult
    from ..repro.verbs import ModsReport

STATE_STYLE = {RowState.APPLIED: "green", RowState.ALREADY: "cyan", RowState.FAILED: "bold red",
               RowState.UNVERIFIED: "yellow", RowState.READ: "green"}
CHECK_STYLE = {"ok": "green", "failed": "bold red", "skipped": "yellow"}
OUTCOME_STYLE = {"updated": "green", "current": "cyan", "failed": "bold red"}  # distribute.deploy's outcomes


def _table(*columns: str, title: str | None = None, names: int = 1) -> Table:
    """A table for any terminal width: its first `names` columns kept whole, the others wrapped, a long path folded."""
    table = Table(box=None, pad_edge=False, title=title)
    for i, col in enumerate(columns):
        table.add_column(col, overflow="fold", no_wrap=i < names)
    return table


def _line(*parts: str | tuple[str, str]) -> Text:
    """A line of plain text; (text, style) pairs are styled, nothing is read as markup."""
    return Text.assemble(*parts)


def variants_table(plans: Iterable[Plan]) -> Table:
    """`list`: a row per variant."""
    table = _table("variant", "parent", "vllm", "mods", "unpinned")
    for plan in plans:
        name, parent = plan.variant, plan.chain[1] if len(plan.chain) > 1 else "-"
        vllm = plan.vllm.version + f" ({plan.vllm.ref or plan.vllm.source})"
        mods = ", ".join(m.name for m in plan.mods) or "-"
        table.add_row(Text(name), Text(parent), Text(vllm), Text(mods), str(len(plan.unpinned())))
    return table


def plan_lines(loaded: LoadedPlan) -> list[Text]:
    """The resolved plan of `show`, one fact a line."""
    plan = loaded.plan
    v, b = plan.vllm, plan.build
    # Neither the recipe's digest nor a lock's is asked of the registry when shown; `lock` keeps the recipe's.
    if plan.base.digest.value is None:
        origin = ""
    elif loaded.lock:
        origin = f"  (digest as {loaded.lock.name} records it)"
    else:
        origin = "  (digest as the recipe gives it; not checked against the registry)"
    lines = [
        _line((plan.variant, "bold"), f"  {plan.description}"),
        _line(f"  chain       {' <- '.join(plan.chain)}"),
        _line(f"  tag         {plan.tag}  (moving: {plan.moving_tag})"),
        _line(f"  lock        {loaded.lock.name + ' (applied)' if loaded.lock else 'none applied'}"),
        _line(f"  base        {plan.base.ref}", origin),
        _line(f"  platform    {plan.platform}"),
    ]
    src = (f"git {v.repo} {v.ref} @ {v.commit.value or 'UNPINNED'}" if v.source == "git"
           else f"wheel {v.wheel.url or v.wheel.path} sha256:{v.wheel.sha256[:12]}" if v.wheel
           else f"the vLLM that {plan.base.repository}:{plan.base.tag} carries, kept" if v.source == "base"
           else "pypi release" if v.package == "vllm" else f"pypi release of {v.package}")
    deps = "" if v.install_deps or v.source == "base" else ", --no-deps"
    lines.append(_line(f"  vllm        {v.version}  ({src}{deps})"))
    if plan.python:
        wheels = (f"{len(plan.wheel_set)} wheels pinned by sha256, {download_bytes(plan.wheel_set) / 1e9:.2f} GB to "
                  "download" if plan.wheel_set else "not locked yet")
        lines.append(_line(f"  python      {plan.python.version} on {plan.python.platform}; wheel set: {wheels}"))
        if plan.python.venv:
            lines.append(_line(f"  venv        {plan.python.venv} (python3 on PATH; sees the base's own packages)"))
        lines += [_line(f"  left out    {name}: {reason}")
                  for name, reason in zip(plan.python.leave_out, plan.python.reasons)]
    lines += [_line(f"  {c.name:<11} pip {c.requirement}" if c.kind == "pip"
                    else f"  {c.name:<11} git {c.repo} {c.ref} @ {c.commit.value or 'UNPINNED'} -> {c.dest}")
              for c in plan.components]
    lines.append(_line(f"  build       TORCH_CUDA_ARCH_LIST={b.torch_cuda_arch_list} MAX_JOBS={b.max_jobs} "
                       f"NVCC_THREADS={b.nvcc_threads}"))
    lines += [_line(f"  build env   {k}={val}  (compile step only)") for k, val in b.env]
    device = ("device      cpu: vLLM runs on the CPU (serve tier and launch without a GPU); no kernel check"
              if plan.on_cpu else f"gpus        {', '.join(plan.gpus)}  (every CUDA extension must run on each)"
              if plan.gpus else "gpus        none: the recipe says the image runs no CUDA code, so no kernel check")
    lines.append(_line(f"  {device}"))
    lines += [_line(f"  not needed  {name}: {reason}") for name, reason in plan.kernels_not_needed]
    if plan.kernels_scan:
        lines.append(_line(f"  scan        {', '.join(plan.kernels_scan)}  (their libraries are checked too)"))
    lines.append(_line(f"  protect     {', '.join(plan.protect) or '-'}"))
    lines += [_line(f"  env         {k}={val}") for k, val in plan.env]
    lines += [_line(f"  mod {i:<7} {m.name} ({m.spec.phase}, {m.spec.kind}) {m.digest[:19]}"
                    + (f"; patch {_patch_origin(m.spec.patch.model_dump(exclude_none=True))}"
                       if m.spec.patch is not None and not isinstance(m.spec.patch, str) else ""))
              for i, m in enumerate(plan.mods, 1)]
    lines += [_line("  ", ("UNPINNED", "yellow"), f"    {fld}: {reason}") for fld, reason in plan.unpinned()]
    lines += [_line("  ", ("UNRESOLVED", "yellow"), f"  {fld} (in the lock): {reason}")
              for fld, reason in loaded.unresolved]
    return lines


def check_table(rows: Sequence[Row], plans: Sequence[Plan]) -> Table:
    """check-mods: a row per variant and mod."""
    table = _table("variant", "mod", "result", "checked against", "detail", names=2)
    for row in rows:
        table.add_row(Text(row.variant), Text(row.mod), Text(row.state, STATE_STYLE[row.state]),
                      Text(row.source), Text(row.detail))
    for plan in plans:
        if not plan.mods:
            table.add_row(Text(plan.variant), "-", Text("skipped", "yellow"), "", "the variant has no mods")
    return table


def matrix_table(cells: Sequence[MatrixCell], mods: Sequence[str], versions: Sequence[str], title: str) -> Table:
    """Releases down, mods across: applies, fails or unverified, with ! where that differs from the declared range."""
    table = _table("vllm", *mods, title=title)
    for version in versions:
        marks = []
        for name in mods:
            cell = next(c for c in cells if c.mod == name and c.version == version)
            if cell.state == RowState.UNVERIFIED:
                marks.append(Text("unverified", "yellow"))
                continue
            ok = cell.state in (RowState.APPLIED, RowState.ALREADY)
            marks.append(_line(("applies", "green") if ok else ("fails", "red"), "!" if ok != cell.declared else ""))
        table.add_row(Text(version), *marks)
    return table


_SITE_PACKAGES = re.compile(r"/\S*/(?:site|dist)-packages/")


def smoke_table(results: Iterable[TierResult]) -> Table:
    """Smoke tiers: a row per check, and one for a tier skipped whole."""
    table = _table("tier", "check", "result", "detail")
    for res in results:
        if res.skipped:
            table.add_row(res.tier, "(whole tier)", Text("skipped", "yellow"), Text(res.skipped))
        for c in res.checks:
            # The site-packages folder is the same in every row: a kernel row names the file below it.
            name = _SITE_PACKAGES.sub(".../", c.name)
            name = name if len(name) <= 100 else name[:97] + "..."
            table.add_row(res.tier, Text(name), Text(c.state, CHECK_STYLE[c.state]), Text(c.detail))
    return table


def kernels_table(kernels: KernelRecord) -> Table:
    """An image's kernel record: a row per CUDA extension, its SASS and PTX archs (relocatable code, never loaded, after
    the SASS as `rel 90 120`), and per GPU what it runs there: a cubin, `JIT compute_NN` (PTX the driver compiles at
    first start), NONE, `90 missing` kernels, `partial?` (names unreadable), `not needed` or `unreadable`."""
    gpus = kernels.gpus
    table = _table("extension", "SASS", "PTX", *(f"GPU {g}" for g in gpus),
                   title=f"CUDA extensions (shared libraries without device code: {kernels.without_device_code})")
    for ext in kernels.extensions:
        short = ext.path.split("site-packages/", 1)[-1].split("dist-packages/", 1)[-1]
        runs = verdicts(ext, gpus)
        not_needed = exempt(ext.path, kernels.not_needed)
        cells = [Text(label, "green") if state in ("ok", "relocatable")
                 else Text(label, "yellow") if state == "jit"
                 else Text("not needed", "yellow") if not_needed and state != "unreadable"
                 else Text(label, "bold red") for state, label in runs.values()]
        sass = " ".join(n.removeprefix("sm_") for n in ext.cubins) or "-"
        if ext.relocatable:
            sass += "  rel " + " ".join(n.removeprefix("sm_") for n in ext.relocatable)
        ptx = " ".join(n.removeprefix("compute_") for n in ext.ptx) or "-"
        if ext.error:
            sass, ptx = "unreadable", ext.error
        table.add_row(Text(short), Text(sass), Text(ptx), *cells)
    return table


def _patch_origin(patch: dict[str, Any]) -> str:
    """A patch named by URL or pull request, as mod.yaml pins it."""
    return f"{patch.get('url') or patch.get('pr')} sha256 {patch['sha256'][:12]}"


def record_lines(image: str, record: BuildRecord, labels: dict[str, str]) -> list[Text]:
    """`inspect`: the build record of an image, one fact a line."""
    base, v, installed = record.base, record.vllm, record.installed
    lines = [
        _line((image, "bold"), f"  variant {record.variant} ({' <- '.join(record.chain)})"),
        _line(f"  tag          {record.tag}"),
        _line(f"  built        {record.built_at} by sparkforge {record.tool_version}"),
        _line(f"  base         {base['repository']}:{base['tag']} @ "
              + (base["digest"]["value"] or (f"{labels[BASE_LABEL]} (not pinned; the base the engine held when it "
                                             "built)" if labels.get(BASE_LABEL) else "UNPINNED"))),
        _line(f"  platform     {platform_of(record.machine) or 'not recorded'}"
              + (f" (its Python ran as {record.machine})" if record.machine else "")),
        _line(f"  vllm         {v['version']} ({v['source']}) commit "
              f"{v['commit']['value'] or v.get('built_commit') or '-'}; installed {installed.get('vllm')}"),
    ]
    wheel = record.wheel
    if wheel:
        where = {WheelOrigin.CACHE: f"from the wheel cache, key {(wheel.cache_key or '')[:12]}, compiled for "
                                    f"{wheel.compiled_for}", WheelOrigin.RECIPE: "the recipe's prebuilt wheel",
                 WheelOrigin.COMPILED: "compiled in the image build"}[wheel.origin]
        lines.append(_line(f"  vllm wheel   {wheel.filename} sha256 {wheel.sha256}; {where}"))
    for c in record.components:
        pin = (c["version"]["value"] or "UNPINNED") if c["kind"] == "pip" else (c["commit"]["value"] or "UNPINNED")
        name = (c.get("package") or c["name"]).split("[")[0]
        lines.append(_line(f"  {c['name']:<12} {c['kind']} {c.get('package') or c.get('repo')} {pin}; "
                           f"installed {installed.get(name, installed.get(c['name']))}"))
    lines.append(_line(f"  arch list    {record.build['torch_cuda_arch_list']}"))
    lines += [_line(f"  mod          {m.name} ({m.phase.value}) {m.digest[:19]} -> "
                    f"{m.result.value if m.result else 'not recorded'}"
                    + (f"; patch {_patch_origin(m.patch)}" if m.patch else ""))
              for m in record.mods]
    lines += [_line(f"  protected    {name} {version}") for name, version in sorted(record.protected.items())]
    lines += [_line("  ", ("UNPINNED", "yellow"), f"     {u.field}: {u.reason}") for u in record.unpinned]
    lines += [_line(f"  label        {key}={labels[key]}") for key in sorted(labels)]
    return lines


def repro_lines(result: ReproResult) -> list[Text]:
    """verify-repro: both builds, and where they differ."""
    lines = [_line(f"build {n}: manifest {img.manifest}  image ID {img.config}  ({len(img.layers)} layers)")
             for n, img in ((1, result.first), (2, result.second))]
    if result.identical:
        return lines + [_line(f"identical: both builds give manifest {result.first.manifest}")]
    lines.append(_line(("DIFFERENT", "bold red"), f": {len(result.layers)} of {len(result.first.layers)} layers differ"))
    for layer in result.layers:
        lines.append(_line(f"  layer {layer.index} [{layer.step}]: {len(layer.files)} files differ"))
        lines += [_line(f"    {f.path}: {', '.join(f.what)}") for f in layer.files[:15]]
        if len(layer.files) > 15:
            lines.append(_line(f"    ... and {len(layer.files) - 15} more"))
    if result.config_fields:
        lines.append(_line(f"  config: {', '.join(result.config_fields[:12])}"))
    return lines


def diff_lines(d: Diff, sections: Sequence[str], summary: Callable[[Diff, str], str]) -> list[Text]:
    """diff: each section's changes, or what stayed the same; a section not listed only when it changed."""
    lines = [_line(f"diff {d.a.label} -> {d.b.label}")]
    for section in (*sections, *(s for s in d.sections if s not in sections)):
        shown = [change.line() for change in d.in_section(section)] or [summary(d, section)]
        lines += [_line(f"  {section if i == 0 else '':<11} {text}") for i, text in enumerate(shown)]
    lines += [_line(f"  note: {note}") for note in d.notes]
    count = len(d.changes)
    lines.append(_line(f"{count} change{'s' if count != 1 else ''}"))
    return lines


def outdated_table(components: Iterable[Outdated]) -> Table:
    table = _table("component", "pinned", "newest", "newer releases", "note")
    for c in components:
        table.add_row(Text(c.component), Text(c.pinned), Text(c.newest or "-"), Text(c.verdict), Text(c.note))
    return table


def applies_lines(names: Iterable[str], cells: Sequence[MatrixCell], declared: dict[str, str] | None = None,
                  prefix: str = "applies to vllm") -> list[Text]:
    """Where each mod applies, as runs of releases, and (check-mods) what it declares."""
    runs = {name: ", ".join(a if a == b else f"{a}..{b}" for a, b in applies_ranges(list(cells), name)) or "none"
            for name in names}
    return [_line(f"{name}: {prefix} {shown}" + (f"; declares {declared[name]}" if declared else ""))
            for name, shown in runs.items()]


def build_lines(plan: Plan, done: BuildOutcome) -> list[Text]:
    """`build`: the image built, how much came from the cache, and the tags that moved."""
    result = done.result
    ran = len(result.ran)
    lines = [_line(f"built {result.image_id[:19]} in {result.seconds:.1f}s: {ran} steps ran, "
                   f"{len(result.steps) - ran} cached; log: {result.log_path}")]
    if done.smoke_already_passed:
        lines.append(_line(f"static smoke tier already passed for {result.image_id[:19]} (it carries {plan.tag})"))
    elif done.static is None:
        lines.append(_line("static smoke tier: not run (--no-smoke); the tags moved without it"))
    wheel, key = done.wheel, (done.wheel.key or "")[:12]
    said = {"cache": f"from the wheel cache, key {key}, sha256 {wheel.sha256}; the compile did not run",
            "recipe": f"the recipe's prebuilt wheel, sha256 {wheel.sha256}",
            "compiled": f"compiled ({wheel.why_compiled}) and stored in the wheel cache, key {key}, sha256 "
                        f"{wheel.sha256}" if wheel.stored else f"compiled in the image build ({wheel.why_compiled})"}
    if wheel.origin in said:  # a release or the base's own vLLM: nothing to say
        lines.append(_line(f"vllm wheel: {said[wheel.origin]}"))
    if done.replaced:
        lines.append(_line(done.replaced))
    return lines + [_line(f"tagged {ref}") for ref in done.tagged]


def dry_run_lines(d: DryRun) -> list[Text]:
    """`build --dry-run`: the tags, the context and the exact command, quoted for a shell."""
    lines = [_line(f"tag         {d.tag}"), _line(f"moving tag  {d.moving_tag}"),
             _line(f"context     {d.context} (not written)")]
    if d.note:
        lines.append(_line(f"note        {d.note}"))
    return lines + [_line(shlex.join(d.command))]


def bump_lines(result: BumpResult) -> list[Text]:
    """`bump`: each mod kept or dropped with the reason, what the new recipe leaves open, and what was written."""
    b = result.bump
    lines = [_line(f"bump {b.old.variant} -> {b.recipe.stem}: vllm {b.old.vllm.version} -> {b.version}")]
    lines += [_line("  ", ("kept   ", "green") if v.kept else ("dropped", "yellow"), f" {v.mod}: {v.reason}")
              for v in b.verdicts]
    lines += [_line("  ", ("not set", "yellow"), f" {name}: {why}") for name, why in b.env_dropped]
    lines += [_line("  ", ("open   ", "yellow"), f" {what}") for what in b.unresolved]
    widened = ", ".join(str(path) for path, _ in b.edits)
    if not result.written:
        lines.append(_line(f"dry run: nothing written; {b.recipe} would read:"))
        lines += [_line(f"    {row}") for row in b.text.splitlines()]
        if widened:
            lines.append(_line(f"and these mods' targets would widen: {widened}"))
    else:
        lines.append(_line(f"wrote {b.recipe}" + (f"; widened the targets of {widened}" if widened else "")))
    return lines


def lock_lines(variant: str, path: Path | None, lock: Lock) -> list[Text]:
    """`lock`: what was pinned, and what could not be resolved from here."""
    lines = [
        _line(f"locked {variant} -> {path}"),
        _line(f"  base      {lock.base.repository}:{lock.base.tag} @ "
              f"{lock.base.digest.value or 'unresolved (below)'}"),
        _line(f"  packages  {len(lock.installed)} installed" if lock.packages_unresolved is None
              else "  packages  unresolved"),
        _line(f"  mods      {', '.join(f'{m.name} {m.digest[:19]}' for m in lock.mods) or '-'}"),
        _line(f"  epoch     SOURCE_DATE_EPOCH={lock.source_date_epoch}"),
    ]
    return lines + [_line("  ", ("UNRESOLVED", "yellow"), f" {fld}: {reason}") for fld, reason in lock.unresolved()]


def check_summary(report: ModsReport) -> Text:
    """check-mods: one line of counts."""
    failed, unverified = len(report.in_state(RowState.FAILED)), len(report.in_state(RowState.UNVERIFIED))
    total = len(report.rows)
    why = " (not checked from here; the detail says why)" if unverified else ""
    return _line(f"{total} results: {total - failed - unverified} ok, {failed} failed, {unverified} unverified{why}")


def check_matrix(report: ModsReport) -> list[Table | Text]:
    """check-mods --matrix: releases down, mods across, then where each mod applies."""
    names = [m.name for m in report.mods]
    return [matrix_table(report.cells, names, report.versions, "mods x vLLM releases (! = differs from the mod's "
                         "targets)"),
            *applies_lines(names, report.cells, {m.name: m.spec.targets.versions for m in report.mods})]


def outdated_lines(report: Report, tried_mods: bool) -> list[Table | Text]:
    """`outdated`: the components, then (when mods were tried) the newer releases they apply to."""
    shown: list[Table | Text] = [outdated_table(report.components)]
    if not report.cells:
        if report.mods:
            why = ("not tried (--no-mods)" if not tried_mods else "skipped, no newer vLLM release to try them on"
                   if report.components[0].checked else "not tried, since the vLLM releases could not be read")
            shown.append(_line(f"mods: {why}"))
        return shown
    versions = list(dict.fromkeys(c.version for c in report.cells))
    return shown + [matrix_table(report.cells, list(report.mods), versions,
                                 "vLLM mods on the newer releases (! = differs from the mod's targets)"),
                    *applies_lines(report.mods, report.cells, prefix="applies to newer vllm")]


def deploy_lines(plan: Plan, result: Deployment) -> list[Table | Text]:
    """`deploy`: a row per node with what it moved, where each failed node's moving tag stayed, then the counts."""
    from ..distribute.deploy import CURRENT, FAILED, UPDATED, human_bytes  # distribute.deploy loads only for its verbs

    table = _table("node", "result", "image ID", "moved", "time", "detail")
    for r in result.results:
        detail = "moving tag kept on its old image (below)" if r.outcome == FAILED else r.node.endpoint
        table.add_row(Text(r.node.name), Text(r.outcome, OUTCOME_STYLE[r.outcome]), (r.image_id or "-")[:19],
                      human_bytes(r.bytes_moved), f"{r.seconds:.1f}s", Text(detail))
    counts = {k: sum(1 for r in result.results if r.outcome == k) for k in (UPDATED, CURRENT, FAILED)}
    return [table, *(_line(f"{r.node.name}: failed: {r.error}; {plan.moving_tag} still on "
                           f"{(r.previous_id or 'nothing')[:19]}") for r in result.results if r.outcome == FAILED),
            _line(f"{len(result.results)} nodes: {counts[UPDATED]} updated, {counts[CURRENT]} current, "
                  f"{counts[FAILED]} failed; {human_bytes(result.bytes_moved)} moved in {result.seconds:.1f}s")]


def status_lines(status: ClusterStatus, moving_tag: str) -> list[Table | Text]:
    """`status`: a row per node (its image, the compared build's tag, whether it is the head's), and what they mean."""
    tag = ImageRef.parse(status.tag).tag or "tag"
    table = _table("node", "image ID", tag, "matches head", "detail")
    head_id = status.image.image_id if status.image else None
    for n in status.nodes:
        if n.error:
            table.add_row(Text(n.node.name), "-", "-", Text("no answer", "red"), Text(n.error))
            continue
        match = "-" if head_id is None else Text("yes", "green") if n.current else Text("no", "red")
        table.add_row(Text(n.node.name), (n.moving_id or "none")[:19], n.tag_state or "-", match,
                      Text(n.node.endpoint))
    return [table, _line(
        (f"image ID: what {moving_tag} points to on the node (its own ID); {tag}: whether the node holds that "
         "build under its tag (yes, other: another image, no: absent); matches head: the node's image is the "
         "head's build, compared by its layers", "dim"))]


def status_summary(status: ClusterStatus) -> list[Text]:
    """`status` when the nodes do not all match: how many match, differ, and did not answer."""
    answered = [n for n in status.nodes if not n.error]
    silent = len(status.nodes) - len(answered)
    matching = sum(1 for n in answered if n.current)
    parts = [f"{matching} of {len(status.nodes)} match the head" if status.image else "the head has no image",
             f"{len(status.ids)} distinct image{'s' if len(status.ids) != 1 else ''} among the {len(answered)} that "
             "answered"]
    if silent:
        parts.append(f"{silent} did not answer")
    return [_line(("nodes differ", "bold red"), f": {'; '.join(parts)}")]
