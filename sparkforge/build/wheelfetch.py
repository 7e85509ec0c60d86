"""A locked wheel set, downloaded on this machine before the build, for the image's pip to install offline.

The image's pip runs emulated for an arm64 image built on x86-64 (15 minutes for vLLM 0.33.0's 4.3 GB set,
where this machine's pip takes one), so the project environment's pip downloads exactly the lock's files.
Each file is kept once, by its sha256, with the other downloads (recipe/download.py); a folder per set links
to them and is the build's named context `wheel-set`, which the image's pip installs from with `--no-index`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..inimage import proc
from ..errors import BuildError
from ..files import locked, name_path, write_atomic
from ..recipe.download import cached, downloads_dir, sha256_of
from ..recipe.plan import Plan, WheelPin
from ..recipe.sources import cache_dir, index_url
from ..recipe.wheelset import download_bytes, platforms, requirements_txt
from .wheels import discard

CONTEXT = "wheel-set"  # the named build context Dockerfile.j2 mounts
DOWNLOAD_TIMEOUT = 4 * 3600.0  # seconds for a whole set: 4.3 GB at 0.3 MB/s; more is a hung index
EVERY = 10.0  # seconds between progress lines


def set_folder(plan: Plan) -> Path:
    """The folder of the plan's wheel set (it may not be there yet): one per set of files and target."""
    assert plan.python is not None
    return folder_of(plan.python.version, plan.python.platform, plan.wheel_set)


def folder_of(version: str, platform: str, wheel_set: tuple[WheelPin, ...]) -> Path:
    """The folder of a wheel set for a Python version and platform, as a lock names them."""
    text = f"{version}\n{platform}\n{requirements_txt(wheel_set)}"
    return cache_dir() / "wheel-sets" / hashlib.sha256(text.encode()).hexdigest()[:32]


def _stamp(folder: Path) -> Path:
    """Beside a set's folder: each file's size and mtime when its hash was last checked."""
    return folder.with_name(f"{folder.name}.checked")


def _stats(folder: Path) -> dict[str, list[int]]:
    return {p.name: [(st := p.stat()).st_size, st.st_mtime_ns] for p in sorted(folder.iterdir())}


def _complete(plan: Plan, folder: Path) -> bool:
    """Every pin has one of its files in folder, of the size the lock says, and nothing else is there."""
    if not folder.is_dir():
        return False
    for pin in plan.wheel_set:  # pip takes one of the files the lock allows
        sizes = {name: size for name, _sha, size in pin.files}
        there = [name for name in sizes if (folder / name).is_file()]
        if len(there) != 1 or (folder / there[0]).stat().st_size != sizes[there[0]]:
            return False
    return len(list(folder.iterdir())) == len(plan.wheel_set)


def _whole(plan: Plan, folder: Path) -> bool:
    """A complete set whose files have not changed since their hashes were checked (else the image's pip fails)."""
    if not _complete(plan, folder):
        return False
    try:
        return bool(json.loads(_stamp(folder).read_text()) == _stats(folder))
    except (OSError, ValueError):
        return False


def _link(src: Path, dst: Path) -> None:
    """dst as a hard link to src, or (another file system, links not allowed) a copy put in place whole."""
    try:
        os.link(src, dst)
    except FileExistsError:
        raise
    except OSError:
        tmp = dst.with_name(f".{dst.name}.part")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)


def pip_command(plan: Plan, dest: Path, reqs: Path, ca_cert: Path | None) -> list[str]:
    """pip download of exactly the set's files, for the image's Python and platform, verified by sha256."""
    assert plan.python is not None
    major, minor = plan.python.version.split(".")[:2]
    # every platform tag the target takes: pip does not widen a manylinux_2_X given to it to the older ones
    tags = [word for tag in platforms(plan.python) for word in ("--platform", tag)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--only-binary", ":all:",
            *tags, "--python-version", f"{major}.{minor}", "--implementation", "cp",
            "--abi", f"cp{major}{minor}", "--index-url", index_url(), "--no-cache-dir", "--disable-pip-version-check",
            "--no-input", "--progress-bar", "off", "--timeout", "60", *(["--cert", str(ca_cert)] if ca_cert else []),
            "-d", str(dest), "-r", str(reqs)]


def fetch(plan: Plan, *, ca_cert: Path | None = None, say: Callable[[str], None] = lambda line: None) -> Path:
    """The folder of the plan's wheel set, downloaded where not whole yet (by one process at a time)."""
    folder = set_folder(plan)
    if _whole(plan, folder):
        return folder
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with locked(folder.parent / f"{folder.name}.lock", timeout=DOWNLOAD_TIMEOUT, what="downloads this wheel set",
                    on_wait=lambda: say("wheel set: another sparkforge process is downloading it; waiting")):
            if not _whole(plan, folder):
                _fetch(plan, folder, ca_cert, say)
    except OSError as exc:
        name_path(exc, folder)
        raise BuildError(f"cannot store the wheel set: {exc.strerror or exc}", path=exc.filename or folder,
                         field="wheel set") from None
    return folder


def _fetch(plan: Plan, folder: Path, ca_cert: Path | None, say: Callable[[str], None]) -> None:
    try:
        import pip  # noqa: F401 - the project environment's pip does the download
    except ImportError:
        raise BuildError("pip is not in the project environment; `make venv` installs it from requirements.lock",
                         field="wheel set") from None
    total = download_bytes(plan.wheel_set)
    staging = Path(tempfile.mkdtemp(prefix=".fetch.", dir=folder.parent))
    try:
        for pin in plan.wheel_set:  # the file pip takes, where an earlier set downloaded it
            name, sha, _size = pin.files[0]
            if cached(sha, name).is_file():
                with contextlib.suppress(FileNotFoundError):  # a prune took it meanwhile: pip downloads it
                    _link(cached(sha, name), staging / name)
            if (staging / name).is_file() and sha256_of(staging / name) != sha:  # changed: it leaves the cache
                cached(sha, name).unlink(missing_ok=True)
                (staging / name).unlink()
        have = len(list(staging.iterdir()))
        if have == len(plan.wheel_set):
            say(f"wheel set: {len(plan.wheel_set)} wheels, {total / 1e9:.2f} GB; all {have} already here")
        else:  # pip checks the hash of a file that is there, and downloads the others
            say(f"wheel set: {len(plan.wheel_set)} wheels, {total / 1e9:.2f} GB; {have} already here, the rest "
                "downloaded with this machine's pip")
            _download(plan, staging, ca_cert, say, total)
        if not _complete(plan, staging):
            raise BuildError("pip download did not give one file of each of the set's wheels", field="wheel set")
        for pin in plan.wheel_set:
            name, sha, _size = pin.files[0]
            keep = cached(sha, name)
            if not keep.is_file():
                with contextlib.suppress(FileNotFoundError):  # a prune emptied the hash's folder meanwhile: the
                    keep.parent.mkdir(parents=True, exist_ok=True)  # set is whole, only the store lacks it
                    _link(staging / name, keep)
        stats = _stats(staging)
        if folder.is_dir():  # a broken set (a file deleted or changed): it goes, this one takes its place
            discard(folder)
        os.rename(staging, folder)
        write_atomic(_stamp(folder), json.dumps(stats).encode())
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _download(plan: Plan, staging: Path, ca_cert: Path | None, say: Callable[[str], None], total: int) -> None:
    """pip download into staging, saying every EVERY seconds how far pip's log has got (files come at the end)."""
    reqs = staging.parent / f"{staging.name}.txt"
    log = staging.parent / f"{staging.name}.log"
    # Only the first file of each pin, the one the image's pip prefers, is allowed: pip takes a file only when its
    # hash is allowed, so the download cannot pick another by an order of its own.
    reqs.write_text("".join(f"{p.name}=={p.version} --hash=sha256:{p.files[0][1]}\n" for p in plan.wheel_set))
    started = time.monotonic()
    stop = threading.Event()

    def report() -> None:
        while not stop.wait(EVERY):
            try:
                text = log.read_text(errors="replace")
            except OSError:
                continue
            n = text.count(" Collecting ")
            say(f"wheel set: pip has reached {n} of {len(plan.wheel_set)} wheels "
                f"({time.monotonic() - started:.0f} s)")

    threading.Thread(target=report, daemon=True).start()
    try:
        # pip's temporary downloads stay beside the set (the same file system; /tmp may be small)
        done = proc.run([*pip_command(plan, staging, reqs, ca_cert), "--log", str(log)], what="pip download",
                        capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT,
                        env={**os.environ, "TMPDIR": str(staging.parent)})
    except proc.CommandError as exc:
        raise BuildError(f"the wheel set's download stopped: {exc}", field="wheel set") from None
    finally:
        stop.set()
        reqs.unlink(missing_ok=True)
        log.unlink(missing_ok=True)
    if done.returncode != 0:
        raise BuildError(f"pip download of the wheel set failed: {_why(done.stderr)}", field="wheel set")
    say(f"wheel set: {total / 1e9:.2f} GB here after {time.monotonic() - started:.0f} s")


def _why(stderr: str) -> str:
    """pip's reason in one line: for a hash mismatch, which file and both hashes; else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if any("DO NOT MATCH THE HASHES" in line for line in lines):
        which = next((line.split(" from ")[0] for line in lines if " from " in line and "://" in line), "a wheel")
        expected = next((line.split()[-1] for line in lines if line.startswith("Expected sha256")), "?")
        got = next((line.split()[-1] for line in lines if line.startswith("Got")), "?")
        return f"{which}: the index's file has sha256 {got}, the lock says {expected} (lock the variant again?)"
    return lines[-1] if lines else "no message"


def stored_sets() -> list[Path]:
    """Every wheel set folder in the cache (the hidden folders of a fetch or a discard are not sets)."""
    # "*/" matches files too before Python 3.11: is_dir() keeps the folders.
    return sorted(p for p in (cache_dir() / "wheel-sets").glob("[!.]*") if p.is_dir() and not p.is_symlink())


def _inodes(folder: Path) -> list[tuple[tuple[int, int], Path]]:
    """Each file in a folder with its (device, inode), links not followed; none when it is gone."""
    found = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(folder):
            st = entry.stat(follow_symlinks=False)
            found.append(((st.st_dev, st.st_ino), Path(entry.path)))
    return found


def unshared(folder: Path, kept: list[Path]) -> list[Path]:
    """The files removing a set removes: its own, and the downloads they link to that no kept set or running
    fetch also links to."""
    root = cache_dir() / "wheel-sets"
    staging = [p for p in root.glob(".fetch.*") if p.is_dir() and not p.is_symlink()]
    others = {inode for k in [*kept, *staging] for inode, _ in _inodes(k)}
    mine = {inode for inode, _ in _inodes(folder)} - others
    files = sorted(folder.iterdir()) if folder.is_dir() else []
    hashes = [d for d in downloads_dir().glob("*") if d.is_dir() and not d.is_symlink()]
    return files + [path for d in hashes for inode, path in _inodes(d) if inode in mine]


def freed(files: list[Path]) -> int:
    """The bytes removing these files gives back: a file's, once all its links are among them, counted once."""
    seen: dict[tuple[int, int], list[int]] = {}  # (device, inode): [links among the files, links, size]
    for f in files:
        try:
            st = f.lstat()
        except FileNotFoundError:
            continue
        seen.setdefault((st.st_dev, st.st_ino), [0, st.st_nlink, st.st_size])[0] += 1
    return sum(size for among, links, size in seen.values() if among >= links)


def remove_set(folder: Path, kept: list[Path]) -> None:
    """Remove a set, its check stamp and the downloads no kept set shares; its lock stays (a waiter waits on it)."""
    for f in unshared(folder, kept):
        if f.parent != folder:
            f.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                f.parent.rmdir()  # the hash's folder, once empty
    shutil.rmtree(folder)
    _stamp(folder).unlink(missing_ok=True)
