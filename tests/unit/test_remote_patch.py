"""Mods whose patch is named by URL or pull request, pinned by sha256, through the real command line.

The patch is real: the diff of one vLLM file from the 0.17.0 to the 0.18.1 release sdist (an
upstream change), served over HTTPS on loopback with a certificate from a test CA. It applies to
0.17.0 and is `already` in 0.18.1. Each run has a cache of its own (the release trees are shared
with the real cache through links), so that what a run downloads and leaves behind can be seen.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.cli import run_cli
from tests.support import fileserver
from tests.support import upstream
from sparkforge.recipe import sources
from sparkforge.recipe.schema import pr_diff_url

# Real vLLM sources: release sdists from the package index (cached after the first run).
pytestmark = pytest.mark.network

MOD = "colpali-template"

RECIPE = """\
# Covers: a pypi vLLM {version} variant with one mod whose patch is fetched by URL.
base: {{repository: example.org/base, tag: "1.0", digest: {{unknown: not resolved in this test}}}}
vllm: {{source: pypi, version: "{version}", install_deps: false}}
build: {{torch_cuda_arch_list: "12.1a"}}
mods: [{mod}]
"""


@pytest.fixture(scope="module")
def trees() -> Path:
    """The real cache, holding the vLLM 0.17.0 and 0.18.1 release trees."""
    for version in (upstream.OLD, upstream.NEW):
        sources.release_tree("vllm", version)
    return sources.cache_dir()


@pytest.fixture(scope="module")
def diff(trees: Path) -> bytes:
    return upstream.release_diff()


@pytest.fixture
def server(tmp_path: Path):
    srv = fileserver.start(tmp_path / "certs")
    yield srv
    srv.stop()


@pytest.fixture
def cache(tmp_path: Path, trees: Path) -> Path:
    """A cache of this test's own, sharing the release trees (read-only use) with the real one."""
    own = tmp_path / "cache"
    own.mkdir()
    for sub in ("index", "sources", "trees"):
        (own / sub).symlink_to(trees / sub)
    return own


class Project:
    """A recipe folder with a 0.17.0 and a 0.18.1 variant, a mods folder, and a runner of the CLI."""

    def __init__(self, root: Path, cache: Path) -> None:
        self.root, self.cache = root, cache
        self.images, self.mods = root / "images", root / "mods"
        self.images.mkdir(parents=True)
        self.mods.mkdir()
        for name, version in (("v17", upstream.OLD), ("v18", upstream.NEW)):
            (self.images / f"{name}.yaml").write_text(RECIPE.format(version=version, mod=MOD))

    def mod(self, text: str, name: str = MOD) -> Path:
        folder = self.mods / name
        folder.mkdir(exist_ok=True)
        (folder / "mod.yaml").write_text(text)
        return folder

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return run_cli(*args, images=self.images, mods=self.mods, cwd=self.root, timeout=600,
                       env={"SPARKFORGE_CACHE": str(self.cache)})

    def downloads(self) -> list[str]:
        """Every file the download cache and the mod cache hold."""
        return sorted(p.relative_to(self.cache).as_posix() for sub in ("downloads", "mods")
                      if (self.cache / sub).exists() for p in (self.cache / sub).rglob("*") if p.is_file())


@pytest.fixture
def project(tmp_path: Path, cache: Path) -> Project:
    return Project(tmp_path / "project", cache)


def one_line_error(proc: subprocess.CompletedProcess, code: int) -> str:
    assert proc.returncode == code, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("checking ")]  # progress
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def rows(proc: subprocess.CompletedProcess) -> str:
    return " ".join(proc.stdout.split())


# ------------------------------------------------------------------ pure: schema and pull requests


def test_pr_resolves_to_its_diff_url() -> None:
    assert pr_diff_url("vllm-project/vllm#12345") == "https://github.com/vllm-project/vllm/pull/12345.diff"
    assert pr_diff_url("a-b/c.d_e#7") == "https://github.com/a-b/c.d_e/pull/7.diff"
    for bad in ("vllm-project/vllm", "vllm#1", "a/b#0", "a/b#1x", "-a/b#1", "a/b/c#1", "a/b#1\n"):
        with pytest.raises(ValueError):
            pr_diff_url(bad)


SHA = "ab" * 32
SCHEMA_CASES = {
    "missing sha256": ("  url: https://example.org/x.diff\n", "patch.sha256: required field is missing"),
    "url and pr": (f"  url: https://example.org/x.diff\n  pr: a/b#1\n  sha256: {SHA}\n",
                   "patch: give either url or pr, not both"),
    "neither url nor pr": (f"  sha256: {SHA}\n", "patch: give url or pr"),
    "http url": (f"  url: http://example.org/x.diff\n  sha256: {SHA}\n", "patch.url: 'http://example.org/x.diff'"),
    "bad pr": (f"  pr: vllm-project/vllm/12345\n  sha256: {SHA}\n", "patch.pr: 'vllm-project/vllm/12345' is not a "
               "pull request"),
    "short sha256": ("  url: https://example.org/x.diff\n  sha256: abc123\n", "patch.sha256: 'abc123' is not a valid"),
    "unknown key": (f"  url: https://example.org/x.diff\n  sha256: {SHA}\n  ref: main\n", "patch.ref: unknown key"),
}


@pytest.mark.parametrize("case", SCHEMA_CASES)
def test_schema_errors_are_one_line(case: str, project: Project) -> None:
    body, words = SCHEMA_CASES[case]
    text = upstream.mod_yaml(MOD, url="https://example.org/x.diff", digest=SHA)
    head, _, rest = text.partition("patch:\n")
    project.mod(head + "patch:\n" + body + rest[rest.index("verify:"):])
    line = one_line_error(project.run("show", "v17"), 2)
    assert f"mods/{MOD}/mod.yaml: {words}" in line


def test_show_needs_no_network(project: Project) -> None:
    # Nothing listens there: show and the plan never fetch; the plan carries the URL and the hash.
    url = f"https://127.0.0.1:{fileserver.closed_port()}/x.diff"
    project.mod(upstream.mod_yaml(MOD, url=url, digest=SHA))
    proc = project.run("show", "v17", "--json")
    assert proc.returncode == 0, proc.stderr
    (mod,) = json.loads(proc.stdout)["mods"]
    assert mod["spec"]["patch"] == {"url": url, "sha256": SHA}
    assert "patch " + url in project.run("show", "v17").stdout
    assert project.downloads() == []


def test_own_upstream_diff_file_is_refused(project: Project) -> None:
    folder = project.mod(upstream.mod_yaml(MOD, url="https://example.org/x.diff", digest=SHA))
    (folder / "upstream.diff").write_text("x\n")
    line = one_line_error(project.run("show", "v17"), 2)
    assert "upstream.diff: patch: upstream.diff is the name the fetched patch takes" in line


# ------------------------------------------------------------------ a real patch over HTTPS


def test_url_mod_applies_to_old_release_and_is_already_in_new(project: Project, server, diff: bytes) -> None:
    url = server.put("/vllm/colpali.diff", diff)
    project.mod(upstream.mod_yaml(MOD, url=url, digest=upstream.sha256(diff)))
    start = time.monotonic()
    first = project.run("check-mods", "v17", "--ca-cert", str(server.ca))
    fetched = time.monotonic() - start
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"v17 {MOD} applied vllm 0.17.0 (PyPI)" in rows(first)
    start = time.monotonic()
    second = project.run("check-mods", "v18", "--ca-cert", str(server.ca))
    cached = time.monotonic() - start
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"v18 {MOD} already vllm 0.18.1 (PyPI) already present in the pristine source" in rows(second)
    assert server.requests["/vllm/colpali.diff"] == 1  # downloaded once, then read from the cache
    print(f"check-mods with download {fetched:.2f}s, from the cache {cached:.2f}s")

    # Rendered, the context holds the patch as a file and mod.json names it with where it came from.
    server.stop()  # from here on, nothing may need the network
    out = project.root / "ctx"
    proc = project.run("render", "v17", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert (out / "mods" / MOD / "upstream.diff").read_bytes() == diff
    spec = json.loads((out / "mods" / MOD / "mod.json").read_text())
    assert spec["patch"] == "upstream.diff"
    assert spec["patch_source"] == {"url": url, "pr": None, "sha256": upstream.sha256(diff)}
    (planned,) = json.loads((out / "plan.json").read_text())["mods"]
    assert planned["patch"] == {"url": url, "pr": None, "sha256": upstream.sha256(diff)}


def test_pr_shorthand_is_fetched_from_its_diff_url(project: Project, diff: bytes) -> None:
    # Where github.com is not reachable (as in these tests' sandbox), the fetch fails naming the
    # pull request's diff URL, and check-mods reports the mod unverified with that reason; where it
    # is, the diff that comes is not the one pinned here, and is refused on patch.sha256.
    project.mod(upstream.mod_yaml(MOD, pr="vllm-project/vllm#99999", digest=upstream.sha256(diff)))
    proc = project.run("check-mods", "v17")
    url = "https://github.com/vllm-project/vllm/pull/99999.diff"
    if proc.returncode == 2:
        assert f"patch.sha256: {url} sent a file with sha256" in one_line_error(proc, 2)
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"{MOD} unverified" in rows(proc) and url in rows(proc)


def test_wrong_sha256_is_refused_and_nothing_cached(project: Project, server, diff: bytes) -> None:
    url = server.put("/vllm/colpali.diff", diff)
    project.mod(upstream.mod_yaml(MOD, url=url, digest="deadbeef" * 8))
    for verb in (("check-mods", "v17"), ("render", "v17", "-o", str(project.root / "ctx"))):
        line = one_line_error(project.run(*verb, "--ca-cert", str(server.ca)), 2)
        assert f"mods/{MOD}/mod.yaml: patch.sha256: {url} sent a file with sha256 {upstream.sha256(diff)}" in line
        assert "not the pinned " + "deadbeef" * 8 in line
    assert project.downloads() == []
    assert not (project.root / "ctx").exists()


def test_response_that_is_not_a_diff(project: Project, server) -> None:
    page = b"<!DOCTYPE html>\n<html><body>Sign in to see this pull request</body></html>\n"
    url = server.put("/vllm/pull/1", page)
    project.mod(upstream.mod_yaml(MOD, url=url, digest=upstream.sha256(page)))
    line = one_line_error(project.run("render", "v17", "-o", str(project.root / "ctx"), "--ca-cert",
                                      str(server.ca)), 2)
    assert f"mods/{MOD}/mod.yaml: patch.url: {url}: is not a unified diff" in line
    assert project.downloads() == []


def test_hostile_diff_is_refused(project: Project, server) -> None:
    evil = b"--- a/../../etc/x\n+++ b/../../etc/x\n@@ -0,0 +1 @@\n+owned\n"
    url = server.put("/evil.diff", evil)
    project.mod(upstream.mod_yaml(MOD, url=url, digest=upstream.sha256(evil)))
    line = one_line_error(project.run("check-mods", "v17", "--ca-cert", str(server.ca)), 2)
    assert f"patch.url: {url}: patch header '../../etc/x' climbs out of its root with '..'" in line
    assert project.downloads() == []


def test_a_binary_change_in_a_pull_request_is_refused_not_dropped(project: Project, server, diff: bytes) -> None:
    binary = diff + (b"diff --git a/docs/assets/logo.png b/docs/assets/logo.png\nindex 1e2..3f4 100644\n"
                     b"Binary files a/docs/assets/logo.png and b/docs/assets/logo.png differ\n")
    url = server.put("/vllm/pull/2.diff", binary)
    project.mod(upstream.mod_yaml(MOD, url=url, digest=upstream.sha256(binary)))
    line = one_line_error(project.run("check-mods", "v17", "--ca-cert", str(server.ca)), 2)
    assert f"patch.url: {url}: docs/assets/logo.png: a binary file change" in line
    assert project.downloads() == []


def test_unreachable_url_is_one_line(project: Project, diff: bytes) -> None:
    url = f"https://127.0.0.1:{fileserver.closed_port()}/x.diff"
    project.mod(upstream.mod_yaml(MOD, url=url, digest=upstream.sha256(diff)))
    line = one_line_error(project.run("render", "v17", "-o", str(project.root / "ctx")), 1)
    assert f"mods/{MOD}/mod.yaml: patch.url: cannot fetch the patch of mod {MOD}: {url}: " in line
    assert "refused" in line.lower()
    proc = project.run("check-mods", "v17")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{MOD} unverified" in rows(proc) and url in rows(proc)
    assert project.run("check-mods", "v17", "--strict").returncode == 1
    assert project.downloads() == []


def test_http_404_is_one_line(project: Project, server, diff: bytes) -> None:
    url = server.url + "/missing.diff"
    project.mod(upstream.mod_yaml(MOD, url=url, digest=upstream.sha256(diff)))
    line = one_line_error(project.run("render", "v17", "-o", str(project.root / "ctx"), "--ca-cert",
                                      str(server.ca)), 1)
    assert line.endswith(f"{url}: HTTP 404 Not Found")


def test_untrusted_ca_says_to_give_ca_cert(project: Project, server, diff: bytes) -> None:
    url = server.put("/vllm/colpali.diff", diff)
    project.mod(upstream.mod_yaml(MOD, url=url, digest=upstream.sha256(diff)))
    line = one_line_error(project.run("render", "v17", "-o", str(project.root / "ctx")), 1)
    assert "TLS certificate not trusted" in line and "--ca-cert" in line
    assert project.downloads() == []


# ------------------------------------------------------------------ mod new


def test_mod_new_from_url_writes_a_mod_that_passes_check_mods(project: Project, server, diff: bytes) -> None:
    url = server.put("/vllm/colpali.diff", diff)
    proc = project.run("mod", "new", "colpali", "--from-url", url, "--versions", ">=0.17.0",
                       "--ca-cert", str(server.ca))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert upstream.sha256(diff) in proc.stdout
    text = (project.mods / "colpali" / "mod.yaml").read_text()
    assert f"sha256: {upstream.sha256(diff)}" in text and f"url: {url}" in text
    assert f"file: {upstream.FILE}" in text and f"contains: '{upstream.ADDED}'" in text
    assert sorted(p.name for p in (project.mods / "colpali").iterdir()) == ["mod.yaml"]

    (project.images / "v17.yaml").write_text(RECIPE.format(version=upstream.OLD, mod="colpali"))
    check = project.run("check-mods", "v17", "--ca-cert", str(server.ca))
    assert check.returncode == 0, check.stdout + check.stderr
    assert "v17 colpali applied" in rows(check)
    assert server.requests["/vllm/colpali.diff"] == 1  # mod new's download is the one check-mods reads

    again = one_line_error(project.run("mod", "new", "colpali", "--from-url", url, "--versions", ">=0.17.0",
                                       "--ca-cert", str(server.ca)), 2)
    assert "mods/colpali: already exists" in again
    assert (project.mods / "colpali" / "mod.yaml").read_text() == text


def test_mod_new_writes_nothing_on_failure(project: Project, server) -> None:
    page = server.put("/page", b"<html>not a diff</html>\n")
    cases = [
        (("Bad_Name", "--from-url", page, "--versions", ">=0.17"), 2, "NAME: 'Bad_Name' is not a mod name"),
        (("x", "--from-url", page, "--pr", "a/b#1", "--versions", ">=0.17"), 2, "--from-url and --pr: give one of"),
        (("x", "--from-url", "http://example.org/x.diff", "--versions", ">=0.17"), 2, "--from-url: 'http://"),
        (("x", "--pr", "a/b", "--versions", ">=0.17"), 2, "--pr: 'a/b' is not a pull request"),
        (("x", "--from-url", page, "--versions", "0.17"), 2, "--versions: '0.17' is not a PEP 440 specifier"),
        (("x", "--from-url", page, "--versions", ">=0.17", "--phase", "build"), 2,
         "--phase: 'build' is not one of 'install', 'source'"),
        (("x", "--from-url", page, "--versions", ">=0.17"), 2, f"--from-url: {page}: is not a unified diff"),
        (("x", "--from-url", server.url + "/nothing", "--versions", ">=0.17"), 1, "HTTP 404 Not Found"),
    ]
    for args, code, words in cases:
        line = one_line_error(project.run("mod", "new", *args, "--ca-cert", str(server.ca)), code)
        assert words in line, (args, line)
    assert list(project.mods.iterdir()) == []
    assert project.downloads() == []
