"""A Zstandard decoder (RFC 8878), stdlib only: CUDA 13 compresses fat-binary entries with zstd.

Python has no zstd in its standard library before 3.14 (`compression.zstd`), and the image's Python
may be 3.10. This decoder reads frames block by block, and each block is checked against what is
left of the output cap before a byte of it is kept, so a frame that claims or holds more than the cap
stops with ZstdError as soon as it passes it; every length, offset and table it reads is checked
against the input first. It does not verify the optional content checksum (nvcc 13.0 writes
none) and refuses frames that need a dictionary (nvcc uses none).

It decodes nvcc's cubins at 5 to 19 MB/s of output per CPU-second on a shared 2-core machine
(libzstd: 100 to 900 MB/s); the kernel check decodes only the entries it needs (README).
"""

from __future__ import annotations

from typing import Iterator

from .entropy import (LL_CODES, LL_DEFAULT, LL_MAX_LOG, ML_CODES, ML_DEFAULT, ML_MAX_LOG, OF_DEFAULT, OF_MAX_CODE,
                      OF_MAX_LOG, Backward, Table, ZstdError, fse_table, highbit, huffman_stream, huffman_table,
                      read_fse_header)

__all__ = ["BLOCK_MAX", "MAGIC", "ZstdError", "blocks", "decompress"]

MAGIC = 0xFD2FB528
SKIPPABLE_MASK, SKIPPABLE = 0xFFFFFFF0, 0x184D2A50
BLOCK_MAX = 128 * 1024  # RFC 8878 3.1.1.2.3: Block_Maximum_Size is at most 128 KiB


# ------------------------------------------------------------------ frames and blocks


class _Frame:
    """What a frame's blocks share: the history, the repeat offsets and the tables to repeat."""

    def __init__(self, cap: int) -> None:
        self.out = bytearray()
        self.cap = cap
        self.reps = [1, 4, 8]
        self.huffman: tuple[list[int], int] | None = None
        self.tables: list[Table | None] = [None, None, None]  # LL, OF, ML

    def room(self, size: int) -> None:
        if len(self.out) + size > self.cap:
            raise ZstdError(f"it decodes to more than its limit of {self.cap} bytes")


def _literals(frame: _Frame, buf: bytes, pos: int, end: int) -> tuple[bytes, int]:
    """A compressed block's literals section at buf[pos:end]: (the literals, where it ends)."""
    b0 = buf[pos]
    kind, size_format = b0 & 3, (b0 >> 2) & 3
    if kind in (0, 1):  # raw or RLE
        if pos + (1, 2, 1, 3)[size_format] > end:
            raise ZstdError("a block's literals header is cut short")
        if size_format in (0, 2):
            size, pos = b0 >> 3, pos + 1
        elif size_format == 1:
            size, pos = (b0 >> 4) + (buf[pos + 1] << 4), pos + 2
        else:
            size, pos = (b0 >> 4) + (buf[pos + 1] << 4) + (buf[pos + 2] << 12), pos + 3
        if size > BLOCK_MAX:
            raise ZstdError("a block's literals exceed 128 KiB")
        if kind == 0:
            if pos + size > end:
                raise ZstdError("a block's literals are cut short")
            return bytes(buf[pos:pos + size]), pos + size
        if pos >= end:
            raise ZstdError("a block's literals are cut short")
        return bytes([buf[pos]]) * size, pos + 1
    width = {0: 3, 1: 3, 2: 4, 3: 5}[size_format]
    if pos + width > end:
        raise ZstdError("a block's literals header is cut short")
    header = int.from_bytes(buf[pos:pos + width], "little")
    bits = {3: 10, 4: 14, 5: 18}[width]
    size = (header >> 4) & ((1 << bits) - 1)
    packed = (header >> (4 + bits)) & ((1 << bits) - 1)
    streams = 1 if size_format == 0 else 4
    pos += width
    stop = pos + packed
    if size > BLOCK_MAX or stop > end:
        raise ZstdError("a block's literals are cut short or too large")
    if kind == 2:
        table, max_bits, pos = huffman_table(buf, pos, stop)
        frame.huffman = (table, max_bits)
    elif frame.huffman is None:
        raise ZstdError("a block repeats a Huffman table that no earlier block gave")
    table, max_bits = frame.huffman
    out = bytearray()
    if streams == 1:
        huffman_stream(buf, pos, stop, size, table, max_bits, out)
        return bytes(out), stop
    if pos + 6 > stop:
        raise ZstdError("a block's literal streams are cut short")
    sizes = [int.from_bytes(buf[pos + 2 * i:pos + 2 * i + 2], "little") for i in range(3)]
    pos += 6
    each = (size + 3) // 4
    if 3 * each > size:
        raise ZstdError("a block's literals are too few for four streams")
    counts = [each, each, each, size - 3 * each]
    sizes.append(stop - pos - sum(sizes))
    if sizes[3] <= 0:
        raise ZstdError("a block's literal streams are cut short")
    for count, length in zip(counts, sizes):
        huffman_stream(buf, pos, pos + length, count, table, max_bits, out)
        pos += length
    return bytes(out), stop


def _sequence_tables(frame: _Frame, buf: bytes, pos: int, end: int) -> int:
    """The three tables a block's sequences use (literal lengths, offsets, match lengths)."""
    if pos >= end:
        raise ZstdError("a block's sequence modes are cut short")
    modes = buf[pos]
    pos += 1
    if modes & 3:
        raise ZstdError("a block's sequence modes use reserved bits")
    setups = ((modes >> 6, LL_DEFAULT, 6, 35, LL_MAX_LOG), (modes >> 4 & 3, OF_DEFAULT, 5, OF_MAX_CODE, OF_MAX_LOG),
              (modes >> 2 & 3, ML_DEFAULT, 6, 52, ML_MAX_LOG))
    for i, (mode, default, default_log, max_symbol, max_log) in enumerate(setups):
        if mode == 0:
            frame.tables[i] = _DEFAULT_TABLES[i]
        elif mode == 1:
            if pos >= end:
                raise ZstdError("a block's sequence tables are cut short")
            if buf[pos] > max_symbol:
                raise ZstdError("a block's RLE sequence symbol is out of range")
            frame.tables[i] = [(buf[pos], 0, 0)]
            pos += 1
        elif mode == 2:
            frame.tables[i], pos = read_fse_header(buf, pos, end, max_symbol, max_log)
        elif frame.tables[i] is None:
            raise ZstdError("a block repeats a sequence table that no earlier block gave")
    return pos


_DEFAULT_TABLES: list[Table | None] = [fse_table(LL_DEFAULT, 6), fse_table(OF_DEFAULT, 5), fse_table(ML_DEFAULT, 6)]


def _sequences(frame: _Frame, buf: bytes, pos: int, end: int, literals: bytes) -> None:
    """Decode a block's sequences at buf[pos:end] and execute them into the frame's output."""
    b0 = buf[pos] if pos < end else -1
    if b0 < 0:
        raise ZstdError("a block's sequence count is cut short")
    if b0 < 128:
        count, pos = b0, pos + 1
    elif b0 < 255:
        if pos + 2 > end:
            raise ZstdError("a block's sequence count is cut short")
        count, pos = ((b0 - 128) << 8) + buf[pos + 1], pos + 2
    else:
        if pos + 3 > end:
            raise ZstdError("a block's sequence count is cut short")
        count, pos = buf[pos + 1] + (buf[pos + 2] << 8) + 0x7F00, pos + 3
    out = frame.out
    if count == 0:
        if pos != end:
            raise ZstdError("a block without sequences has bytes after its literals")
        frame.room(len(literals))
        out += literals
        return
    pos = _sequence_tables(frame, buf, pos, end)
    ll_table, of_table, ml_table = frame.tables
    assert ll_table is not None and of_table is not None and ml_table is not None
    stream = Backward(buf, pos, end)
    ll_state = stream.read(highbit(len(ll_table)))
    of_state = stream.read(highbit(len(of_table)))
    ml_state = stream.read(highbit(len(ml_table)))
    reps = frame.reps
    lit = 0
    nlit = len(literals)
    limit = min(len(out) + BLOCK_MAX, frame.cap)
    # The bitstream read inline (the hot loop): acc holds n bits, the next ones at its top; zeros
    # are added past the stream's start, and `padded` counts them to find an overrun at the end.
    acc, n, at, low = stream.acc, stream.n, stream.pos, stream.start
    padded = (at - low) * 8 + n - stream.left
    for i in range(count):
        while n < 96:  # a sequence reads at most 31 + 16 + 16 + 9 + 9 + 8 bits
            take = min(7, at - low)
            if take > 0:
                acc = ((acc & ((1 << n) - 1)) << (8 * take)) | int.from_bytes(buf[at - take:at], "little")
                at -= take
                n += 8 * take
            else:
                acc = (acc & ((1 << n) - 1)) << 56
                n += 56
                padded += 56
        of_code = of_table[of_state][0]
        ml_code = ml_table[ml_state][0]
        ll_code = ll_table[ll_state][0]
        if of_code > OF_MAX_CODE or ml_code > 52 or ll_code > 35:
            raise ZstdError("a sequence code is out of range")
        if of_code:
            n -= of_code
            value = (1 << of_code) + ((acc >> n) & ((1 << of_code) - 1))
        else:
            value = 1
        ml, extra = ML_CODES[ml_code]
        if extra:
            n -= extra
            ml += (acc >> n) & ((1 << extra) - 1)
        ll, extra = LL_CODES[ll_code]
        if extra:
            n -= extra
            ll += (acc >> n) & ((1 << extra) - 1)
        if value > 3:
            offset = value - 3
            reps[2], reps[1], reps[0] = reps[1], reps[0], offset
        else:
            index = value - 1 + (ll == 0)
            if index == 0:
                offset = reps[0]
            elif index == 3:
                offset = reps[0] - 1
                reps[2], reps[1], reps[0] = reps[1], reps[0], offset
            else:
                offset = reps[index]
                if index == 2:
                    reps[2] = reps[1]
                reps[1], reps[0] = reps[0], offset
        if i + 1 < count:
            _, nbits, base = ll_table[ll_state]
            n -= nbits
            ll_state = base + ((acc >> n) & ((1 << nbits) - 1))
            _, nbits, base = ml_table[ml_state]
            n -= nbits
            ml_state = base + ((acc >> n) & ((1 << nbits) - 1))
            _, nbits, base = of_table[of_state]
            n -= nbits
            of_state = base + ((acc >> n) & ((1 << nbits) - 1))
        if lit + ll > nlit:
            raise ZstdError("a sequence takes more literals than its block has")
        size = len(out)
        if size + ll + ml > limit:
            frame.room(ll + ml)
            raise ZstdError("a block decodes to more than 128 KiB")
        if ll:
            out += literals[lit:lit + ll]
            lit += ll
            size += ll
        start = size - offset
        if offset <= 0 or start < 0:
            raise ZstdError("a sequence refers to bytes before the start of its frame")
        if offset >= ml:
            out += out[start:start + ml]
        else:
            out += (out[start:] * (ml // offset + 1))[:ml]
    if (at - low) * 8 + n - padded != 0:
        raise ZstdError("a block's sequences do not end where its bitstream does")
    rest = nlit - lit
    if len(out) + rest > limit:
        frame.room(rest)
        raise ZstdError("a block decodes to more than 128 KiB")
    out += literals[lit:]


def _frame_header(buf: bytes, pos: int, end: int) -> tuple[int | None, bool, int]:
    """(content size or None, whether a checksum follows, where the blocks start)."""
    if pos + 1 > end:
        raise ZstdError("a frame header is cut short")
    fhd = buf[pos]
    pos += 1
    fcs_flag, single, checksum, dict_flag = fhd >> 6, bool(fhd & 0x20), bool(fhd & 4), fhd & 3
    if fhd & 8:
        raise ZstdError("a frame header sets its reserved bit")
    pos += 0 if single else 1  # the window descriptor: the output cap bounds the history instead
    dict_size = (0, 1, 2, 4)[dict_flag]
    fcs_size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if pos + dict_size + fcs_size > end:
        raise ZstdError("a frame header is cut short")
    if dict_size and int.from_bytes(buf[pos:pos + dict_size], "little"):
        raise ZstdError("a frame needs a dictionary")
    pos += dict_size
    size = int.from_bytes(buf[pos:pos + fcs_size], "little") + (256 if fcs_size == 2 else 0) if fcs_size else None
    return size, checksum, pos + fcs_size


def blocks(src: bytes, cap: int) -> Iterator[bytes]:
    """Decode src (zstd frames, skippable frames between them) and yield the output a block at a
    time. Raises ZstdError for input that is not whole, and once the output would pass cap bytes."""
    buf = bytes(src)
    pos, end, total = 0, len(buf), 0
    if end == 0:
        raise ZstdError("no zstd frame")
    while pos < end:
        if pos + 4 > end:
            raise ZstdError("a frame's magic number is cut short")
        magic = int.from_bytes(buf[pos:pos + 4], "little")
        pos += 4
        if magic & SKIPPABLE_MASK == SKIPPABLE:
            if pos + 4 > end:
                raise ZstdError("a skippable frame is cut short")
            pos += 4 + int.from_bytes(buf[pos:pos + 4], "little")
            if pos > end:
                raise ZstdError("a skippable frame is cut short")
            continue
        if magic != MAGIC:
            raise ZstdError("not a zstd frame (bad magic number)")
        size, checksum, pos = _frame_header(buf, pos, end)
        if size is not None and total + size > cap:
            raise ZstdError(f"a frame says it decodes to {size} bytes, past the limit of {cap}")
        frame = _Frame(cap - total)
        last = False
        while not last:
            if pos + 3 > end:
                raise ZstdError("a block header is cut short")
            header = int.from_bytes(buf[pos:pos + 3], "little")
            pos += 3
            last, kind, size_field = bool(header & 1), (header >> 1) & 3, header >> 3
            before = len(frame.out)
            if kind == 3:
                raise ZstdError("a block of the reserved type")
            if size_field > BLOCK_MAX:
                raise ZstdError("a block exceeds 128 KiB")
            if kind == 1:  # RLE: one byte, repeated
                if pos + 1 > end:
                    raise ZstdError("a block is cut short")
                frame.room(size_field)
                frame.out += bytes([buf[pos]]) * size_field
                pos += 1
            else:
                if pos + size_field > end:
                    raise ZstdError("a block is cut short")
                if kind == 0:
                    frame.room(size_field)
                    frame.out += buf[pos:pos + size_field]
                elif size_field == 0:
                    raise ZstdError("an empty compressed block")
                else:
                    try:
                        literals, at = _literals(frame, buf, pos, pos + size_field)
                        _sequences(frame, buf, at, pos + size_field, literals)
                    except IndexError:  # every read is checked first; this is the net under those checks
                        raise ZstdError("a compressed block is malformed") from None
                pos += size_field
            yield bytes(frame.out[before:])
        if size is not None and len(frame.out) != size:
            raise ZstdError(f"a frame decodes to {len(frame.out)} bytes, not the {size} its header says")
        if checksum:
            if pos + 4 > end:
                raise ZstdError("a frame's checksum is cut short")
            pos += 4
        total += len(frame.out)


def decompress(src: bytes, cap: int) -> bytes:
    """The whole output of src's zstd frames; ZstdError past cap bytes or for input not whole."""
    return b"".join(blocks(src, cap))
