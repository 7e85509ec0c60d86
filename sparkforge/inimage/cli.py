"""The image's command line, as Dockerfile.j2 and the smoke tests call it: `python3 -I -B /opt/sparkforge/inimage
COMMAND ...`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from collections.abc import Callable

from . import bytecode, kernels
from .apply import apply_mod, component_root, verify_mod, write_all
from .contract import CheckState, ContractError, ModResult, ModState, SmokeCheck, WheelOrigin
from .coverage import parse_gpu
from .patcher import PATCHER_TIMEOUT, child_main
from .paths import ModFailure, check_folder
from .preflight import preflight
from .record import base_vllm, check_protected, note_wheel, protect, write_record
from .seam import read_mod
from .smoke import smoke_gpu, smoke_static


def _error(message: str, code: int = 1) -> int:
    """Say message on stderr, and give the exit code to return."""
    print(message, file=sys.stderr)
    return code


def _cmd_apply(args: argparse.Namespace) -> int:
    folder = Path(args.mod)
    try:
        check_folder(folder)
        spec = read_mod(folder / "mod.json", f"{folder.name}/mod.json")
        root = Path(args.root) if args.root else component_root(spec.component)
    except (ModFailure, OSError, ContractError) as exc:
        return _error(f"mod {folder.name}: FAILED: {exc}")
    result = apply_mod(spec, folder, root, patcher_timeout=args.patcher_timeout)
    if result.state == ModState.FAILED:
        return _error(result.line())
    print(result.line())
    bad = [c for c in verify_mod(spec, root, in_image=False) if c[1] == CheckState.FAILED]
    if bad:
        return _error(f"mod {spec.name}: FAILED: verify: {bad[0][0]}: {bad[0][2]}")
    if args.record:
        write_all({Path(args.record): ModResult(spec.name, result.state, spec.phase, str(root)).to_json().encode()})
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    failed = 0
    for folder in args.mods:
        try:
            spec = read_mod(Path(folder) / "mod.json", f"{folder}/mod.json")
            root = Path(args.root) if args.root else component_root(spec.component)
        except (ContractError, ModFailure) as exc:
            print(f"mod {Path(folder).name}: FAILED: {exc}", file=sys.stderr)
            failed += 1
            continue
        for label, state, detail in verify_mod(spec, root, in_image=True):
            print(f"{spec.name}\t{state.value}\t{label}" + (f"\t{detail}" if detail else ""))
            failed += state == CheckState.FAILED
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
    try:
        record = write_record(Path(args.home))
    except ContractError as exc:
        return _error(f"build record: {exc}")
    print(f"build record: {record.variant} {record.tag}")
    return 0


def _cmd_note_wheel(args: argparse.Namespace) -> int:
    note = note_wheel(Path(args.wheel), WheelOrigin(args.origin), args.key, args.compiled_for)
    write_all({Path(args.out): note.to_json().encode()})
    print(f"vllm wheel: {note.origin.value}, {note.filename}, sha256 {note.sha256}")
    return 0


def _cmd_base_vllm(args: argparse.Namespace) -> int:
    problem, found = base_vllm(args.version)
    if problem:
        return _error(f"vllm of the base: {problem}", 2)
    print(f"vllm of the base: {found} (release {args.version}), kept")
    return 0


def _cmd_smoke(args: argparse.Namespace) -> int:
    checks = smoke_static(Path(args.home)) if args.tier == "static" else smoke_gpu(Path(args.home))
    for name, state, detail in checks:
        print(SmokeCheck(name, state, detail).to_json(), end="")
    return 1 if any(state == CheckState.FAILED for _, state, _ in checks) else 0


def _cmd_preflight(args: argparse.Namespace) -> int:
    print(preflight(args.master, args.master_port, args.port, args.model).to_json(), end="")
    return 0


def _cmd_kernels_scan(args: argparse.Namespace) -> int:
    paths: list[Path] = []
    for root in args.roots:
        if not Path(root).exists():
            return _error(f"kernels scan: {root} does not exist", 2)
        paths += kernels.library_files(Path(root))
    dists: dict[str, list[Path]] = {}
    for name in args.dist:
        files = kernels.distribution_files(name)
        if files is None:
            return _error(f"kernels scan: --dist {name}: no such distribution is installed", 2)
        dists[name] = files
        paths += files
    try:
        for gpu in args.gpu:
            parse_gpu(gpu)
    except ValueError as exc:
        return _error(f"kernels scan: --gpu: {exc}", 2)
    record = kernels.scan(paths, args.gpu, args.not_needed, dists)
    try:
        write_all({Path(args.out): record.to_json(indent=2).encode()})
    except OSError as exc:
        return _error(f"kernels scan: cannot write {args.out}: {exc.strerror or exc}")
    bad = [e for e in record.extensions if e.error]
    print(f"kernels: {len(record.extensions) - len(bad)} extensions with device code, "
          f"{record.without_device_code} libraries without, {len(bad)} unreadable -> {args.out}")
    return 0


def _cmd_kernels_check(args: argparse.Namespace) -> int:
    checks = kernels.check_home(Path(args.home), args.gpu)
    for name, state, detail in checks:
        print(json.dumps({"check": name, "state": state, "detail": detail}))
    return 1 if any(state == "failed" for _, state, _ in checks) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inimage", description="Apply and verify mods, and record the image.")
    sub = parser.add_subparsers(dest="cmd", required=True)

    def command(name: str, text: str, run: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=text)
        p.set_defaults(func=run)
        return p

    p = command("apply", "apply one mod (a folder holding mod.json and its assets)", _cmd_apply)
    p.add_argument("mod")
    p.add_argument("--root", help="the component root (default: found from the installed package)")
    p.add_argument("--record", help="write the result to this JSON file")
    p.add_argument("--patcher-timeout", type=float, default=PATCHER_TIMEOUT, metavar="SECONDS",
                   help=f"time limit of each run of a patcher (default {PATCHER_TIMEOUT:g})")
    command("patcher-child", "(internal) run a patcher for apply, in a child process",
            lambda args: child_main(args.patcher)).add_argument("patcher")
    p = command("verify", "run the verify checks of mods", _cmd_verify)
    p.add_argument("mods", nargs="+")
    p.add_argument("--root")
    p = command("protect", "record the base's versions of packages pip must not replace", _cmd_protect)
    p.add_argument("--out", required=True)
    p.add_argument("names", nargs="*")
    command("check-protected", "fail if a protected package was replaced", _cmd_check_protected).add_argument("dir")
    command("record", "write the build record into HOME/build-record.json", _cmd_record).add_argument("home")
    p = command("note-wheel", "record the vLLM wheel installed and where it came from", _cmd_note_wheel)
    p.add_argument("wheel")
    p.add_argument("--origin", required=True, choices=[o.value for o in WheelOrigin])
    p.add_argument("--key", help="the wheel cache key (origin cache and compiled)")
    p.add_argument("--compiled-for", help="origin cache: the build that compiled it (VARIANT-HASH at TIME)")
    p.add_argument("--out", required=True)
    command("base-vllm", "check that the base carries the vLLM release VERSION (vllm.source: base)",
            _cmd_base_vllm).add_argument("version")
    p = command("smoke", "run a smoke tier inside the image; one JSON line per check", _cmd_smoke)
    p.add_argument("--tier", choices=["static", "gpu"], default="static")
    p.add_argument("--home", default="/opt/sparkforge")
    p = command("preflight", "before a launch: the model folder, the ports, and the interface to the master "
                "(one JSON line)", _cmd_preflight)
    p.add_argument("--master", required=True, help="the master's address or host name")
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--port", type=int, action="append", default=[], help="a port this rank binds (repeat)")
    p.add_argument("--model", help="the model folder as the rank sees it")
    command("compile", "byte-compile what pip installed with --no-compile, on every core (default: the "
            "site-packages)", lambda args: bytecode.main(args.dirs)).add_argument("dirs", nargs="*")
    kernels_cmd = sub.add_parser("kernels", help="record or check the CUDA kernels of the image: kernels scan|check",
                                 description="which GPUs the image's CUDA extensions can run on")
    within = kernels_cmd.add_subparsers(dest="command", required=True)
    p = within.add_parser("scan", help="record the device code of every shared library under ROOTs and of --dist")
    p.set_defaults(func=_cmd_kernels_scan)
    p.add_argument("roots", nargs="*", metavar="ROOT")
    p.add_argument("--dist", action="append", default=[], help="an installed Python distribution's libraries")
    p.add_argument("--gpu", action="append", default=[], help="a compute capability the image is for (12.1)")
    p.add_argument("--not-needed", action="append", default=[], metavar="NAME",
                   help="an extension no listed GPU needs (its file name up to the first dot)")
    p.add_argument("--out", required=True)
    p = within.add_parser("check", help="check every recorded extension against the GPUs; one JSON line per check")
    p.set_defaults(func=_cmd_kernels_check)
    p.add_argument("--home", default="/opt/sparkforge")
    p.add_argument("--gpu", action="append", default=[], help="a compute capability (default: the record's)")
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.func
    return run(args)
