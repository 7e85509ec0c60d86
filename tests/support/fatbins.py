"""Helpers of the fat-binary reader's tests: the reader as in an image without liblz4 and libzstd, and
damaged copies of real binaries read in a child process under a memory and a CPU limit."""

from __future__ import annotations

import contextlib
import json
import random
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any
from collections.abc import Iterator

from sparkforge.inimage import decompress, fatbin
from tests.support.paths import ROOT


@contextlib.contextmanager
def without_libraries() -> Iterator[None]:
    """The decoders as in an image without liblz4 and libzstd."""
    saved = dict(decompress.SYSTEM)
    decompress.SYSTEM.update(lz4=None, zstd=None)
    try:
        yield
    finally:
        decompress.SYSTEM.clear()
        decompress.SYSTEM.update(saved)


def limited(body: str, *, cpu: int, memory: int = 1 << 30) -> subprocess.CompletedProcess[str]:
    """Run body in a child Python that has only the standard library and the in-image package, with
    RLIMIT_DATA (the heap; the mapped library does not count) and RLIMIT_CPU set."""
    script = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_DATA, ({memory}, {memory}))\n"
        f"resource.setrlimit(resource.RLIMIT_CPU, ({cpu}, {cpu}))\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from pathlib import Path\n"
        "from sparkforge.inimage import decompress, fatbin, kernels\n" + body)
    return subprocess.run([sys.executable, "-I", "-B", "-c", script], capture_output=True, text=True,
                          timeout=cpu * 10)


def mutants(sources: list[Path], out: Path, count: int, seed: int) -> list[Path]:
    """Damaged copies of real binaries: cut at random, bytes flipped inside the fat binaries, and
    header fields (sizes, offsets, flags) set to extreme values."""
    rnd = random.Random(seed)
    made = []
    for n in range(count):
        src = sources[n % len(sources)]
        data = bytearray(src.read_bytes())
        regions = [(off, size) for name, _, off, size in fatbin.sections(bytes(data))
                   if name in (fatbin.FATBIN_SECTION, fatbin.RELOCATABLE_SECTION)]
        off, size = rnd.choice(regions)
        how = n % 4
        if how == 0:
            data = data[:rnd.randrange(64, len(data))]
        elif how == 1:
            for _ in range(rnd.randint(1, 8)):
                data[off + rnd.randrange(size)] ^= 1 << rnd.randrange(8)
        elif how == 2:
            at = off + rnd.randrange(0, size - 8) // 8 * 8
            struct.pack_into("<Q", data, at, rnd.choice([0, 1, 2**31, 2**32 - 1, 2**62, 2**64 - 1]))
        else:  # inside a compressed payload: what the decoders see
            opened = fatbin.open_device_code(src)
            assert opened is not None
            with opened as code:
                packed = [e for e in code.entries if e.flags & fatbin.FLAG_COMPRESSED] or code.entries
                entry = rnd.choice(packed)
            for _ in range(rnd.randint(1, 4)):
                data[entry.offset + rnd.randrange(entry.size)] = rnd.randrange(256)
        path = out / f"m{n:04d}-{src.name}"
        path.write_bytes(bytes(data))
        made.append(path)
    return made


FUZZ = """
import json
paths = [Path(p) for p in sys.argv[1:]]
record = kernels.scan(paths, ["8.0", "9.0", "12.0", "12.1"])
checks = kernels.check(record)
print(json.dumps({"record": record.to_dict(), "checks": checks}))
"""


def fuzz(sources: list[Path], tmp_path: Path, count: int, seed: int, cpu: int) -> dict[str, Any]:
    paths = mutants(sources, tmp_path, count, seed)
    script = FUZZ.replace("sys.argv[1:]", repr([str(p) for p in paths]))
    proc = limited(script, cpu=cpu)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == ""
    result: dict[str, Any] = json.loads(proc.stdout)
    errors = [e["error"] for e in result["record"]["extensions"] if e["error"]]
    assert all(error.strip() and "\n" not in error for error in errors)
    assert len(result["checks"]) == len(result["record"]["extensions"]) + 1
    return result
