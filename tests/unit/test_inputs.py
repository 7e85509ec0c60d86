"""Odd inputs and a hostile world, through the real command line: one line each, the right exit code, no
traceback, no hang, and nothing half-written left behind (names too long, FIFOs, keys written twice, deep
YAML, escape codes, full and read-only caches, wrong wheels, slow and redirecting servers, shared caches)."""

from __future__ import annotations

import http.server
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from sparkforge import net
from sparkforge.build import wheels
from sparkforge.recipe.download import sha256_of
from sparkforge.files import NotRegularFile, read_regular
from tests.support.cli import assert_one_line, run_cli
from tests.support import drip
from tests.support import fileserver
from tests.support.limits import gives_up
from tests.support.gitserver import serve_https
from tests.support.paths import MODS, ROOT, TEST_MODS, VARIANTS
LONG = "a" * 300  # longer than any file name may be (255)
WHEEL = "vllm-0.17.0-cp38-abi3-linux_x86_64.whl"
CHECKING = ("checking ",)  # the progress lines check-mods writes to stderr before its error

RECIPE = """\
image: sparkforge-test/vllm
base:
  repository: sparkforge/base-local
  tag: bookworm
  digest: {unknown: local}
build:
  torch_cuda_arch_list: 12.1a
"""
PYPI = 'vllm:\n  source: pypi\n  version: "0.17.0"\n'
MOD = """\
name: drop-in
summary: a file
description: a file
component: image
targets: {versions: ">=0"}
phase: install
kind: files
files:
  - {src: hello.txt, dest: /opt/hello.txt}
verify:
  - {file: /opt/hello.txt, contains: hello}
"""


def cli(*args: str, cache: Path | None = None, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    if cache is not None:
        env["SPARKFORGE_CACHE"] = str(cache)
    return run_cli(*args, timeout=timeout, env=env)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """images/ with `good` (a PyPI vLLM and one drop-in mod) and mods/drop-in."""
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "good.yaml").write_text(RECIPE + PYPI + "mods: [drop-in]\n")
    mod = tmp_path / "mods" / "drop-in"
    mod.mkdir(parents=True)
    (mod / "mod.yaml").write_text(MOD)
    (mod / "hello.txt").write_text("hello\n")
    return tmp_path


def run(project: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    return cli("--images", str(project / "images"), "--mods", str(project / "mods"), *args, **kw)


def leftovers(folder: Path) -> list[str]:
    """Temporary files and folders of an unfinished write below folder."""
    return [p.name for p in folder.rglob("*") if p.name.endswith((".part", ".tmp")) or p.name.startswith((".tree.",
                                                                                                       ".trash"))]


# ---------------------------------------------------------------- paths that cannot be paths


@pytest.mark.parametrize("where", ["variant", "--images", "--mods", "-o", "cache", "wheels list", "wheels prune"])
def test_a_name_too_long_is_one_line(project: Path, tmp_path: Path, where: str) -> None:
    long = str(tmp_path / LONG)
    args = {"variant": ("show", LONG), "--images": ("--images", long, "show", "good"),
            "--mods": ("--mods", long, "show", "good"), "-o": ("render", "good", "-o", long),
            "cache": ("render", "good"), "wheels list": ("wheels", "list", "--wheel-cache", long),
            "wheels prune": ("wheels", "prune", "--all", "--wheel-cache", long)}[where]
    if where in ("--images", "--mods"):
        other = "mods" if where == "--images" else "images"
        proc = cli(f"--{other}", str(project / other), *args)
    else:
        proc = run(project, *args, cache=Path(long) if where == "cache" else tmp_path / "cache")
    line = assert_one_line(proc)
    assert "aaaa" in line and len(line) < 600


@pytest.mark.parametrize("option", ["--images", "--mods"])
def test_a_folder_option_naming_a_file_is_one_line(project: Path, option: str) -> None:
    other = "--mods" if option == "--images" else "--images"
    proc = cli(option, str(project / "images" / "good.yaml"), other, str(project / other.strip("-")), "show", "good")
    assert_one_line(proc, "good.yaml", option, "is not a folder")


def test_a_recipe_may_be_a_link_to_a_file_outside_the_project(project: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere" / "shared.yaml"
    outside.parent.mkdir()
    outside.write_text(RECIPE + PYPI + "mods: [drop-in]\n")
    (project / "images" / "linked.yaml").symlink_to(outside)
    proc = run(project, "show", "linked", "--json")
    assert proc.returncode == 0 and '"images/linked.yaml"' in proc.stdout, proc.stderr


# ---------------------------------------------------------------- FIFOs: refused, never waited on


def test_open_regular_refuses_a_fifo_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    with pytest.raises(NotRegularFile, match="is a FIFO"):
        read_regular(fifo)
    with pytest.raises(NotRegularFile, match="is a folder"):
        read_regular(tmp_path)


@pytest.mark.parametrize("what", ["recipe", "mod.yaml", "mod file", "wheel path", "--ca-cert", "cluster file"])
def test_a_fifo_where_a_file_belongs_is_one_line_at_once(project: Path, tmp_path: Path, what: str) -> None:
    images = project / "images"
    args: tuple[str, ...] = ("show", "good")
    named = {"recipe": "fifo.yaml", "mod.yaml": "mod.yaml", "mod file": "mod.yaml", "wheel path": "vllm.path",
             "--ca-cert": "--ca-cert", "cluster file": "cluster.yaml"}[what]
    if what == "recipe":
        os.mkfifo(images / "fifo.yaml")
        args = ("show", "fifo")
    elif what == "mod.yaml":
        (project / "mods" / "drop-in" / "mod.yaml").unlink()
        os.mkfifo(project / "mods" / "drop-in" / "mod.yaml")
    elif what == "mod file":
        (project / "mods" / "drop-in" / "hello.txt").unlink()
        os.mkfifo(project / "mods" / "drop-in" / "hello.txt")
    elif what == "wheel path":
        (images / "wheels").mkdir()
        os.mkfifo(images / "wheels" / WHEEL)
        (images / "w.yaml").write_text(RECIPE + f"vllm:\n  source: wheel\n  path: wheels/{WHEEL}\n  sha256: {'a' * 64}"
                                       '\n  version: "0.17.0"\nmods: [drop-in]\n')
        args = ("check-mods", "w")
    elif what == "--ca-cert":
        os.mkfifo(tmp_path / "ca.pem")
        args = ("render", "good", "-o", str(tmp_path / "out"), "--ca-cert", str(tmp_path / "ca.pem"))
    else:
        os.mkfifo(tmp_path / "cluster.yaml")
        args = ("status", "good", "--cluster", str(tmp_path / "cluster.yaml"))
    # Had the command opened the FIFO, it would wait for a writer that never comes: the run's time limit (a
    # guard, not a measure) would end it with TimeoutExpired.
    proc = run(project, *args, cache=tmp_path / "cache", timeout=120)
    assert_one_line(proc, named, progress=CHECKING)


# ---------------------------------------------------------------- YAML: keys written twice, nesting


@pytest.mark.parametrize("rel", ["images/good.yaml", "mods/drop-in/mod.yaml", "cluster.yaml"])
def test_a_key_written_twice_names_the_file_the_key_and_both_lines(project: Path, rel: str) -> None:
    path = project / rel
    text = path.read_text() if path.exists() else "registry:\n  host: 10.0.0.1\nnodes: []\n"
    lines = text.splitlines()
    path.write_text("\n".join(lines + [lines[0]]) + "\n")  # the first line's key again, at the end
    key = lines[0].split(":")[0]
    args = ("status", "good", "--cluster", str(path)) if rel == "cluster.yaml" else ("show", "good")
    assert_one_line(run(project, *args), rel.split("/")[-1], repr(key), f"lines 1 and {len(lines) + 1}")


@pytest.mark.parametrize("text", ["a: " + "[" * 100_000 + "]" * 100_000, "a:\n" + "".join(
    "  " * i + f"k{i}:\n" for i in range(200)) + "  " * 200 + "x: 1\n", "a: " + "{b: " * 50_000 + "1" + "}" * 50_000],
    ids=["flow-lists", "block-maps", "flow-maps"])  # the texts are too long to be test IDs (the environment)
def test_deep_nesting_is_one_line_not_a_crash(project: Path, text: str) -> None:
    (project / "images" / "deep.yaml").write_text(text)
    assert_one_line(run(project, "show", "deep"), "deep.yaml", "nested more than")


# ---------------------------------------------------------------- terminal safety


def test_escape_codes_from_a_recipe_reach_the_terminal_escaped(project: Path) -> None:
    recipe = project / "images" / "good.yaml"
    recipe.write_text('description: "\\e]0;owned\\a\\e[2J\\x9b31m plain"\n' + recipe.read_text())
    for args in (("show", "good"), ("list",)):
        proc = run(project, *args)
        assert proc.returncode == 0, proc.stderr
        assert not any(ch in proc.stdout for ch in "\x1b\x07\x9b"), repr(proc.stdout)
    assert "\\x1b]0;owned" in run(project, "show", "good").stdout
    recipe.write_text(recipe.read_text() + '"\\e[31mcolour": red\n')  # an unknown key, named in the error line
    line = assert_one_line(run(project, "show", "good"), "\\x1b[31mcolour")
    assert "\x1b" not in line


def test_a_password_in_a_url_is_never_repeated(project: Path) -> None:
    (project / "images" / "w.yaml").write_text(
        RECIPE + f"vllm:\n  source: wheel\n  url: https://me:hunter2@h.example/{WHEEL}\n  sha256: {'a' * 64}\n"
        '  version: "0.17.0"\n')
    proc = run(project, "show", "w")
    assert_one_line(proc, "w.yaml", "vllm.url", "***@h.example")
    assert "hunter2" not in proc.stderr + proc.stdout


# ---------------------------------------------------------------- Ctrl-C at any moment of start-up


# Marks, in a file, the moment build.py first imports the package: its first line inside the block that
# turns a Ctrl-C into one line. A Ctrl-C before that, while Python itself starts, is Python's to report.
MARK_IMPORT = """\
import sys


class _Mark:
    def find_spec(self, name, path=None, target=None):
        if name == "sparkforge":
            open({ready!r}, "w").close()
            sys.meta_path.remove(self)
        return None


sys.meta_path.insert(0, _Mark())
"""


@pytest.mark.parametrize("after", [*(i / 50 for i in range(21)), 2])
def test_ctrl_c_during_start_up_is_one_line(project: Path, tmp_path: Path, after: float) -> None:
    """Ctrl-C `after` seconds into loading the package (about 0.4 s of imports, longer on a cold disk), or once
    it is done. The command downloads a patch from a server that takes the connection and never answers, so it
    is still running whenever the signal comes: only the signal ends it (the download's own limit is 120 s).
    Seen before build.py stopped at once while loading: a KeyboardInterrupt that importlib's module-lock
    callback printed and dropped, the command going on, and a half-imported module failing later."""
    hook, ready = tmp_path / "hook", tmp_path / "ready"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(MARK_IMPORT.format(ready=str(ready)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])),
               SPARKFORGE_CACHE=str(tmp_path / "cache"))
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"https://127.0.0.1:{silent.getsockname()[1]}/fix.diff"
        proc = subprocess.Popen([sys.executable, str(ROOT / "build.py"), "--images", str(project / "images"), "--mods",
                                 str(project / "mods"), "mod", "new", "fix", "--from-url", url,
                                 "--versions", "==0.17.0"],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                # SIGINT as a shell leaves it for a command: a test worker may run with it ignored,
                                # and a Python started so never turns it into KeyboardInterrupt
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + 60
            while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.002)
            assert ready.exists(), f"build.py never imported the package: {proc.communicate(timeout=60)}"
            time.sleep(after)
            assert proc.poll() is None, proc.communicate(timeout=60)
            proc.send_signal(signal.SIGINT)
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate(timeout=60)
                pytest.fail(f"still running 30 s after Ctrl-C; it said {out!r} {err!r}")
        finally:
            if proc.poll() is None:
                proc.kill()
    assert (proc.returncode, out, err) == (130, "", "interrupted\n")
    assert not (project / "mods" / "fix").exists() and leftovers(tmp_path / "cache") == []


# ---------------------------------------------------------------- check-mods checks a wheel as build does


def make_wheel(path: Path, version: str = "0.17.0") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"vllm-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
        zf.writestr("vllm/__init__.py", "")
    return sha256_of(path)


def wheel_recipe(project: Path, sha: str, where: str = f"path: wheels/{WHEEL}", mod: str = "drop-in") -> None:
    (project / "images" / "w.yaml").write_text(
        RECIPE + f"vllm:\n  source: wheel\n  {where}\n  sha256: '{sha}'\n  version: \"0.17.0\"\nmods: [{mod}]\n")


def vllm_mod(project: Path) -> str:
    """A real mod of the project that edits vLLM, copied in: check-mods checks it against the wheel's files."""
    import shutil

    shutil.copytree(MODS / "uf17-eager-allreduce", project / "mods" / "uf17-eager-allreduce")
    return "uf17-eager-allreduce"


@pytest.mark.parametrize("case, field, words", [
    ("wrong sha256", "vllm.sha256", "not " + "0" * 64),
    ("METADATA names another version", "vllm.version", "holds vllm 0.18.0 (its METADATA)"),
    ("not a zip", "vllm.path", "not a whole wheel"),
])
def test_check_mods_fails_on_a_wrong_wheel_like_build(project: Path, tmp_path: Path, case: str, field: str,
                                                      words: str) -> None:
    wheel = project / "images" / "wheels" / WHEEL
    sha = make_wheel(wheel, "0.18.0" if case == "METADATA names another version" else "0.17.0")
    if case == "not a zip":
        wheel.write_bytes(b"PK\x03\x04 not really a zip")
        sha = sha256_of(wheel)
    wheel_recipe(project, "0" * 64 if case == "wrong sha256" else sha)
    cache = tmp_path / "cache"
    proc = run(project, "check-mods", "w", cache=cache)
    assert_one_line(proc, "w.yaml", field, words, progress=CHECKING)
    assert "unverified" not in proc.stdout and not leftovers(cache)
    if case == "wrong sha256":
        assert not list(cache.rglob("*.whl"))


def test_check_mods_reports_an_unreachable_wheel_unverified(project: Path, tmp_path: Path) -> None:
    wheel_recipe(project, "b" * 64, f"url: https://127.0.0.1:{fileserver.closed_port()}/{WHEEL}", vllm_mod(project))
    proc = run(project, "check-mods", "w", cache=tmp_path / "cache")
    assert proc.returncode == 0 and "unverified" in proc.stdout, proc.stdout + proc.stderr
    assert run(project, "check-mods", "--strict", "w", cache=tmp_path / "cache").returncode == 1


# ---------------------------------------------------------------- a full or read-only cache


@pytest.fixture
def small_fs(tmp_path: Path):
    """A folder on a 64 KiB file system (a tmpfs mount: tests that use it are marked root)."""
    folder = tmp_path / "small"
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], check=True)
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


@pytest.fixture
def read_only(tmp_path: Path):
    """A folder no write can go to: a read-only tmpfs for root, a mode of 0555 for anyone else."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() == 0:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(folder)], check=True)
        yield folder
        subprocess.run(["umount", str(folder)], check=True)
    else:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)


def big_wheel(project: Path) -> str:
    wheel = project / "images" / "wheels" / WHEEL
    make_wheel(wheel)
    with zipfile.ZipFile(wheel, "a") as zf:
        zf.writestr("vllm/blob.bin", os.urandom(300_000))
    return sha256_of(wheel)


@pytest.mark.root
def test_a_full_cache_is_one_line_and_leaves_no_part_file(project: Path, small_fs: Path) -> None:
    wheel_recipe(project, big_wheel(project))
    assert_one_line(run(project, "check-mods", "w", cache=small_fs), str(small_fs), "No space left on device", code=1,
                    progress=CHECKING)
    assert not leftovers(small_fs) and not list(small_fs.rglob("*.whl"))


def test_a_read_only_cache_is_one_line(project: Path, read_only: Path) -> None:
    wheel_recipe(project, big_wheel(project))
    assert_one_line(run(project, "check-mods", "w", cache=read_only), str(read_only), code=1, progress=CHECKING)
    assert not list(read_only.iterdir())


# ---------------------------------------------------------------- the wheel cache's verbs


def test_prune_refuses_a_folder_that_is_not_a_wheel_cache(tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    for name in ("photos", ".export.keep", ".trash-x", "0123456789ab.x"):
        (folder / name).mkdir(parents=True)
        os.utime(folder / name, (0, 0))  # as old as a leftover can be
    proc = cli("wheels", "prune", "--all", "--wheel-cache", str(folder))
    assert_one_line(proc, "mine", "--wheel-cache", "is not a wheel cache")
    assert sorted(p.name for p in folder.iterdir()) == [".export.keep", ".trash-x", "0123456789ab.x", "photos"]


def test_prune_cleans_a_marked_cache(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    wheels.claim(folder)
    (folder / ".export.old").mkdir()
    os.utime(folder / ".export.old", (0, 0))
    proc = cli("wheels", "prune", "--all", "--wheel-cache", str(folder))
    assert proc.returncode == 0 and not (folder / ".export.old").exists(), proc.stderr


@pytest.mark.parametrize("entry, why", [
    ("{not json", "cannot be read as JSON: line 1, column 2"),
    ('{"format": 1, "key": "KEY", "inputs": {"vllm": "0.17", "source_mods": [1]}, "wheel": "wheels/vllm-0.17.0.whl",'
     ' "sha256": "' + "c" * 64 + '", "size": 1, "created": "x", "compiled_for": "y"}', "missing or mistyped"),
    ('{"format": 1, "key": "KEY", "inputs": {}, "wheel": "wheels/vllm-0.17.0.whl", "sha256": "' + "c" * 64 + '",'
     ' "size": 1, "created": "x", "compiled_for": "y"}', "its wheel is missing"),
    ("[1, 2]", "not a JSON object"),
])
def test_wheels_list_shows_a_damaged_entry_in_one_line(tmp_path: Path, entry: str, why: str) -> None:
    key = "d" * 64
    (tmp_path / key).mkdir()
    (tmp_path / key / "entry.json").write_text(entry.replace("KEY", key))
    proc = cli("wheels", "list", "--wheel-cache", str(tmp_path))
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    damaged = [line for line in proc.stdout.splitlines() if line.startswith("damaged entry")]
    assert len(damaged) == 1 and why in damaged[0] and key in damaged[0], proc.stdout


# ---------------------------------------------------------------- servers that misbehave


class _Redirect(http.server.BaseHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        pass

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        self.send_response(302)
        self.send_header("Location", f"http://127.0.0.1:{self.server.server_address[1]}/{WHEEL}")
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.mark.parametrize("path, deadline, window, reason", [
    ("/body", 60, 1.5, r"\d+ bytes in \d+s, too slow to be a working server; given up"),  # the rate over a window
    ("/body", 3, 60, r"not complete within 3s \(headers: 120s\)"),  # the whole transfer's deadline
    ("/headers", 3, 60, r"not complete within 3s \(headers: 120s\)"),  # headers that never end
], ids=["body-rate", "body-deadline", "headers-deadline"])
def test_a_server_dripping_bytes_is_given_up_by_the_limit_it_breaks(path: str, deadline: float, window: float,
                                                                    reason: str) -> None:
    with drip.serve(every=0.3) as url:  # a byte every 0.3 s: no read ever waits the window out
        err, seconds = gives_up(lambda: net.get(url + path, deadline=deadline, window=window))
    assert type(err) is net.FetchFailed, err
    assert re.fullmatch(re.escape(url + path) + ": " + reason, str(err)), str(err)
    assert seconds >= min(deadline, window)


def test_a_redirect_from_https_to_http_is_refused(project: Path, tmp_path: Path) -> None:
    server, url, ca = serve_https(_Redirect, tmp_path / "certs")
    try:
        wheel_recipe(project, "e" * 64, f"url: {url}/{WHEEL}", vllm_mod(project))
        bundle = fileserver.bundle(ca, tmp_path / "bundle.pem")
        proc = run(project, "check-mods", "--strict", "w", "--ca-cert", str(bundle), cache=tmp_path / "cache")
        assert proc.returncode == 1 and "leaves https; refused" in " ".join(proc.stdout.split()), proc.stdout
        assert not leftovers(tmp_path / "cache")
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------- one cache, several processes


@pytest.mark.network
def test_two_check_mods_share_one_empty_cache(tmp_path: Path) -> None:
    """Both always succeed, in each round on a fresh cache: the real vLLM sdist from PyPI."""
    for round_ in range(2):
        cache = tmp_path / f"cache{round_}"
        procs = [subprocess.Popen([sys.executable, str(ROOT / "build.py"), "--images", str(VARIANTS),
                                   "check-mods", "testvllm"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=dict(os.environ, SPARKFORGE_CACHE=str(cache))) for _ in range(2)]
        results = [(p.wait(timeout=900), *p.communicate()) for p in procs]
        for code, out, err in results:
            assert code == 0 and " 0 failed, 0 unverified" in out, (round_, out, err)
        assert not leftovers(cache), leftovers(cache)


# ---------------------------------------------------------------- no silent winner between mods


@pytest.mark.parametrize("second, words", [
    ("files:\n  - {src: hello.txt, dest: /opt/hello.txt}\n", "mods drop-in and other both write /opt/hello.txt"),
    ("files:\n  - {src: hello.txt, dest: /opt/other.txt}\nenv: {name: SF_TOGGLE, default: '1', description: x}\n",
     "mods drop-in and other both set the env name SF_TOGGLE"),
])
def test_two_mods_claiming_one_dest_or_env_name_are_refused(project: Path, second: str, words: str) -> None:
    first = project / "mods" / "drop-in" / "mod.yaml"
    first.write_text(first.read_text() + "env: {name: SF_TOGGLE, default: '0', description: x}\n")
    other = project / "mods" / "other"
    other.mkdir()
    (other / "hello.txt").write_text("other\n")
    (other / "mod.yaml").write_text(MOD.replace("name: drop-in", "name: other").split("files:")[0] + second
                                    + "verify:\n  - {file: /opt/hello.txt, contains: o}\n")
    recipe = project / "images" / "good.yaml"
    recipe.write_text(recipe.read_text().replace("mods: [drop-in]", "mods: [drop-in, other]"))
    assert_one_line(run(project, "show", "good"), "good.yaml", "mods", words)


def test_one_mod_writing_one_dest_twice_is_refused(project: Path) -> None:
    meta = project / "mods" / "drop-in" / "mod.yaml"
    meta.write_text(meta.read_text().replace("files:\n", "files:\n  - {src: hello.txt, dest: /opt/hello.txt}\n"))
    assert_one_line(run(project, "show", "good"), "drop-in/mod.yaml", "files[0].dest (/opt/hello.txt) and "
                    "files[1].dest (/opt/hello.txt) name one file")


@pytest.mark.parametrize("address,loopback", [
    ("127.0.0.1:5000", True), ("127.0.0.1", True), ("127.8.9.10:443", True), ("localhost:5000", True),
    ("localhost", True), ("[::1]", True), ("::1", True), ("10.0.0.1:5000", False),
    ("registry.example:5000", False), ("localhost.example", False), ("0.0.0.0:5000", False),
])
def test_one_loopback_check(address, loopback):
    """Plain HTTP for a registry on this machine, TLS elsewhere: the lock's digest lookup and the cluster
    file's registry ask the same function."""
    assert net.is_loopback(address) is loopback


# ---------------------------------------------------------------- output that cannot be written


def direct(*args: str, preexec=None, **kw) -> subprocess.CompletedProcess:
    """build.py in a process of its own (not forked from the test server): its stdout is what the test gives."""
    return subprocess.run([sys.executable, str(ROOT / "build.py"), *args], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                          timeout=120, preexec_fn=preexec, **kw)


def _no_stdout() -> None:
    os.close(1)


STDOUT_COMMANDS = [("list",), ("list", "--names"), ("show", "ng17", "--json"), ("show", "ng17"), ("--help",)]


@pytest.mark.parametrize("args", STDOUT_COMMANDS, ids=" ".join)
def test_stdout_on_a_full_disk_is_one_line_and_exit_1(args: tuple[str, ...]) -> None:
    with open("/dev/full", "w") as full:
        proc = direct(*args, stdout=full)
    assert (proc.returncode, proc.stderr) == (1, "error: <stdout>: No space left on device\n")


@pytest.mark.parametrize("args", STDOUT_COMMANDS, ids=" ".join)
def test_a_closed_stdout_is_one_line_and_exit_1(args: tuple[str, ...]) -> None:
    proc = direct(*args, preexec=_no_stdout)
    assert (proc.returncode, proc.stderr) == (1, "error: <stdout>: Bad file descriptor\n")


def test_a_reader_that_left_is_exit_1_without_a_word() -> None:
    """`build.py show ng17 | head -1`: the pipe breaks; nothing but the exit code says so (as typer does)."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "build.py"), "show", "ng17"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    assert proc.wait(timeout=120) == 1
    assert proc.stderr.read() == ""


def test_an_error_line_with_stderr_unwritable_still_exits_with_its_code() -> None:
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, str(ROOT / "build.py"), "show", "nope"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=full, timeout=120)
    assert proc.returncode == 2 and proc.stdout == b""


def test_a_character_the_terminal_cannot_show_is_escaped(project: Path) -> None:
    recipe = project / "images" / "good.yaml"
    recipe.write_text("description: caf\u00e9 \u202eevil\n" + recipe.read_text())
    proc = subprocess.run([sys.executable, str(ROOT / "build.py"), "--images", str(project / "images"), "--mods",
                           str(project / "mods"), "show", "good"], cwd=ROOT, capture_output=True, timeout=120,
                          env=dict(os.environ, PYTHONIOENCODING="ascii", LC_ALL="C"))
    assert proc.returncode == 0, proc.stderr
    assert b"caf\\xe9 \\u202eevil" in proc.stdout


# ---------------------------------------------------------------- files that cannot be written


def fill(folder: Path) -> None:
    """Take every free byte of the file system folder is on."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


def lock_project(images: Path) -> None:
    shutil.copy(VARIANTS / "testsmall.yaml", images / "testsmall.yaml")


def lock_run(images: Path, **kw) -> subprocess.CompletedProcess:
    return cli("--images", str(images), "--mods", str(TEST_MODS), "lock", "testsmall", "--no-build", timeout=300, **kw)


@pytest.mark.root
def test_a_full_disk_while_writing_a_lock_names_it_and_leaves_nothing(small_fs: Path) -> None:
    lock_project(small_fs)
    fill(small_fs)
    assert_one_line(lock_run(small_fs), f"{small_fs / 'testsmall.lock.json'}: No space left on device", code=1,
                    progress=("  ", "warning: "))
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler", "testsmall.yaml"]


def test_a_file_too_large_while_writing_a_lock_names_it_and_leaves_nothing(tmp_path: Path) -> None:
    """ulimit -f: a write past the limit fails with EFBIG (Python ignores SIGXFSZ)."""
    images = tmp_path / "images"
    images.mkdir()
    lock_project(images)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (512, 512))  # a lock is about 900 bytes

    proc = subprocess.run([sys.executable, str(ROOT / "build.py"), "--images", str(images), "--mods", str(TEST_MODS),
                           "lock", "testsmall", "--no-build"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          preexec_fn=limit)
    assert_one_line(proc, f"{images / 'testsmall.lock.json'}: File too large", code=1, progress=("  ", "warning: "))
    assert sorted(p.name for p in images.iterdir()) == ["testsmall.yaml"]


def test_a_read_only_folder_for_a_lock_names_it(tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    lock_project(images)
    images.chmod(0o555)
    root = os.geteuid() == 0
    try:
        if root:  # root writes through a mode: a read-only bind mount of the folder on itself
            subprocess.run(["mount", "--bind", "-o", "ro", str(images), str(images)], check=True)
        proc = lock_run(images)
    finally:
        if root:
            subprocess.run(["umount", str(images)], check=True)
        images.chmod(0o755)
    assert_one_line(proc, f"{images / 'testsmall.lock.json'}: ", code=1, progress=("  ", "warning: "))
    assert sorted(p.name for p in images.iterdir()) == ["testsmall.yaml"]


@pytest.mark.root
def test_render_on_a_full_cache_renders_and_into_a_full_folder_names_it(project: Path, small_fs: Path,
                                                                        tmp_path: Path) -> None:
    """The cache holds only Jinja's compiled template, which the next render may compile again."""
    fill(small_fs)
    proc = run(project, "render", "good", "-o", str(tmp_path / "out"), cache=small_fs)
    assert proc.returncode == 0 and (tmp_path / "out" / "Dockerfile").is_file(), proc.stderr
    proc = run(project, "render", "good", "-o", str(small_fs / "out"), cache=tmp_path / "cache")
    assert_one_line(proc, str(small_fs / "out"), "No space left on device", code=1)
    assert [p.relative_to(small_fs).as_posix() for p in sorted(small_fs.rglob("*"))] == ["filler", "jinja"]


def test_render_with_a_read_only_cache_renders(project: Path, read_only: Path, tmp_path: Path) -> None:
    proc = run(project, "render", "good", "-o", str(tmp_path / "out"), cache=read_only)
    assert proc.returncode == 0 and (tmp_path / "out" / "Dockerfile").is_file(), proc.stderr
