"""Every JSON file and answer sparkforge reads goes through one reader: a key written twice, NaN, or nesting
past the parser is one line naming the file (or the registry) and the key, never the last key winning."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkforge.distribute.images import read_state
from sparkforge.errors import DistributeError
from sparkforge.inimage.contract import BuildRecord, ContractError, JsonError, KernelRecord, parse_json
from sparkforge.build.inspect import kernels_problem
from sparkforge.recipe.lock import make_lock
from sparkforge.recipe.lockfile import lock_path, write_lock
from sparkforge.recipe.planner import plan_variant
from sparkforge.registry import Client, Endpoint, RegistryError
from tests.support.cli import assert_one_line
from tests.support.recipes import layout, unlocked_images

KEYS = st.text(st.characters(exclude_categories=("Cs",)), max_size=6)
VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=6),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
                      max_leaves=12)


@given(VALUES)
@settings(max_examples=200, deadline=None)
def test_json_without_a_key_written_twice_reads_as_python_reads_it(value) -> None:
    text = json.dumps(value)
    assert parse_json(text) == json.loads(text)
    assert parse_json(text.encode()) == json.loads(text)


@given(st.dictionaries(KEYS, VALUES, min_size=1, max_size=4), st.data())
@settings(max_examples=200, deadline=None)
def test_a_key_written_twice_at_any_depth_is_refused_naming_it(mapping: dict, data) -> None:
    key = data.draw(st.sampled_from(sorted(mapping)))
    doubled = json.dumps(mapping)[:-1] + f", {json.dumps(key)}: 1}}"
    wrapped = data.draw(st.sampled_from(["{}", "[{}]", '{{"a": [1, {}]}}']))
    with pytest.raises(JsonError, match="is written twice in one object") as err:
        parse_json(wrapped.format(doubled))
    assert repr(key) in str(err.value)


@pytest.mark.parametrize("text, words", [
    ('{"a": NaN}', "NaN is not a JSON number"), ('[Infinity]', "Infinity is not a JSON number"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"), ('{"a": 1,\n "b": }', "line 2, column 7"),
    (b'{"a": "\xff"}', "utf-8"), ("1" * 5000, "digits"),
])
def test_json_that_is_no_json_value_is_refused(text, words: str) -> None:
    with pytest.raises(JsonError, match=words):
        parse_json(text)


def test_a_build_record_with_a_key_twice_is_refused() -> None:
    with pytest.raises(ContractError, match="build record: unreadable JSON: key 'variant' is written twice"):
        BuildRecord.from_json('{"variant": "a", "variant": "b"}')


# ---------------------------------------------------------------- the files


def test_a_lock_with_a_key_twice_is_one_line_naming_the_file_and_the_key(tmp_path: Path, cli) -> None:
    images = unlocked_images(tmp_path / "images")
    plan = plan_variant(layout(images), "ng17")
    path = lock_path(images, "ng17")
    write_lock(path, make_lock(plan, {}, 1767225600, packages={"vllm": "0.17.0"}, packages_unresolved=None))
    text = path.read_text()
    path.write_text(text.replace('"source_date_epoch": 1767225600,', '"source_date_epoch": 1767225600,\n'
                                 '  "source_date_epoch": 1,'))
    assert_one_line(cli("--images", str(images), "show", "ng17"), "ng17.lock.json",
                    "key 'source_date_epoch' is written twice")


def test_a_wheel_cache_entry_with_a_key_twice_is_damaged_naming_the_key(tmp_path: Path, cli) -> None:
    key = "e" * 64
    (tmp_path / key).mkdir()
    (tmp_path / key / "entry.json").write_text(f'{{"format": 1, "key": "{key}", "sha256": "a", "sha256": "b"}}')
    proc = cli("wheels", "list", "--wheel-cache", str(tmp_path), check=True)
    assert f"damaged entry {key}: entry.json cannot be read as JSON: key 'sha256' is written twice" in proc.stdout


REPO = "sparkforge/vllm"
RECORD = {"manifests": {f"{REPO}:ng17-0123456789ab": ["sha256:" + "a" * 64]},
          "deploys": {"spark1": [{"tag": f"{REPO}:ng17-0123456789ab", "at": "2026-01-01T00:00:00Z"}]},
          "configs": {f"{REPO}:ng17-0123456789ab": {"head_id": "sha256:" + "b" * 64, "config": "sha256:" + "c" * 64}},
          "blobs": {"sha256:" + "d" * 64: {"zstd": ["sha256:" + "e" * 64, 12]}},
          "deployed": {f"{REPO}:ng17": f"{REPO}:ng17-0123456789ab"}}


def record_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / (REPO.replace("/", "_") + ".json")
    path.write_text(text)
    return path


def test_a_deploy_record_as_sparkforge_writes_it_reads_back(tmp_path: Path) -> None:
    record_file(tmp_path, json.dumps(RECORD))
    assert read_state(tmp_path, REPO) == RECORD


@pytest.mark.parametrize("change, field", [
    (lambda r: r["deploys"]["spark1"].append({"tag": "--format={{.ID}}"}), "deploys.spark1"),
    (lambda r: r["deploys"]["spark1"].append({"tag": f"{REPO}:ng17\n"}), "deploys.spark1"),
    (lambda r: r["blobs"]["sha256:" + "d" * 64].update(zstd=["../../v2/x", 12]), "blobs.sha256:" + "d" * 64),
    (lambda r: r["blobs"]["sha256:" + "d" * 64].update(zstd=["sha256:" + "e" * 64, -1]), "blobs.sha256:"),
    (lambda r: r.update(manifests=[]), "manifests"),
    (lambda r: r.update(deployed={f"{REPO}:ng17": "-H=tcp://elsewhere:2375"}), f"deployed.{REPO}:ng17"),
    (lambda r: r["configs"][f"{REPO}:ng17-0123456789ab"].pop("config"), "configs."),
])
def test_a_deploy_record_that_is_not_what_sparkforge_writes_names_the_entry(tmp_path: Path, change, field) -> None:
    record = json.loads(json.dumps(RECORD))
    change(record)
    path = record_file(tmp_path, json.dumps(record))
    with pytest.raises(DistributeError) as err:
        read_state(tmp_path, REPO)
    assert str(path) in str(err.value) and f": {field}" in str(err.value) and "\n" not in str(err.value)


def test_a_deploy_record_with_a_key_twice_names_the_key(tmp_path: Path) -> None:
    path = record_file(tmp_path, '{"deploys": {}, "deploys": {}}')
    with pytest.raises(DistributeError, match="key 'deploys' is written twice") as err:
        read_state(tmp_path, REPO)
    assert str(path) in str(err.value)


# ---------------------------------------------------------------- a registry's answers


class _Nested(http.server.BaseHTTPRequestHandler):
    body = b""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)


@pytest.mark.parametrize("body, words", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"schemaVersion": 2, "config": {}, "config": {}}', "key 'config' is written twice"),
])
def test_a_manifest_the_reader_refuses_names_the_registry(body: bytes, words: str) -> None:
    handler = type("Handler", (_Nested,), {"body": body})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host = f"127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(RegistryError) as err:
            Client(Endpoint(host, "http")).manifest("team/app", "1.0")
    finally:
        server.shutdown()
        server.server_close()
    assert host in str(err.value) and words in str(err.value), str(err.value)


# ---------------------------------------------------------------- an image's kernel record


SCAN = {"format": 1, "gpus": ["12.1"], "not_needed": [], "without_device_code": 0, "dists": {},
        "extensions": [{"path": "/x/_C.so", "cubins": ["sm_120"], "ptx": ["compute_120f"], "error": None,
                        "coverage": {"12.1": {"kernels": 3, "missing": 0, "examples": [], "only_in": [],
                                              "unread": []}}}]}


def _kernels_problem(kernels: object) -> str | None:
    """What inspect says of an image's kernel record: the contract's line for a field of another type, else
    the check of its GPUs and targets."""
    try:
        record = KernelRecord.from_dict(kernels, "build record", "kernels")
    except ContractError as exc:
        return str(exc)
    return kernels_problem(record)


@pytest.mark.parametrize("change, words", [
    (lambda k: k.update(gpus=["12.10"]), "kernels.gpus[0]: '12.10' is not a compute capability"),
    (lambda k: k.update(gpus="12.1"), "kernels.gpus is a string, not a list"),
    (lambda k: k["extensions"][0].update(cubins=["sm_12.1"]), "kernels.extensions[0].cubins: not a list of targets"),
    (lambda k: k["extensions"][0].update(path=None), "kernels.extensions[0].path is null, not a string"),
    (lambda k: k["extensions"][0]["coverage"]["12.1"].update(missing="3"),
     "kernels.extensions[0].coverage.12.1.missing is a string, not a number"),
    (lambda k: k.update(extensions={}), "kernels.extensions is an object, not a list"),
    (lambda k: k.pop("without_device_code"), "kernels: field 'without_device_code' is missing"),
])
def test_an_images_kernel_record_is_checked_where_it_is_read(change, words: str) -> None:
    assert _kernels_problem(SCAN) is None and kernels_problem(None) is None
    record = json.loads(json.dumps(SCAN))
    change(record)
    assert words in (_kernels_problem(record) or ""), _kernels_problem(record)


def test_a_kernel_record_reads_back_as_the_scan_wrote_it() -> None:
    """The record's JSON, as the image writes it, gives the same document again; a format 1 record (no
    relocatable code, no coverage count) reads with those fields' defaults."""
    record = KernelRecord.from_dict(SCAN)
    assert KernelRecord.from_json(record.to_json(indent=2)) == record
    assert record.extensions[0].relocatable == () and record.format == 1


def test_the_shown_kernel_table_reads_every_record_the_check_passes() -> None:
    from sparkforge.cli.views import kernels_table

    assert kernels_table(KernelRecord.from_dict(SCAN)).row_count == 1
