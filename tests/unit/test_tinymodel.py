"""The tiny model: the same seed gives the same bytes, the weights file and tokenizer are well formed, and
make_model never leaves a half-written folder nor overwrites one that is not this model."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

from sparkforge.inimage import tinymodel
from sparkforge.inimage.tinymodel import MODEL_NAME, make_model

FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json"}
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]


def expected_shapes() -> dict[str, list[int]]:
    shapes = {"model.embed_tokens.weight": [512, 256], "model.norm.weight": [256], "lm_head.weight": [512, 256]}
    for i in range(2):
        shapes |= {
            f"model.layers.{i}.self_attn.q_proj.weight": [256, 256],  # 4 heads of 64
            f"model.layers.{i}.self_attn.k_proj.weight": [128, 256],  # 2 key-value heads of 64
            f"model.layers.{i}.self_attn.v_proj.weight": [128, 256],
            f"model.layers.{i}.self_attn.o_proj.weight": [256, 256],
            f"model.layers.{i}.mlp.gate_proj.weight": [512, 256],
            f"model.layers.{i}.mlp.up_proj.weight": [512, 256],
            f"model.layers.{i}.mlp.down_proj.weight": [256, 512],
            f"model.layers.{i}.input_layernorm.weight": [256],
            f"model.layers.{i}.post_attention_layernorm.weight": [256],
        }
    return shapes


def read_folder(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def leftovers(parent: Path, name: str) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.tmp-")]


def split_safetensors(body: bytes) -> tuple[dict[str, Any], bytes, int]:
    (size,) = struct.unpack("<Q", body[:8])
    return json.loads(body[8:8 + size]), body[8 + size:], size


def floats(blob: bytes) -> list[float]:
    """Little-endian bfloat16 values as Python floats (bfloat16 is the upper half of a float32)."""
    halves = struct.unpack(f"<{len(blob) // 2}H", blob)
    return list(struct.unpack(f"<{len(halves)}f", struct.pack(f"<{len(halves)}I", *(h << 16 for h in halves))))


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("made") / "tiny"
    assert make_model(dest) == dest
    return dest


def test_one_seed_gives_byte_identical_folders(made: Path, tmp_path: Path) -> None:
    dest = tmp_path / "again"
    (tmp_path / f".again.tmp-{os.getpid()}").mkdir()  # what a run of this process id killed outright left
    (tmp_path / f".again.tmp-{os.getpid()}" / "config.json").write_text("{}")
    assert make_model(dest, seed=0) == dest
    first, second = read_folder(made), read_folder(dest)
    assert set(first) == FILES
    assert first == second
    assert leftovers(tmp_path, "again") == []


def test_another_seed_changes_the_weights_and_nothing_else(made: Path, tmp_path: Path) -> None:
    other = read_folder(make_model(tmp_path / "seed1", seed=1))
    first = read_folder(made)
    assert {n: b for n, b in other.items() if n != "model.safetensors"} == \
           {n: b for n, b in first.items() if n != "model.safetensors"}
    header1, data1, _ = split_safetensors(other["model.safetensors"])
    header0, data0, _ = split_safetensors(first["model.safetensors"])
    assert header1 == header0
    for name, entry in header0.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        if name.endswith("norm.weight"):
            assert data1[start:end] == data0[start:end]
        else:
            assert data1[start:end] != data0[start:end], name


def test_the_safetensors_header_covers_the_data_exactly(made: Path) -> None:
    body = (made / "model.safetensors").read_bytes()
    header, data, size = split_safetensors(body)
    assert size % 8 == 0 and body[8:8 + size].rstrip(b" ").endswith(b"}")
    assert header.pop("__metadata__") == {"format": "pt"}
    assert {name: entry["shape"] for name, entry in header.items()} == expected_shapes()
    # Laid out in sorted-name order, each tensor right after the one before, the last ending at the file's end.
    offset = 0
    for name in sorted(header):
        entry = header[name]
        assert entry["dtype"] == "BF16"
        assert entry["data_offsets"] == [offset, offset + 2 * math.prod(entry["shape"])], name
        offset = entry["data_offsets"][1]
    assert offset == len(data)
    for name, entry in header.items():
        values = floats(data[entry["data_offsets"][0]:entry["data_offsets"][1]])
        if name.endswith("norm.weight"):
            assert set(values) == {1.0}, name
        else:
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
            assert abs(mean) < 0.002 and 0.018 < std < 0.022, (name, mean, std)


def test_the_tokenizer_covers_every_id_of_the_model_once(made: Path) -> None:
    tok = json.loads((made / "tokenizer.json").read_text("utf-8"))
    config = json.loads((made / "config.json").read_text("utf-8"))
    vocab: dict[str, int] = tok["model"]["vocab"]
    added = {entry["content"]: entry["id"] for entry in tok["added_tokens"]}
    ids = sorted([*vocab.values(), *added.values()])
    assert ids == list(range(512)) == list(range(config["vocab_size"]))
    assert len(vocab) + len(added) == 512 and not set(vocab) & set(added)
    assert added == {token: 508 + i for i, token in enumerate(SPECIALS)}
    assert all(entry["special"] and not entry["normalized"] for entry in tok["added_tokens"])
    assert sorted(vocab, key=vocab.__getitem__)[:256] == tinymodel.byte_chars()
    assert len(set(tinymodel.byte_chars())) == 256
    merges = tok["model"]["merges"]
    assert len(merges) >= 252 and len({tuple(m) for m in merges}) == len(merges)
    for left, right in merges:
        assert left in vocab and right in vocab and left + right in vocab, (left, right)
    assert tok["model"]["type"] == "BPE" and tok["pre_tokenizer"]["type"] == tok["decoder"]["type"] == "ByteLevel"
    assert tok["pre_tokenizer"]["add_prefix_space"] is False
    assert config["bos_token_id"] == added["<|begin_of_text|>"] and config["eos_token_id"] == added["<|end_of_text|>"]
    assert config["_name_or_path"] == MODEL_NAME and config["model_type"] == "llama"
    assert config["head_dim"] * config["num_attention_heads"] == config["hidden_size"] == 256
    tok_config = json.loads((made / "tokenizer_config.json").read_text("utf-8"))
    assert (tok_config["bos_token"], tok_config["eos_token"]) == (SPECIALS[0], SPECIALS[1])
    assert "add_generation_prompt" in tok_config["chat_template"]
    for name in FILES - {"model.safetensors"}:  # stable bytes: sorted keys, two spaces, a trailing newline
        text = (made / name).read_text("utf-8")
        assert text == json.dumps(json.loads(text), sort_keys=True, indent=2, ensure_ascii=False) + "\n", name


def test_the_merges_encode_the_training_words_they_came_from() -> None:
    vocab, merges = tinymodel.train_bpe("low lower lowest low low", 256 + 3)
    chars = tinymodel.byte_chars()
    assert merges[:3] == [("l", "o"), ("lo", "w"), (chars[ord(" ")], "low")]
    assert vocab[256:] == ["lo", "low", chars[ord(" ")] + "low"]


def test_a_folder_with_other_content_is_refused_and_left_alone(made: Path, tmp_path: Path) -> None:
    cases = {"other": {"notes.txt": b"mine"}, "changed": read_folder(made), "extra": read_folder(made)}
    cases["changed"]["config.json"] = cases["changed"]["config.json"].replace(b"512", b"513", 1)
    cases["extra"]["README"] = b"x"
    for name, files in cases.items():
        dest = tmp_path / name
        dest.mkdir()
        for file, body in files.items():
            (dest / file).write_bytes(body)
        with pytest.raises(FileExistsError) as caught:
            make_model(dest)
        assert caught.value.errno == errno.EEXIST and caught.value.filename == str(dest)
        assert "is not this model" in str(caught.value)
        assert read_folder(dest) == files
        assert leftovers(tmp_path, name) == []
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(FileExistsError):
        make_model(tmp_path / "file")
    assert (tmp_path / "file").read_bytes() == b"x"


def test_a_link_at_dest_is_refused_even_to_this_model(made: Path, tmp_path: Path) -> None:
    before = read_folder(made)
    (tmp_path / "link").symlink_to(made, target_is_directory=True)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for name in ("link", "dangling"):
        with pytest.raises(FileExistsError):
            make_model(tmp_path / name)
        assert (tmp_path / name).is_symlink()
    assert not (tmp_path / "nowhere").exists()
    assert read_folder(made) == before
    copy = tmp_path / "copy"
    shutil.copytree(made, copy)
    (copy / "config.json").unlink()
    (copy / "config.json").symlink_to(made / "config.json")  # same bytes, but through a link
    with pytest.raises(FileExistsError):
        make_model(copy)


def test_the_same_model_again_is_left_as_it_is(tmp_path: Path) -> None:
    dest = make_model(tmp_path / "tiny", seed=3)
    past = 1_000_000_000
    for path in [*dest.iterdir(), dest]:
        os.utime(path, ns=(past, past))
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in [*dest.iterdir(), dest]}
    assert make_model(dest, seed=3) == dest
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in [*dest.iterdir(), dest]} == before
    with pytest.raises(FileExistsError):
        make_model(dest, seed=4)  # another seed is another model
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in [*dest.iterdir(), dest]} == before


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_a_failure_half_way_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           failure: BaseException) -> None:
    written: list[str] = []
    real = tinymodel.write_file

    def failing(path: Path, body: bytes) -> None:
        if len(written) == 3:
            raise failure
        real(path, body)
        written.append(path.name)

    monkeypatch.setattr(tinymodel, "write_file", failing)
    with pytest.raises(type(failure)):
        make_model(tmp_path / "tiny")
    assert len(written) == 3
    assert list(tmp_path.iterdir()) == []
