#!/usr/bin/python3
"""GEMM efficiency by size from NVIDIA's measured GEMM tables (ai-dynamo/aiconfigurator's
systems/data/<gpu>/gemm/<framework>/<version>/gemm_perf.parquet: latency in ms of one GEMM
per (gemm_dtype, m, n, k)), the source of the presets' fp8_gemm_speedup and of the curve
shape checks in docs/MEASUREMENTS.md.

Usage: scripts/gemm-tables.py a100=A100.parquet h100=H100.parquet b200=B200.parquet
       scripts/gemm-tables.py --schema FILE.parquet
Get a file with: git -C <aiconfigurator mirror> show HEAD:aic-core/src/aiconfigurator_core/
systems/data/h100_sxm/gemm/trtllm/1.3.0rc20/gemm_perf.parquet > H100.parquet

For each GPU: per half-decade of FLOPs (2 m n k), for shapes with m, n, k >= 512 and again
with m, n, k >= 2048, the 16-bit GEMMs' efficiency (quartiles, against the dense bf16 peak),
its median over the median at 10^12, and where the table has per-tensor fp8 ("fp8") the
median fp8 over bf16 throughput on the same shapes. Needs the zstandard module (Debian's
python3-zstandard; run with /usr/bin/python3). Its own Parquet reader: flat schemas, Thrift
compact metadata, ZSTD/GZIP/SNAPPY/uncompressed pages, PLAIN and dictionary encodings; every
column's value count is checked against the file's row count.
"""
import math
import struct
import sys
import zlib

# ---------------------------------------------------------------- thrift compact
class TReader:
    def __init__(self, buf, pos=0):
        self.buf = buf
        self.pos = pos

    def byte(self):
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def varint(self):
        shift = 0
        result = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            if not (b & 0x80):
                return result
            shift += 7

    def zigzag(self):
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def read_value(self, t):
        if t == 1:
            return True
        if t == 2:
            return False
        if t == 3:
            b = self.byte()
            return b - 256 if b > 127 else b
        if t in (4, 5, 6):
            return self.zigzag()
        if t == 7:
            v = struct.unpack_from('<d', self.buf, self.pos)[0]
            self.pos += 8
            return v
        if t == 8:
            n = self.varint()
            v = bytes(self.buf[self.pos:self.pos + n])
            self.pos += n
            return v
        if t in (9, 10):
            h = self.byte()
            size = h >> 4
            et = h & 0x0F
            if size == 15:
                size = self.varint()
            out = []
            for _ in range(size):
                if et in (1, 2):  # bool inside a list: one byte
                    out.append(self.byte() == 1)
                else:
                    out.append(self.read_value(et))
            return out
        if t == 11:
            size = self.varint()
            if size == 0:
                return {}
            kv = self.byte()
            kt, vt = kv >> 4, kv & 0x0F
            d = {}
            for _ in range(size):
                k = self.read_value(kt)
                d[k] = self.read_value(vt)
            return d
        if t == 12:
            return self.read_struct()
        raise ValueError('unknown thrift compact type %d at %d' % (t, self.pos))

    def read_struct(self):
        fields = {}
        last = 0
        while True:
            h = self.byte()
            if h == 0:
                return fields
            delta = h >> 4
            t = h & 0x0F
            if delta == 0:
                fid = self.zigzag()
            else:
                fid = last + delta
            last = fid
            fields[fid] = self.read_value(t)


# ---------------------------------------------------------------- codecs
def snappy_decompress(data):
    r = TReader(data)
    n = r.varint()
    out = bytearray()
    p = r.pos
    while p < len(data):
        tag = data[p]
        p += 1
        kind = tag & 3
        if kind == 0:
            ln = tag >> 2
            if ln >= 60:
                nb = ln - 59
                ln = int.from_bytes(data[p:p + nb], 'little')
                p += nb
            ln += 1
            out += data[p:p + ln]
            p += ln
            continue
        if kind == 1:
            ln = ((tag >> 2) & 7) + 4
            off = ((tag >> 5) << 8) | data[p]
            p += 1
        elif kind == 2:
            ln = (tag >> 2) + 1
            off = int.from_bytes(data[p:p + 2], 'little')
            p += 2
        else:
            ln = (tag >> 2) + 1
            off = int.from_bytes(data[p:p + 4], 'little')
            p += 4
        start = len(out) - off
        for i in range(ln):
            out.append(out[start + i])
    assert len(out) == n
    return bytes(out)


def decompress(codec, data, usize):
    if codec == 0:
        return bytes(data)
    if codec == 1:
        return snappy_decompress(bytes(data))
    if codec == 2:
        return zlib.decompress(bytes(data), 31)
    if codec == 6:
        import zstandard
        return zstandard.ZstdDecompressor().decompress(bytes(data), max_output_size=usize)
    raise NotImplementedError('codec %d' % codec)


# ---------------------------------------------------------------- encodings
def rle_hybrid(buf, pos, end, bw, count):
    """Decode `count` values of RLE/bit-packed hybrid from buf[pos:end]."""
    out = []
    bytew = (bw + 7) // 8
    r = TReader(buf, pos)
    while len(out) < count and r.pos < end:
        h = r.varint()
        if h & 1:
            groups = h >> 1
            nbytes = groups * bw
            chunk = int.from_bytes(buf[r.pos:r.pos + nbytes], 'little')
            r.pos += nbytes
            mask = (1 << bw) - 1
            for i in range(groups * 8):
                out.append((chunk >> (i * bw)) & mask if bw else 0)
        else:
            run = h >> 1
            v = int.from_bytes(buf[r.pos:r.pos + bytew], 'little') if bytew else 0
            r.pos += bytew
            out.extend([v] * run)
    return out[:count]


def plain_decode(buf, pos, ptype, n, type_length=None):
    if ptype == 1:
        return list(struct.unpack_from('<%di' % n, buf, pos))
    if ptype == 2:
        return list(struct.unpack_from('<%dq' % n, buf, pos))
    if ptype == 4:
        return list(struct.unpack_from('<%df' % n, buf, pos))
    if ptype == 5:
        return list(struct.unpack_from('<%dd' % n, buf, pos))
    if ptype == 6:
        out = []
        for _ in range(n):
            ln = struct.unpack_from('<I', buf, pos)[0]
            pos += 4
            out.append(bytes(buf[pos:pos + ln]))
            pos += ln
        return out
    if ptype == 7:
        out = []
        for _ in range(n):
            out.append(bytes(buf[pos:pos + type_length]))
            pos += type_length
        return out
    if ptype == 0:
        return [bool((buf[pos + i // 8] >> (i % 8)) & 1) for i in range(n)]
    raise NotImplementedError('physical type %d' % ptype)


TYPE_NAMES = {0: 'BOOLEAN', 1: 'INT32', 2: 'INT64', 3: 'INT96', 4: 'FLOAT',
              5: 'DOUBLE', 6: 'BYTE_ARRAY', 7: 'FIXED_LEN_BYTE_ARRAY'}
CODEC_NAMES = {0: 'UNCOMPRESSED', 1: 'SNAPPY', 2: 'GZIP', 3: 'LZO', 4: 'BROTLI',
               5: 'LZ4', 6: 'ZSTD', 7: 'LZ4_RAW'}
ENC_NAMES = {0: 'PLAIN', 2: 'PLAIN_DICTIONARY', 3: 'RLE', 4: 'BIT_PACKED',
             5: 'DELTA_BINARY_PACKED', 6: 'DELTA_LENGTH_BYTE_ARRAY',
             7: 'DELTA_BYTE_ARRAY', 8: 'RLE_DICTIONARY', 9: 'BYTE_STREAM_SPLIT'}
REP_NAMES = {0: 'REQUIRED', 1: 'OPTIONAL', 2: 'REPEATED'}


def decode_values(buf, pos, end, enc, ptype, n, dictionary, type_length):
    if enc == 0:
        return plain_decode(buf, pos, ptype, n, type_length)
    if enc in (2, 8):
        bw = buf[pos]
        idx = rle_hybrid(buf, pos + 1, end, bw, n)
        return [dictionary[i] for i in idx]
    if enc == 3 and ptype == 0:
        ln = struct.unpack_from('<I', buf, pos)[0]
        return [bool(v) for v in rle_hybrid(buf, pos + 4, pos + 4 + ln, 1, n)]
    raise NotImplementedError('encoding %s' % ENC_NAMES.get(enc, enc))


# ---------------------------------------------------------------- file
class ParquetFile:
    def __init__(self, path):
        with open(path, 'rb') as f:
            self.data = f.read()
        d = self.data
        assert d[:4] == b'PAR1' and d[-4:] == b'PAR1', 'not a parquet file'
        mlen = struct.unpack_from('<I', d, len(d) - 8)[0]
        mstart = len(d) - 8 - mlen
        self.meta = TReader(d, mstart).read_struct()
        self.num_rows = self.meta[3]
        self.created_by = self.meta.get(6, b'').decode(errors='replace')
        schema = self.meta[2]
        root = schema[0]
        self.columns = []  # (name, ptype, repetition, converted, logical, type_length)
        for el in schema[1:]:
            if el.get(5):
                raise NotImplementedError('nested schema not supported')
            self.columns.append(dict(name=el[4].decode(), ptype=el.get(1),
                                     rep=el.get(3, 0), converted=el.get(6),
                                     logical=el.get(10), type_length=el.get(2)))
        assert root.get(5) == len(self.columns)
        self.row_groups = self.meta.get(4, [])

    def schema_str(self):
        lines = []
        for c in self.columns:
            lines.append('  %-28s %-12s %-9s converted=%s logical=%s' % (
                c['name'], TYPE_NAMES.get(c['ptype']), REP_NAMES[c['rep']],
                c['converted'], c['logical']))
        return '\n'.join(lines)

    def read_column_chunk(self, ci, cc, col):
        md = cc[3]
        codec = md[4]
        num_values = md[5]
        ptype = md[1]
        assert ptype == col['ptype']
        max_def = 1 if col['rep'] == 1 else 0
        start = md.get(11) if md.get(11) is not None else md[9]
        if md.get(11) is not None and md[9] < start:
            start = md[9]
        end = start + md[7]
        pos = start
        dictionary = None
        out = []
        d = self.data
        encs = set()
        while len(out) < num_values and pos < end:
            r = TReader(d, pos)
            ph = r.read_struct()
            pos = r.pos
            ptype_page = ph[1]
            usize, csize = ph[2], ph[3]
            raw = d[pos:pos + csize]
            pos += csize
            if ptype_page == 2:  # dictionary
                dh = ph[7]
                buf = decompress(codec, raw, usize)
                encs.add('DICT:' + ENC_NAMES.get(dh.get(2, 0), '?'))
                dictionary = plain_decode(buf, 0, ptype, dh[1], col['type_length'])
            elif ptype_page == 0:  # data page v1
                dh = ph[5]
                n = dh[1]
                enc = dh[2]
                encs.add(ENC_NAMES.get(enc, str(enc)))
                buf = decompress(codec, raw, usize)
                p = 0
                defs = None
                if max_def:
                    ln = struct.unpack_from('<I', buf, p)[0]
                    defs = rle_hybrid(buf, p + 4, p + 4 + ln, 1, n)
                    p += 4 + ln
                nn = n if defs is None else sum(defs)
                vals = decode_values(buf, p, len(buf), enc, ptype, nn, dictionary,
                                     col['type_length'])
                out.extend(self._merge(vals, defs, n))
            elif ptype_page == 3:  # data page v2
                dh = ph[8]
                n = dh[1]
                enc = dh[4]
                encs.add(ENC_NAMES.get(enc, str(enc)) + '(v2)')
                dl = dh.get(5, 0)
                rl = dh.get(6, 0)
                is_comp = dh.get(7, True)
                defs = None
                if max_def:
                    defs = rle_hybrid(raw, rl, rl + dl, 1, n)
                body = raw[rl + dl:]
                buf = decompress(codec, body, usize - rl - dl) if is_comp else bytes(body)
                nn = n if defs is None else sum(defs)
                vals = decode_values(buf, 0, len(buf), enc, ptype, nn, dictionary,
                                     col['type_length'])
                out.extend(self._merge(vals, defs, n))
            else:
                pass  # index page: skip
        assert len(out) == num_values, (col['name'], len(out), num_values)
        return out, CODEC_NAMES.get(codec), encs

    @staticmethod
    def _merge(vals, defs, n):
        if defs is None:
            return vals
        it = iter(vals)
        return [next(it) if dv else None for dv in defs]

    def read(self, verbose=False):
        cols = {c['name']: [] for c in self.columns}
        info = {}
        for rg in self.row_groups:
            ccs = rg[1]
            assert len(ccs) == len(self.columns)
            for ci, (cc, col) in enumerate(zip(ccs, self.columns)):
                vals, codec, encs = self.read_column_chunk(ci, cc, col)
                if col['ptype'] == 6 and (col['converted'] == 0 or
                                         (col['logical'] and 1 in col['logical'])):
                    vals = [v.decode() if v is not None else None for v in vals]
                cols[col['name']].extend(vals)
                i = info.setdefault(col['name'], [set(), set()])
                i[0].add(codec)
                i[1] |= encs
        self.info = info
        return cols


PEAK_BF16 = {"a100": 312e12, "h100": 989.4e12, "h200": 989.4e12, "b200": 2250e12}


def quantile(v, p):
    v = sorted(v)
    if not v:
        return float("nan")
    x = (len(v) - 1) * p
    i = int(x)
    return v[i] if i + 1 >= len(v) else v[i] + (x - i) * (v[i + 1] - v[i])


def half_decade(flops):
    return round(2 * math.log10(flops)) / 2


def tables(gpu, path):
    pf = ParquetFile(path)
    cols = pf.read()
    for name, vals in cols.items():
        assert len(vals) == pf.num_rows, (name, len(vals), pf.num_rows)
    by_dtype = {}
    for dt, m, n, k, lat in zip(cols["gemm_dtype"], cols["m"], cols["n"], cols["k"], cols["latency"]):
        by_dtype.setdefault(dt, {})[(m, n, k)] = lat
    b16 = by_dtype.get("bfloat16") or by_dtype.get("float16")
    f8 = by_dtype.get("fp8")
    print("%s: %s, %d rows (every column's count checked), dtypes %s" %
          (gpu, path, pf.num_rows, ", ".join("%s %d" % (d, len(v)) for d, v in sorted(by_dtype.items()))))
    for title, least in (("m, n, k >= 512", 512), ("m, n, k >= 2048", 2048)):
        eff, ratio = {}, {}
        for s, lat in b16.items():
            if min(s) < least:
                continue
            flops = 2.0 * s[0] * s[1] * s[2]
            b = half_decade(flops)
            eff.setdefault(b, []).append(flops / (lat * 1e-3) / PEAK_BF16[gpu])
            if f8 and s in f8:
                ratio.setdefault(b, []).append(lat / f8[s])
        ref = quantile(eff.get(12.0, []), 0.5)
        print("  %s\n  %8s %6s %20s %8s %s" % (title, "log10 F", "n", "bf16 eff q25/med/q75", "/@1e12",
                                               "fp8/bf16 median" if f8 else ""))
        for b in sorted(eff):
            v = eff[b]
            line = "  %8.1f %6d %6.3f/%.3f/%.3f %8.2f" % (b, len(v), quantile(v, .25), quantile(v, .5),
                                                          quantile(v, .75), quantile(v, .5) / ref)
            if f8 and ratio.get(b):
                line += "  %6.2f" % quantile(ratio[b], .5)
            print(line)


def schema(path):
    pf = ParquetFile(path)
    print("%s: %d rows, %s\n%s" % (path, pf.num_rows, pf.created_by, pf.schema_str()))


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    if args[0] == "--schema":
        for p in args[1:]:
            schema(p)
    else:
        for a in args:
            gpu, _, path = a.partition("=")
            if gpu not in PEAK_BF16 or not path:
                sys.exit("expected GPU=FILE with GPU one of %s, got %r" % (", ".join(PEAK_BF16), a))
            tables(gpu, path)
