"""gitfetch against a real git server over HTTPS: tags peeled, short SHAs resolved, mirrors per URL."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkforge import gitfetch
from sparkforge.recipe.resolve import Unreachable, git_commit
from tests.support import gitserver

pytestmark = pytest.mark.needs("git")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("git")
    repos = root / "repos"
    repos.mkdir()
    tree = root / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "__init__.py").write_text("VERSION = 'upstream'\n")
    (tree / "CMakeLists.txt").write_text("project(probe)\n")
    upstream = gitserver.init_repo(repos, "upstream", tree, tag="v1.0")
    fork = gitserver.init_repo(repos, "fork", tree, tag="v1.0")
    fork_next = gitserver.add_commit(repos / "fork.git", "pkg/__init__.py", "VERSION = 'fork'\n", "fork change")
    srv = gitserver.start(repos, root / "certs")
    mp = pytest.MonkeyPatch()
    mp.setenv("GIT_SSL_CAINFO", str(srv.ca))
    yield srv, {"upstream": upstream, "fork": fork, "fork_next": fork_next}
    mp.undo()
    srv.stop()


def test_annotated_tag_is_peeled_to_its_commit(server, tmp_path: Path) -> None:
    srv, commits = server
    tag_object = gitserver.git(srv.root / "upstream.git", "rev-parse", "v1.0")
    assert tag_object != commits["upstream"]
    mirror, commit = gitfetch.resolve(tmp_path, srv.repo_url("upstream"), "v1.0")
    assert commit == commits["upstream"]
    gitfetch.export(mirror, commit, tmp_path / "out")
    assert (tmp_path / "out" / gitfetch.COMMIT_MARK).read_text().strip() == commit
    assert (tmp_path / "out" / "CMakeLists.txt").is_file()  # the whole tree, not only the package


def test_short_sha_resolves_to_the_one_commit(server, tmp_path: Path) -> None:
    srv, commits = server
    _, commit = gitfetch.resolve(tmp_path, srv.repo_url("fork"), commits["fork_next"][:9])
    assert commit == commits["fork_next"]
    assert git_commit(srv.repo_url("fork"), commits["fork_next"][:8]) == commits["fork_next"]  # what lock records


def test_missing_short_sha_is_refused_with_the_reason(server, tmp_path: Path) -> None:
    srv, _ = server
    with pytest.raises(gitfetch.FetchError, match="no commit starting with 00000000a on any branch or tag"):
        gitfetch.resolve(tmp_path, srv.repo_url("upstream"), "00000000a")
    with pytest.raises(Unreachable, match="00000000a"):
        git_commit(srv.repo_url("upstream"), "00000000a")


def test_a_fork_never_reuses_the_upstream_mirror(server, tmp_path: Path) -> None:
    srv, commits = server
    up_mirror, _ = gitfetch.resolve(tmp_path, srv.repo_url("upstream"), "v1.0")
    fork_mirror, commit = gitfetch.resolve(tmp_path, srv.repo_url("fork"), commits["fork_next"])
    assert up_mirror != fork_mirror
    assert commit == commits["fork_next"]
    gitfetch.export(fork_mirror, commit, tmp_path / "fork")
    assert (tmp_path / "fork" / "pkg" / "__init__.py").read_text() == "VERSION = 'fork'\n"
    # The upstream mirror does not know the fork's commit: asking it there fails, as it should.
    with pytest.raises(gitfetch.FetchError):
        gitfetch.resolve(tmp_path, srv.repo_url("upstream"), commits["fork_next"][:10])


def test_pinned_commit_is_fetched_by_its_sha(server, tmp_path: Path) -> None:
    srv, commits = server
    _, commit = gitfetch.resolve(tmp_path, srv.repo_url("fork"), "v1.0", commits["fork_next"])
    assert commit == commits["fork_next"]
    with pytest.raises(gitfetch.FetchError, match="not a full 40-hex commit"):
        gitfetch.resolve(tmp_path, srv.repo_url("fork"), "v1.0", "abc")


def test_mirror_path_is_keyed_by_the_url() -> None:
    a = gitfetch.mirror_path(Path("/c"), "https://github.com/vllm-project/vllm.git")
    b = gitfetch.mirror_path(Path("/c"), "https://github.com/someone/vllm.git")
    assert a != b and a.name.startswith("vllm-") and b.name.startswith("vllm-")


def test_command_line_reports_one_line_on_failure(server, tmp_path: Path, capsys) -> None:
    srv, _ = server
    code = gitfetch.main(["--cache", str(tmp_path), "--repo", srv.repo_url("upstream"), "--ref", "fffffff",
                          "--dest", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "no commit starting with fffffff" in err[0]
    assert not (tmp_path / "x").exists()


def test_a_remote_that_fails_once_is_asked_again(server, monkeypatch) -> None:
    """A dropped connection or a busy server: the second answer counts; two failures are Unreachable."""
    import subprocess

    from sparkforge.recipe import resolve

    srv, commits = server
    real_run, calls = resolve.run, []

    def flaky(argv, **kw):
        calls.append(argv)
        if len(calls) == 1 or "upstream" not in argv[2]:
            return subprocess.CompletedProcess(argv, 128, "", "fatal: unable to access: Connection reset by peer\n")
        return real_run(argv, **kw)

    monkeypatch.setattr(resolve, "run", flaky)
    monkeypatch.setattr(resolve, "ASK_AGAIN_AFTER", 0.0)
    assert git_commit(srv.repo_url("upstream"), "v1.0") == commits["upstream"] and len(calls) == 2
    with pytest.raises(Unreachable, match=r"Connection reset by peer \(asked 2 times\)"):
        git_commit(srv.repo_url("fork"), "v1.0")
    assert len(calls) == 4
