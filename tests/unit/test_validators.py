"""Validators match in full: a valid value with a line break, or a path that leaves its tree, is refused."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from sparkforge.recipe import fields, schema
from sparkforge.recipe.config import field_path
from sparkforge.recipe.schema import ModFile, ModVerify
from sparkforge.recipe.planner import parse_image_ref
from sparkforge.errors import ConfigError

# Every pattern-validated type of fields.py, with the pattern its valid values come from.
TYPES = {
    "Name": (fields.Name, fields.NAME_RE),
    "Commit": (fields.Commit, fields.COMMIT_RE),
    "Digest": (fields.Digest, fields.DIGEST_RE),
    "GitRef": (fields.GitRef, fields.REF_RE),
    "GitUrl": (fields.GitUrl, fields.URL_RE),
    "Repository": (fields.Repository, fields.REPOSITORY_RE),
    "ImageTag": (fields.ImageTag, fields.TAG_RE),
    "Package": (fields.Package, fields.PKG_RE),
    "EnvName": (fields.EnvName, fields.ENV_NAME_RE),
    "EnvValue": (fields.EnvValue, fields.ENV_VALUE_RE),
    "ArchList": (fields.ArchList, fields.ARCH_LIST_RE),
    "Gpu": (fields.Gpu, fields.GPU_RE),
    "Extension": (fields.Extension, fields.EXTENSION_RE),
    "AbsPath": (fields.AbsPath, fields.ABS_PATH_RE),
    "RelPath": (fields.RelPath, fields.REL_PATH_RE),
    "ModPath": (fields.ModPath, fields.REL_PATH_RE),
    "OsPackage": (fields.OsPackage, fields.OS_PKG_RE),
    "PatchUrl": (fields.PatchUrl, fields.PATCH_URL_RE),
    "FileUrl": (fields.FileUrl, fields.FILE_URL_RE),
    "PullRequest": (fields.PullRequest, fields.PR_RE),
    "Sha256": (fields.Sha256, fields.SHA256_RE),
    "Distribution": (fields.Distribution, fields.DIST_RE),
    "PythonVersion": (fields.PythonVersion, fields.PYTHON_VERSION_RE),
    "WheelPlatform": (fields.WheelPlatform, fields.WHEEL_PLATFORM_RE),
    "Module": (fields.Module, fields.MODULE_RE),
    # Not every string of PEP 440's characters is a version: generate versions pip would accept.
    "PipVersion": (fields.PipVersion, re.compile(r"[0-9]{1,3}(\.[0-9]{1,3}){0,3}((a|b|rc)[0-9]{1,2})?"
                                                 r"(\.post[0-9])?(\.dev[0-9]{1,3})?(\+[a-z0-9]{1,5})?")),
}

BREAKS = ("\n", "\r\n", "\r", "\x00", "\t", " ")


# What the validators refuse on top of their patterns, as documented: a path segment that is '.' or '..'
# (docs/guarantees.md, "Bad input"), an image repository longer than Docker allows, and a URL's host that no
# resolver reads as written (over 253 characters; digits and dots that are no IPv4 address).
MAX_LENGTH = {"Repository": fields.MAX_REPOSITORY}


def host_ok(host: str) -> bool:
    if len(host) > 253:
        return False
    numeric = all(part.isdigit() for part in host.split("."))
    return not numeric or (host.count(".") == 3 and all(p == str(int(p)) and int(p) <= 255 for p in host.split(".")))


def valid_values(name: str) -> st.SearchStrategy[str]:
    """Strings of the type's pattern, less what the validators are documented to refuse on top of it.
    Chosen without asking the validator, so that a validator refusing a valid value fails the test."""
    pattern = TYPES[name][1]
    limit = MAX_LENGTH.get(name)

    def documented(value: str) -> bool:
        if limit is not None and len(value) > limit:
            return False
        m = pattern.fullmatch(value)
        if m is not None and "host" in m.groupdict() and not host_ok(m["host"]):
            return False
        return not any(seg in (".", "..") for seg in value.replace("#", "/").split("/"))

    return st.from_regex(pattern, fullmatch=True).filter(documented)


@pytest.mark.parametrize("name", sorted(TYPES))
def test_a_valid_value_with_a_break_after_it_is_refused(name: str) -> None:
    adapter = TypeAdapter(TYPES[name][0])

    @settings(max_examples=150, deadline=None)
    @given(valid_values(name), st.sampled_from(BREAKS))
    def check(value: str, brk: str) -> None:
        assert adapter.validate_python(value) == value
        for bad in (value + brk, brk + value):
            with pytest.raises(ValidationError):
                adapter.validate_python(bad)

    check()


def test_every_pattern_is_covered() -> None:
    """A pattern added to fields.py joins the table above, or this fails."""
    patterns = {name for name in dir(fields) if name.endswith("_RE")}
    covered = {name for name in dir(fields) if name.endswith("_RE")
               and any(getattr(fields, name) is p for _, p in TYPES.values())}
    # Used inside other validators, each tested on its own below.
    assert patterns - covered == {"PEP440_CHARS_RE", "MODE_RE"}


def test_every_pattern_is_anchored_at_both_ends() -> None:
    """\\A and \\Z, never ^ and $: `$` also matches before a final newline, for any caller that uses match."""
    for name in dir(fields):
        if name.endswith("_RE"):
            source = getattr(fields, name).pattern
            assert source.startswith("\\A") and source.endswith("\\Z"), name


@pytest.mark.parametrize("value", ["1.0\n", "0.17.0 ", "1.0\t"])
def test_a_version_with_a_break_is_refused(value: str) -> None:
    with pytest.raises(ValidationError):
        TypeAdapter(fields.PipVersion).validate_python(value)


@pytest.mark.parametrize("value", [">=0.16\n", ">=0.16,\n<0.18", "\t>=0.16"])
def test_a_version_range_with_a_break_is_refused(value: str) -> None:
    with pytest.raises(ValidationError):
        TypeAdapter(fields.Specifier).validate_python(value)


@pytest.mark.parametrize("mode", ["0644\n", "644", "0648", "00644"])
def test_a_bad_file_mode_is_refused(mode: str) -> None:
    with pytest.raises(ValidationError):
        ModFile(src="a.py", dest="/opt/a.py", mode=mode)


@pytest.mark.parametrize("value", ["sub/../../x", "../x", "..", "a/..", "a/./b", ".", "a//b", "a/", "/abs",
                                   "a/b/../c", "a\\b", "a b", "a/\n"])
def test_a_relative_path_stays_below_its_root(value: str) -> None:
    with pytest.raises(ValidationError):
        TypeAdapter(fields.RelPath).validate_python(value)


@pytest.mark.parametrize("value", ["sub/x.py", "a", "vllm/model_executor/models/qwen3_next.py", "a/.hidden", "a/b..c"])
def test_a_plain_relative_path_is_accepted(value: str) -> None:
    assert TypeAdapter(fields.RelPath).validate_python(value) == value


@pytest.mark.parametrize("value", ["/opt/../etc/passwd", "//opt", "/opt/", "/", "/opt/./x", "opt/x/../../.."])
def test_absolute_and_mod_paths_have_no_dot_segments(value: str) -> None:
    for kind in (fields.AbsPath, fields.ModPath):
        with pytest.raises(ValidationError):
            TypeAdapter(kind).validate_python(value)


@pytest.mark.parametrize("value", ["../../etc/passwd", "/etc/../etc/passwd", "vllm/../../x"])
def test_a_verify_file_or_a_files_dest_cannot_climb(value: str) -> None:
    with pytest.raises(ValidationError):
        ModVerify(file=value, contains="x")
    with pytest.raises(ValidationError):
        ModFile(src="a.py", dest=value)


@given(st.from_regex(fields.REF_RE, fullmatch=True))
@settings(max_examples=50, deadline=None)
def test_other_modules_using_the_patterns_match_in_full(ref: str) -> None:
    """plan.py checks --base with the same patterns through .match: the anchors hold there too."""
    tag = ref.replace("/", "-")[:100] or "x"
    if not fields.TAG_RE.fullmatch(tag):
        return
    with pytest.raises(ConfigError):
        parse_image_ref(f"example.org/base:{tag}\n")


@pytest.mark.parametrize("loc, data, shown", [
    (("mods", "list[function-after[check(), str]]", 0), {"mods": ["BAD"]}, "mods[0]"),
    (("mods", "ModChanges", "add", 1), {"mods": {"add": ["a", "B"]}}, "mods.add[1]"),
    (("components", "none", "ComponentSpec", "ref"), {"components": {"none": {"ref": "a b"}}}, "components.none.ref"),
    (("env", "1A", "[key]"), {"env": {"1A": "x"}}, "env.1A"),
    (("base", "digest", "Unknown", "unknown"), {"base": {"digest": {}}}, "base.digest.unknown"),
    (("verify", 1, "file"), {"verify": [{}, {"file": "x"}]}, "verify[1].file"),
])
def test_field_paths_read_as_the_user_wrote_them(loc, data, shown) -> None:
    assert field_path(loc, data) == shown


def test_field_paths_without_the_input_drop_the_branches() -> None:
    assert field_path(("mods", "list[function-after[check(), str]]", 0)) == "mods[0]"
    assert field_path(("nodes", "spark-1", "endpoint")) == "nodes.spark-1.endpoint"


# ---------------------------------------------------------------- numbers in their ranges


PORTED = {"GitUrl": "https://h.example:{port}/a.git", "FileUrl": "https://h.example:{port}/w.whl",
          "PatchUrl": "https://h.example:{port}/p.diff", "Repository": "h.example:{port}/sparkforge/vllm"}


@pytest.mark.parametrize("name", sorted(PORTED))
@given(port=st.one_of(st.integers(-10, 200_000).map(str), st.from_regex(r"0[0-9]{1,5}", fullmatch=True),
                      st.just("")))
@settings(max_examples=120, deadline=None)
def test_a_port_is_one_of_1_to_65535_in_its_one_spelling(name: str, port: str) -> None:
    value = PORTED[name].format(port=port)
    adapter = TypeAdapter(TYPES[name][0])
    if port.isdigit() and port == str(int(port)) and 1 <= int(port) <= 65535:
        assert adapter.validate_python(value) == value
    else:
        with pytest.raises(ValidationError):
            adapter.validate_python(value)


@pytest.mark.parametrize("host, ok", [("10.0.0.1", True), ("010.0.0.1", False), ("1.2.3", False), ("256.1.1.1", False),
                                      ("12345", False), ("a." * 126 + "b", True), ("a." * 127 + "b", False),
                                      ("-a.example", False), ("a-.example", False), ("a..example", False),
                                      ("x" * 63 + ".example", True), ("x" * 64 + ".example", False)])
def test_a_url_host_is_a_host_name_or_an_ipv4_address_in_one_spelling(host: str, ok: bool) -> None:
    value = f"https://{host}/a.git"
    if ok:
        assert TypeAdapter(fields.GitUrl).validate_python(value) == value
    else:
        with pytest.raises(ValidationError):
            TypeAdapter(fields.GitUrl).validate_python(value)


# A compute capability as CUDA numbers one, by its parts: major 1-99, minor one digit.
ARCH = st.tuples(st.integers(0, 120), st.integers(0, 12), st.sampled_from(["", "a", "f"]), st.booleans(),
                 st.booleans())


def arch_text(major: int, minor: int, suffix: str, ptx: bool, zero: bool) -> tuple[str, bool]:
    """The arch as written (zero: with a leading zero) and whether it is one nvcc can name (sm_<major><minor>)."""
    text = f"{'0' if zero else ''}{major}.{minor}{suffix}{'+PTX' if ptx else ''}"
    return text, 1 <= major <= 99 and minor <= 9 and not zero


@given(st.lists(ARCH, min_size=1, max_size=4))
@settings(max_examples=150, deadline=None)
def test_an_arch_list_names_only_archs_nvcc_can_name(archs: list) -> None:
    written = [arch_text(*a) for a in archs]
    value = ";".join(text for text, _ in written)
    adapter = TypeAdapter(fields.ArchList)
    if all(ok for _, ok in written):
        assert adapter.validate_python(value) == value
        from sparkforge.recipe.planner import gpus_of  # every GPU it gives is one the gpus field takes
        for gpu in gpus_of(value):
            assert TypeAdapter(fields.Gpu).validate_python(gpu) == gpu
    else:
        with pytest.raises(ValidationError):
            adapter.validate_python(value)


@given(ARCH)
@settings(max_examples=200, deadline=None)
def test_a_gpu_is_a_compute_capability(arch: tuple) -> None:
    major, minor, _, _, zero = arch
    text, ok = arch_text(major, minor, "", False, zero)
    if ok:
        assert TypeAdapter(fields.Gpu).validate_python(text) == text
    else:
        with pytest.raises(ValidationError):
            TypeAdapter(fields.Gpu).validate_python(text)


# ---------------------------------------------------------------- values that cannot be right


@pytest.mark.parametrize("check", [{"file": "a.py", "contains": ""}, {"file": "a.py", "contains": "  "},
                                   {"python": ""}, {"python": "x", "needs": ["torch\n"]},
                                   {"python": "x", "needs": [""]}, {"python": "x", "needs": [".rel"]}])
def test_a_verify_check_that_cannot_fail_or_cannot_run_is_refused(check: dict) -> None:
    with pytest.raises(ValidationError):
        ModVerify(**check)


def test_a_verify_check_may_need_a_dotted_module() -> None:
    assert ModVerify(python="x", needs=["torch", "vllm.platforms"]).needs == ["torch", "vllm.platforms"]


@pytest.mark.parametrize("field, values, words", [
    ("protect", ["torch", "torch"], "'torch' is listed twice"),
    ("protect", ["torch", "Torch"], "'torch' and 'Torch' name one package"),
    ("protect", ["flash_attn", "flash-attn"], "name one package"),
    ("os_packages", ["ccache", "ccache=4.8"], "name one package"),
])
def test_a_package_listed_twice_under_any_spelling_is_refused(field: str, values: list, words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        schema.RecipeFile.model_validate({field: values})
