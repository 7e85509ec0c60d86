"""ImageRef: one parse and one format of [REGISTRY[:PORT]/]REPOSITORY[:TAG][@DIGEST]."""

from __future__ import annotations

import pytest

from sparkforge.imageref import ImageRef

DIGEST = "sha256:" + "ab" * 32

CASES = [
    # text, repository, tag, digest, registry, path
    ("sparkforge/vllm:ng17e", "sparkforge/vllm", "ng17e", None, None, "sparkforge/vllm"),
    ("debian", "debian", None, None, None, "debian"),
    ("debian:bookworm", "debian", "bookworm", None, None, "debian"),
    ("127.0.0.1:5000/sparkforge/vllm:ng17e-0123456789ab", "127.0.0.1:5000/sparkforge/vllm", "ng17e-0123456789ab",
     None, "127.0.0.1:5000", "sparkforge/vllm"),
    ("127.0.0.1:5000/sparkforge/vllm", "127.0.0.1:5000/sparkforge/vllm", None, None, "127.0.0.1:5000",
     "sparkforge/vllm"),
    ("localhost/base", "localhost/base", None, None, "localhost", "base"),
    ("localhost:5000/base:1", "localhost:5000/base", "1", None, "localhost:5000", "base"),
    ("nvcr.io/nvidia/pytorch:25.09-py3", "nvcr.io/nvidia/pytorch", "25.09-py3", None, "nvcr.io", "nvidia/pytorch"),
    (f"nvcr.io/nvidia/pytorch:25.09-py3@{DIGEST}", "nvcr.io/nvidia/pytorch", "25.09-py3", DIGEST, "nvcr.io",
     "nvidia/pytorch"),
    (f"reg.example:443/team/img@{DIGEST}", "reg.example:443/team/img", None, DIGEST, "reg.example:443", "team/img"),
    ("[::1]:5000/img:v1", "[::1]:5000/img", "v1", None, "[::1]:5000", "img"),
    ("user/img", "user/img", None, None, None, "user/img"),
]


@pytest.mark.parametrize("text,repository,tag,digest,registry,path", CASES, ids=[c[0] for c in CASES])
def test_parse_and_format(text, repository, tag, digest, registry, path):
    ref = ImageRef.parse(text)
    assert (ref.repository, ref.tag, ref.digest) == (repository, tag, digest)
    assert (ref.registry, ref.path) == (registry, path)
    assert str(ref) == text  # formatting gives back what was parsed
    assert ImageRef.parse(str(ref)) == ref


def test_a_port_colon_is_not_a_tag_colon():
    ref = ImageRef.parse("127.0.0.1:5000/vllm")
    assert ref.tag is None and ref.repository == "127.0.0.1:5000/vllm"


def test_name_and_with_tag():
    ref = ImageRef.parse(f"127.0.0.1:5000/sparkforge/vllm:ng17e@{DIGEST}")
    assert ref.name == "127.0.0.1:5000/sparkforge/vllm:ng17e"
    assert str(ref.with_tag("ng17")) == f"127.0.0.1:5000/sparkforge/vllm:ng17@{DIGEST}"
    assert str(ref.with_tag(None)) == f"127.0.0.1:5000/sparkforge/vllm@{DIGEST}"


def test_a_bare_colon_or_at_is_kept_empty_for_the_validators():
    """`repo:` and `repo@` keep an empty tag and digest, so a caller's pattern refuses (or ignores) them."""
    assert ImageRef.parse("repo:") == ImageRef("repo", "", None)
    assert ImageRef.parse("repo:tag@") == ImageRef("repo", "tag", "")
