"""zstd's entropy coding (RFC 8878 4): the backward bitstream, FSE tables and Huffman-coded literals.

Stdlib only; zstd.py reads frames and blocks with it. Every table and length it reads is checked
against its input before use, and a ZstdError says what is wrong.
"""

from __future__ import annotations


class ZstdError(ValueError):
    """Input that is not a whole zstd frame this decoder can read, or that decodes past its cap."""


# ------------------------------------------------------------------ bit readers


def highbit(x: int) -> int:
    return x.bit_length() - 1


class Backward:
    """A backward bitstream (RFC 8878 4.1): read from the last byte down, the highest set bit of the
    last byte marks where the stream starts. Bits past its beginning read as zeros, and `left`
    turns negative, so an overrun is seen at the end."""

    def __init__(self, buf: bytes, start: int, end: int) -> None:
        if end <= start or buf[end - 1] == 0:
            raise ZstdError("a bitstream has no start marker")
        self.buf, self.pos = buf, end - 1
        last = buf[end - 1]
        self.n = highbit(last)  # the bits below the marker
        self.acc = last & ((1 << self.n) - 1)
        self.left = (end - 1 - start) * 8 + self.n  # real bits not yet read
        self.start = start

    def fill(self) -> None:
        """Load up to 7 more bytes (zeros past the start) so that at least 56 bits are held."""
        take = min(7, self.pos - self.start)
        if take > 0:
            self.acc = ((self.acc & ((1 << self.n) - 1)) << (8 * take)) | int.from_bytes(
                self.buf[self.pos - take:self.pos], "little")
            self.pos -= take
            self.n += 8 * take
        if self.n < 56:
            self.acc = (self.acc & ((1 << self.n) - 1)) << (56 - self.n)
            self.n = 56

    def read(self, nbits: int) -> int:
        if self.n < nbits:
            self.fill()
        self.n -= nbits
        self.left -= nbits
        return (self.acc >> self.n) & ((1 << nbits) - 1)


# ------------------------------------------------------------------ FSE (RFC 8878 4.1.1)

LL_DEFAULT = (4, 3, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 2, 1, 1, 1, 1, 1,
              -1, -1, -1, -1)
ML_DEFAULT = (1, 4, 3, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
              1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1)
OF_DEFAULT = (1, 1, 1, 1, 1, 1, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1)

# (baseline, extra bits) of each Literals_Length and Match_Length code (RFC 8878 3.1.1.3.2.1.1).
LL_CODES = tuple((i, 0) for i in range(16)) + (
    (16, 1), (18, 1), (20, 1), (22, 1), (24, 2), (28, 2), (32, 3), (40, 3), (48, 4), (64, 6), (128, 7),
    (256, 8), (512, 9), (1024, 10), (2048, 11), (4096, 12), (8192, 13), (16384, 14), (32768, 15), (65536, 16))
ML_CODES = tuple((i + 3, 0) for i in range(32)) + (
    (35, 1), (37, 1), (39, 1), (41, 1), (43, 2), (47, 2), (51, 3), (59, 3), (67, 4), (83, 4), (99, 5), (131, 7),
    (259, 8), (515, 9), (1027, 10), (2051, 11), (4099, 12), (8195, 13), (16387, 14), (32771, 15), (65539, 16))
OF_MAX_CODE = 31
LL_MAX_LOG, ML_MAX_LOG, OF_MAX_LOG, HUF_WEIGHT_MAX_LOG = 9, 9, 8, 6

# A decoding table: per state, (symbol, bits to read, baseline of the next state).
Table = list[tuple[int, int, int]]


def fse_table(probs: tuple[int, ...] | list[int], log: int) -> Table:
    """The FSE decoding table of a normalized distribution (RFC 8878 4.1.1)."""
    size = 1 << log
    symbols = [0] * size
    high = size - 1
    for s, p in enumerate(probs):
        if p == -1:
            symbols[high] = s
            high -= 1
    pos, step, mask = 0, (size >> 1) + (size >> 3) + 3, size - 1
    for s, p in enumerate(probs):
        for _ in range(p if p > 0 else 0):
            symbols[pos] = s
            pos = (pos + step) & mask
            while pos > high:
                pos = (pos + step) & mask
    if pos != 0:
        raise ZstdError("an FSE distribution does not fill its table")
    following = [1 if p == -1 else p for p in probs]
    table: Table = []
    for s in symbols:
        state = following[s]
        following[s] += 1
        nbits = log - highbit(state)
        table.append((s, nbits, (state << nbits) - size))
    return table


def read_fse_header(buf: bytes, pos: int, end: int, max_symbol: int, max_log: int) -> tuple[Table, int]:
    """An FSE table description at buf[pos:end]: (the table, where the description ends)."""
    if pos >= end:
        raise ZstdError("an FSE table description is cut short")
    window = int.from_bytes(buf[pos:min(end, pos + 64)], "little")  # at most 256 symbols * 10 bits: < 64 B
    avail = 8 * min(end - pos, 64)
    bit = 0

    def bits(n: int) -> int:
        nonlocal bit
        if bit + n > avail:
            raise ZstdError("an FSE table description is cut short")
        v = (window >> bit) & ((1 << n) - 1)
        bit += n
        return v

    log = bits(4) + 5
    if log > max_log:
        raise ZstdError(f"an FSE table's accuracy log {log} exceeds {max_log}")
    remaining, threshold, nbits = (1 << log) + 1, 1 << log, log + 1
    probs: list[int] = []
    while remaining > 1:
        if len(probs) > max_symbol:
            raise ZstdError("an FSE table has too many symbols")
        peek_max = (2 * threshold - 1) - remaining
        if bit + nbits - 1 > avail:
            raise ZstdError("an FSE table description is cut short")
        low = (window >> bit) & (threshold - 1)
        if low < peek_max:
            count = low
            bit += nbits - 1
        else:
            count = bits(nbits)
            if count >= threshold:
                count -= peek_max
        prob = count - 1
        probs.append(prob)
        remaining -= abs(prob)
        if remaining < 1:
            raise ZstdError("an FSE table's probabilities exceed its size")
        if prob == 0:
            while True:
                repeat = bits(2)
                probs += [0] * repeat
                if repeat != 3:
                    break
            if len(probs) > max_symbol + 1:
                raise ZstdError("an FSE table has too many symbols")
        while remaining < threshold:
            nbits -= 1
            threshold >>= 1
    if remaining != 1 or len(probs) > max_symbol + 1:
        raise ZstdError("an FSE table's probabilities do not add up")
    return fse_table(probs, log), pos + (bit + 7) // 8


# ------------------------------------------------------------------ Huffman literals (RFC 8878 4.2)


def _huffman_weights(buf: bytes, pos: int, end: int) -> tuple[list[int], int]:
    """The weights of a Huffman tree description at buf[pos:end] (without the last, implied one)."""
    if pos >= end:
        raise ZstdError("a Huffman tree description is cut short")
    header = buf[pos]
    pos += 1
    if header >= 128:
        count = header - 127
        stop = pos + (count + 1) // 2
        if stop > end:
            raise ZstdError("a Huffman tree description is cut short")
        weights = []
        for i in range(count):
            byte = buf[pos + i // 2]
            weights.append(byte >> 4 if i % 2 == 0 else byte & 15)
        return weights, stop
    stop = pos + header
    if header == 0 or stop > end:
        raise ZstdError("a Huffman tree description is cut short")
    table, start = read_fse_header(buf, pos, stop, 255, HUF_WEIGHT_MAX_LOG)
    stream = Backward(buf, start, stop)
    log = highbit(len(table))
    states = [stream.read(log), stream.read(log)]
    weights = []
    turn = 0
    while len(weights) < 255:
        sym, nbits, base = table[states[turn]]
        weights.append(sym)
        states[turn] = base + stream.read(nbits)
        if stream.left < 0:
            weights.append(table[states[1 - turn]][0])
            break
        turn = 1 - turn
    else:
        raise ZstdError("a Huffman tree has too many weights")
    return weights, stop


def huffman_table(buf: bytes, pos: int, end: int) -> tuple[list[int], int, int]:
    """A Huffman decoding table from its tree description: (per peeked value, symbol | bits << 8;
    the maximum code length; where the description ends)."""
    weights, stop = _huffman_weights(buf, pos, end)
    if any(w > 11 for w in weights):
        raise ZstdError("a Huffman weight exceeds 11")
    total = sum(1 << (w - 1) for w in weights if w)
    if total == 0:
        raise ZstdError("a Huffman tree has no symbol")
    max_bits = highbit(total) + 1
    rest = (1 << max_bits) - total
    if rest & (rest - 1) or max_bits > 11:
        raise ZstdError("a Huffman tree is not complete")
    weights.append(highbit(rest) + 1)
    if len(weights) > 256:
        raise ZstdError("a Huffman tree has too many symbols")
    table = [0] * (1 << max_bits)
    at = 0
    for w in range(1, max_bits + 1):
        for sym, weight in enumerate(weights):
            if weight == w:
                span = 1 << (w - 1)
                table[at:at + span] = [sym | (max_bits + 1 - w) << 8] * span
                at += span
    return table, max_bits, stop


def huffman_stream(buf: bytes, start: int, end: int, count: int, table: list[int], max_bits: int,
                    out: bytearray) -> None:
    """Decode count literals from one Huffman stream buf[start:end] into out."""
    stream = Backward(buf, start, end)
    acc, n, pos, left = stream.acc, stream.n, stream.pos, stream.left
    mask = (1 << max_bits) - 1
    symbols = bytearray(count)
    for i in range(count):
        if n < max_bits:
            take = min(7, pos - start)
            if take > 0:
                acc = ((acc & ((1 << n) - 1)) << (8 * take)) | int.from_bytes(buf[pos - take:pos], "little")
                pos -= take
                n += 8 * take
            if n < max_bits:
                acc <<= max_bits - n
                n = max_bits
        e = table[(acc >> (n - max_bits)) & mask]
        nbits = e >> 8
        n -= nbits
        left -= nbits
        symbols[i] = e & 0xFF
    if left != 0:
        raise ZstdError("a Huffman stream does not end where its literals do")
    out += symbols
