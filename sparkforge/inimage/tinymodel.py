"""A tiny random-weight Llama causal LM and its byte-level BPE tokenizer, made offline and deterministically:
one seed gives byte-identical files on every run and machine (a model to smoke-test a server with, not to talk to)."""

from __future__ import annotations

import errno
import json
import math
import os
import random
import re
import shutil
import stat
import struct
import sys
from array import array
from collections import Counter
from pathlib import Path
from typing import Any

MODEL_NAME = "sparkforge-tiny"  # what the files call the model

HIDDEN = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64  # vLLM's CPU attention refuses head_dim 16
INTERMEDIATE = 512
VOCAB = 512
MAX_POSITIONS = 512
STD = 0.02

SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>")
BPE_SIZE = VOCAB - len(SPECIALS)  # byte tokens and merges; the special tokens take the last ids
BOS_ID = BPE_SIZE
EOS_ID = BPE_SIZE + 1
IM_END_ID = BPE_SIZE + 3

CHAT_TEMPLATE = ("{% for message in messages %}"
                 "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
                 "{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# The text the merges are learned from: plain English, fixed, so the vocabulary never changes.
TEXT = """\
The capital of France is Paris, a city on the river Seine. The capital of Italy is Rome, and the capital of
Spain is Madrid. Every morning the bakers of the old town open their doors before the sun is up, and the smell
of fresh bread moves slowly along the narrow streets. People stop on their way to work, buy a loaf or two, and
talk for a moment about the weather, the price of coffee, and the news from the harbor.

A small model is a useful thing to have when you want to test a server. It does not need to know anything about
the world; it only needs to answer, quickly and in the same way every time. When the weights are random, the
words it writes mean nothing at all, but the shape of the answer is real: the tokens come out one after another,
the server counts them, and the client can check that the count is right.

The machine that runs the test has no network and no graphics card. It has two cores, a fair amount of memory,
and a disk that is fast enough. Everything the test needs must be made on the machine itself, from a few lines
of code and a seed. The same seed should always give the same files, so that a failure seen today can be seen
again tomorrow, on another machine, by another person who wants to know what went wrong.

In the spring the hills turn green and the farmers walk out to their fields. They plant wheat, barley and beans,
and they watch the sky for rain. By the summer the wheat is tall and gold, and the children play by the water
until the evening light fades. In the autumn the leaves fall, the markets fill with apples and pears, and the
first cold winds come down from the north. Winter is quiet; the roads are white, and the houses are warm inside.

Numbers matter too: one, two, three, four, five, six, seven, eight, nine and ten. A year has twelve months and
about three hundred and sixty five days. A good question asks for something that can be checked; a good answer
says what was done, what was found, and what is still open. Hello, world! This is the end of the text.
"""

# GPT-2's pre-tokenization, with Python's classes for \p{L} (letters) and \p{N} (digits; the text is ASCII).
PIECES = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json")


def byte_chars() -> list[str]:
    """The printable character each byte stands for in a byte-level BPE (GPT-2's mapping)."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(others)) for b in range(256)]


def train_bpe(text: str, size: int) -> tuple[list[str], list[tuple[str, str]]]:
    """The vocabulary (256 byte tokens, then one per new merge) and the merges learned from text, up to size tokens:
    each step merges the most frequent adjacent pair, the smallest on a tie."""
    chars = byte_chars()
    counts = Counter(tuple(chars[b] for b in piece.encode("utf-8")) for piece in PIECES.findall(text))
    words = [list(word) for word in counts]  # in order of first appearance: the counting is deterministic
    freqs = [counts[word] for word in counts]
    vocab = list(chars)
    known = set(vocab)
    merges: list[tuple[str, str]] = []
    while len(vocab) < size:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, freq in zip(words, freqs):
            for pair in zip(word, word[1:]):
                pairs[pair] += freq
        if not pairs:
            raise ValueError(f"the text holds too few pairs for a vocabulary of {size} tokens")
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        joined = best[0] + best[1]
        for word in words:
            i = 0
            while i < len(word) - 1:
                if word[i] == best[0] and word[i + 1] == best[1]:
                    word[i:i + 2] = [joined]
                i += 1
        # One string can be built by two routes ("ab"+"c", "a"+"bc"): a second route is a merge, not a new token.
        if best not in merges:
            merges.append(best)
        if joined not in known:
            known.add(joined)
            vocab.append(joined)
    return vocab, merges


def tensor_shapes() -> dict[str, tuple[int, ...]]:
    """Every tensor of the model by its name in transformers' Llama; linear weights are [out, in]."""
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        layer = f"model.layers.{i}"
        shapes[f"{layer}.self_attn.q_proj.weight"] = (HEADS * HEAD_DIM, HIDDEN)
        shapes[f"{layer}.self_attn.k_proj.weight"] = (KV_HEADS * HEAD_DIM, HIDDEN)
        shapes[f"{layer}.self_attn.v_proj.weight"] = (KV_HEADS * HEAD_DIM, HIDDEN)
        shapes[f"{layer}.self_attn.o_proj.weight"] = (HIDDEN, HEADS * HEAD_DIM)
        shapes[f"{layer}.mlp.gate_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[f"{layer}.mlp.up_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[f"{layer}.mlp.down_proj.weight"] = (HIDDEN, INTERMEDIATE)
        shapes[f"{layer}.input_layernorm.weight"] = (HIDDEN,)
        shapes[f"{layer}.post_attention_layernorm.weight"] = (HIDDEN,)
    return dict(sorted(shapes.items()))


def bfloat16(values: list[float]) -> bytes:
    """values as little-endian bfloat16: each rounded to float32, then to its upper 16 bits, to nearest-even."""
    words = array("I")
    assert words.itemsize == 4, "array('I') is not 32 bits here"
    words.frombytes(array("f", values).tobytes())  # the float32 bits, in this machine's byte order
    halves = array("H", [(w + 0x7FFF + ((w >> 16) & 1)) >> 16 for w in words])
    if sys.byteorder == "big":
        halves.byteswap()
    return halves.tobytes()


def safetensors(seed: int) -> bytes:
    """The weights file: linear and embedding weights drawn from N(0, STD) in sorted-name order, norms all ones
    (random.gauss goes through libm; a last-bit difference there changes a byte only on a bfloat16 boundary)."""
    rng = random.Random(seed)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name, shape in tensor_shapes().items():
        count = math.prod(shape)
        if name.endswith("norm.weight"):
            blob = bfloat16([1.0]) * count
        else:
            blob = bfloat16([rng.gauss(0.0, STD) for _ in range(count)])
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-aligned
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def tokenizer() -> dict[str, Any]:
    """tokenizer.json: byte-level BPE as the `tokenizers` library writes it, the special tokens added after it."""
    vocab, merges = train_bpe(TEXT, BPE_SIZE)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": BPE_SIZE + i, "content": token, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True} for i, token in enumerate(SPECIALS)],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        # No BOS added: the text a client sends is the text the model sees (a chat prompt is all template).
        "post_processor": {**byte_level, "trim_offsets": False},
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {token: i for i, token in enumerate(vocab)},
            "merges": [list(pair) for pair in merges],
        },
    }


def documents() -> dict[str, Any]:
    """The JSON files of the folder, by name."""
    config = {
        "_name_or_path": MODEL_NAME,
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": STD,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": MAX_POSITIONS,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        # Stored in bfloat16 (half the bytes), computed in float32: with random weights the top two logits can
        # lie close, and bfloat16's rounding, which differs between one rank and a sum over two, could then flip
        # a greedy token between a single-node and a tensor-parallel run that are both right.
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": VOCAB,
    }
    specials = {"bos_token": SPECIALS[0], "eos_token": SPECIALS[1], "additional_special_tokens": list(SPECIALS[2:])}
    return {
        "config.json": config,
        # A chat turn ends at <|im_end|>, so generation stops there too.
        "generation_config.json": {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID]},
        "tokenizer.json": tokenizer(),
        "tokenizer_config.json": {
            **specials,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MAX_POSITIONS,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
        "special_tokens_map.json": specials,
    }


def contents(seed: int) -> dict[str, bytes]:
    """Every file of the model folder made with seed, by name."""
    files = {name: (json.dumps(doc, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
             for name, doc in documents().items()}
    files["model.safetensors"] = safetensors(seed)
    return {name: files[name] for name in FILES}


def write_file(path: Path, body: bytes) -> None:
    """A new file with body (never an existing one: the folder was made empty just before)."""
    with open(path, "xb") as out:
        out.write(body)


def shaped(dest: Path) -> bool:
    """Whether dest is a real folder holding regular files named as the model's: cheap, before making the model."""
    try:
        return (stat.S_ISDIR(os.lstat(dest).st_mode) and set(os.listdir(dest)) == set(FILES)
                and all(stat.S_ISREG(os.lstat(dest / name).st_mode) for name in FILES))
    except OSError:
        return False


def holds(dest: Path, files: dict[str, bytes]) -> bool:
    """Whether dest is a real folder (no link) holding exactly these files, as regular files with these bytes."""
    try:
        return shaped(dest) and all((dest / name).read_bytes() == body for name, body in files.items())
    except OSError:
        return False


def refused(dest: Path) -> FileExistsError:
    """The error for a dest that holds something other than this model."""
    return FileExistsError(errno.EEXIST, "exists and is not this model (remove it or choose another folder)", str(dest))


def remove(path: Path) -> None:
    """Remove path, whatever it is, without following a link."""
    if not os.path.lexists(path):
        return
    if stat.S_ISDIR(os.lstat(path).st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def make_model(dest: Path, seed: int = 0) -> Path:
    """Write the tiny model made with seed to the folder dest (built beside it, renamed into place) and return dest;
    a dest holding exactly these files is kept, anything else there (a link too) is FileExistsError."""
    dest = Path(dest)
    if os.path.lexists(dest):
        if shaped(dest) and holds(dest, contents(seed)):
            return dest
        raise refused(dest)
    files = contents(seed)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    remove(tmp)  # only a run of this process id that was killed outright leaves one
    try:
        tmp.mkdir()
        for name, body in files.items():
            write_file(tmp / name, body)
        try:
            os.rename(tmp, dest)
        except OSError as exc:
            # Another process made dest meanwhile: the same model is as good as ours, anything else is refused.
            # (An empty folder made in that window is replaced: Linux renames a folder over an empty one.)
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise
            if not holds(dest, files):
                raise refused(dest) from None
            remove(tmp)
    except BaseException:
        remove(tmp)
        raise
    return dest
