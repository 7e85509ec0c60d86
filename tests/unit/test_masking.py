"""Every URL shown is masked whatever its user and password hold (`/`, `#`, `?`, `@`, `%`, `:`, blanks, any
character): over generated URLs, in the masking helpers, in every message of the URL reader and the registry
client, in a table that cuts a long cell into lines, and through the real command line (`outdated`,
`check-mods`) with a password in the index URL."""

from __future__ import annotations

import subprocess
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.table import Table
from rich.text import Text

from sparkforge import net
from sparkforge.errors import DownloadError, mask_secrets, mask_url, visible
from sparkforge.registry import Client, Endpoint, RegistryError
from tests.support.cli import run_cli
from tests.support.paths import VARIANTS

BLANKS = " \t\n\r\f\v"  # where a URL in free text ends
ANY = st.characters(blacklist_categories=("Cs",))  # every code point a str can hold
WORD = st.characters(blacklist_categories=("Cs",), blacklist_characters=BLANKS)
SCHEMES = st.sampled_from(["https", "http", "HTTPS", "git+https", "ftp", "ssh", "docker"])
HOSTS = st.from_regex(r"\A[a-z0-9]([a-z0-9.-]{0,30}[a-z0-9])?\Z")
PORTS = st.none() | st.integers(1, 65535)
PATHS = st.text(alphabet="abcxyz0123456789/._-~%?#=&+:;,'\"()[]", max_size=30)


def place(host: str, port: int | None, path: str) -> str:
    """What stands after the user and password: host[:port]/path (no '@' in it)."""
    return f"{host}{f':{port}' if port else ''}/{path}"


@settings(max_examples=200, deadline=None)
@given(SCHEMES, st.text(WORD, max_size=20), st.text(WORD, min_size=1, max_size=40), HOSTS, PORTS, PATHS)
def test_a_url_in_free_text_is_masked_up_to_its_last_at(scheme: str, user: str, password: str, host: str,
                                                        port: int | None, path: str) -> None:
    url, shown = f"{scheme}://{user}:{password}@{place(host, port, path)}", f"{scheme}://***@{place(host, port, path)}"
    assert mask_url(url) == shown
    assert mask_secrets(f"cannot fetch {url}: refused") == f"cannot fetch {shown}: refused"
    assert mask_secrets(f"git said: unable to access '{url}'\nnext line") == \
        f"git said: unable to access '{shown}'\nnext line"
    assert mask_secrets(f"two: {url} {url}") == f"two: {shown} {shown}"


@settings(max_examples=200, deadline=None)
@given(SCHEMES, st.text(ANY, max_size=20), st.text(ANY, min_size=1, max_size=40), HOSTS, PORTS, PATHS)
def test_one_url_is_masked_whatever_its_password_holds(scheme: str, user: str, password: str, host: str,
                                                       port: int | None, path: str) -> None:
    url = f"{scheme}://{user}:{password}@{place(host, port, path)}"
    assert mask_url(url) == f"{scheme}://***@{place(host, port, path)}"


@settings(max_examples=200, deadline=None)
@given(st.text(ANY, max_size=20), st.text(ANY, min_size=1, max_size=40), PATHS)
def test_no_message_of_the_url_reader_or_the_registry_repeats_a_password(user: str, password: str,
                                                                         path: str) -> None:
    url = f"https://{user}:{password}@127.0.0.1:9/{path}"
    wanted = f"https://***@127.0.0.1:9/{path}: the URL carries a user or password (not supported); refused"
    for call in (lambda: net.get(url, deadline=1), lambda: list(net.stream(url, deadline=1)),
                 lambda: net.request("PUT", url, deadline=1, body=b"x")):
        with pytest.raises(net.FetchFailed) as err:
            call()
        assert str(err.value) == wanted  # refused before anything is opened: nothing listens on port 9 anyway
        assert str(DownloadError(str(err.value), field="vllm.url")) == f"vllm.url: {visible(wanted, keep_newlines=False)}"
    with pytest.raises(RegistryError) as err:
        Client(Endpoint("127.0.0.1:9", "https")).finish_upload("team/app", url, "sha256:" + "a" * 64)
    assert str(err.value) == visible(f"blob upload team/app@sha256:{'a' * 64} at 127.0.0.1:9: the URL carries a user "
                                     "or password (not supported); refused", keep_newlines=False)


@pytest.mark.parametrize("text", [
    "git https://github.com/vllm-project/vllm.git v0.17.0 @ 600a039f572a",  # show's line: the '@' is a word
    "ssh://me@node1 and ssh://me@node2:2222",  # an ssh user alone is no secret
    "blob team/app@sha256:abc at 127.0.0.1:5000: HTTP 404",
    "mail me@example.org about https://h/x",
    "nvcr.io/nvidia/pytorch:26.01-py3@sha256:abc",
])
def test_text_without_a_password_is_left_as_it_is(text: str) -> None:
    assert mask_secrets(text) == text


def test_masking_costs_time_in_proportion_to_the_text() -> None:
    for hostile in ("a://" * 250_000 + "@", "a" * 1_000_000 + "://@", ("x" * 1000 + "://") * 1000 + "@"):
        start = time.monotonic()
        mask_secrets(hostile)
        assert time.monotonic() - start < 2, hostile[:20]


def test_a_table_cut_into_lines_shows_no_password(capsys: pytest.CaptureFixture[str]) -> None:
    from sparkforge.cli.app import out

    table = Table(box=None)
    table.add_column("note", width=14)
    table.add_row(Text("https://me:hun-ter2@registry.example.org/simple/vllm/ gave no answer"))
    out.print(table)
    shown = capsys.readouterr().out
    assert "hun" not in shown and "ter2" not in shown and "***@" in shown, shown


# ------------------------------------------------------------------ the command line


PASSWORDS = ["p/w", "p#w", "p?w", "p@w", "p%2Fw", "p w", "long/" + "x" * 150]


def index_cli(*args: str, index: str, cache) -> subprocess.CompletedProcess:
    return run_cli("--images", str(VARIANTS), *args, timeout=120,
                   env={"SPARKFORGE_INDEX_URL": index, "SPARKFORGE_CACHE": str(cache)})


@pytest.mark.parametrize("password", PASSWORDS)
def test_outdated_and_check_mods_never_print_the_index_s_password(password: str, tmp_path) -> None:
    index = f"https://me:{password}@127.0.0.1:9/simple"
    for args in (("outdated", "testvllm"), ("check-mods", "testvllm")):
        proc = index_cli(*args, index=index, cache=tmp_path / "cache")
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
        shown = proc.stdout + proc.stderr
        assert "https://***@127.0.0.1:9/simple/vllm/: the URL carries a user or password" in " ".join(shown.split())
        assert password not in shown and password.replace(" ", "") not in "".join(shown.split()), shown
