// A minimal protobuf reader and writer for the few ONNX messages the runner touches (ModelProto's graph and
// metadata, GraphProto's initializers and inputs, TensorProto). Everything else passes through as raw bytes,
// so a model is rewritten without a schema and without loss. Field numbers: onnx/onnx.proto3.

const WIRE_VARINT = 0, WIRE_I64 = 1, WIRE_LEN = 2, WIRE_I32 = 5;
const utf8 = new TextDecoder(), utf8enc = new TextEncoder();

// ONNX TensorProto.DataType -> [ort.Tensor type, TypedArray, numpy dtype.str]
export const DTYPES = {
  1: ["float32", Float32Array, "<f4"], 2: ["uint8", Uint8Array, "|u1"], 3: ["int8", Int8Array, "|i1"],
  4: ["uint16", Uint16Array, "<u2"], 5: ["int16", Int16Array, "<i2"], 6: ["int32", Int32Array, "<i4"],
  7: ["int64", BigInt64Array, "<i8"], 9: ["bool", Uint8Array, "|b1"], 11: ["float64", Float64Array, "<f8"],
  12: ["uint32", Uint32Array, "<u4"], 13: ["uint64", BigUint64Array, "<u8"],
};
export const ONNX_TYPE = Object.fromEntries(Object.entries(DTYPES).map(([k, v]) => [v[0], Number(k)]));

/** Reads a varint at `pos`; returns [value as a Number or BigInt when above 2^53, next position]. */
function varint(buf, pos) {
  let lo = 0, shift = 0, b;
  do {  // NOTE: the first 28 bits as a Number, the rest as a BigInt when present (int64 dims and values)
    b = buf[pos++];
    if (shift < 28) lo |= (b & 0x7f) << shift;
    else return bigVarint(buf, pos - 1, BigInt(lo >>> 0), shift);
    shift += 7;
  } while (b & 0x80);
  return [lo >>> 0, pos];
}

function bigVarint(buf, pos, value, shift) {
  let b, s = BigInt(shift);
  do {
    b = buf[pos++];
    value |= BigInt(b & 0x7f) << s;
    s += 7n;
  } while (b & 0x80);
  const signed = BigInt.asIntN(64, value);
  return [Number.isSafeInteger(Number(signed)) ? Number(signed) : signed, pos];
}

/** The top-level fields of one message: [{field, wire, value (Number|Uint8Array), start, end}] in order. */
export function fields(buf) {
  const out = [];
  let pos = 0;
  while (pos < buf.length) {
    const start = pos;
    let key;
    [key, pos] = varint(buf, pos);
    const field = key >>> 3, wire = key & 7;
    let value;
    if (wire === WIRE_VARINT) [value, pos] = varint(buf, pos);
    else if (wire === WIRE_I64) { value = buf.subarray(pos, pos + 8); pos += 8; }
    else if (wire === WIRE_I32) { value = buf.subarray(pos, pos + 4); pos += 4; }
    else if (wire === WIRE_LEN) {
      let n;
      [n, pos] = varint(buf, pos);
      value = buf.subarray(pos, pos + n);
      pos += n;
    } else throw new Error(`protobuf: wire type ${wire} at byte ${start} is not supported (a corrupt file?)`);
    if (pos > buf.length) throw new Error(`protobuf: a field at byte ${start} runs past the end (a truncated file?)`);
    out.push({ field, wire, value, start, end: pos });
  }
  return out;
}

export const text = (bytes) => utf8.decode(bytes);

/** Packed or repeated varints of `field` in `fs`, as Numbers (or BigInts beyond 2^53). */
export function ints(fs, field) {
  const out = [];
  for (const f of fs) {
    if (f.field !== field) continue;
    if (f.wire === WIRE_VARINT) out.push(f.value);
    else for (let pos = 0; pos < f.value.length;) { let v; [v, pos] = varint(f.value, pos); out.push(v); }
  }
  return out;
}

export const first = (fs, field) => fs.find((f) => f.field === field)?.value;

function encodeVarint(value, out) {
  let v = BigInt.asUintN(64, BigInt(value));
  while (v >= 0x80n) { out.push(Number(v & 0x7fn) | 0x80); v >>= 7n; }
  out.push(Number(v));
}

/** One length-delimited field: key, length, bytes. */
export function lenField(field, bytes) {
  const head = [];
  encodeVarint((field << 3) | WIRE_LEN, head);
  encodeVarint(bytes.length, head);
  return concat([Uint8Array.from(head), bytes]);
}

export function varintField(field, value) {
  const out = [];
  encodeVarint((field << 3) | WIRE_VARINT, out);
  encodeVarint(value, out);
  return Uint8Array.from(out);
}

export function concat(parts) {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let pos = 0;
  for (const p of parts) { out.set(p, pos); pos += p.length; }
  return out;
}

/** The bytes of field `f` as read (key included), to copy a field unchanged. */
export const raw = (buf, f) => buf.subarray(f.start, f.end);

// -- ONNX messages -----------------------------------------------------------------------------------------
// ModelProto: 7 graph, 14 metadata_props (StringStringEntryProto: 1 key, 2 value).
// GraphProto: 5 initializer, 11 input, 12 output. ValueInfoProto: 1 name, 2 type. TypeProto: 1 tensor_type
// (1 elem_type, 2 shape: 1 dim (1 dim_value, 2 dim_param)). TensorProto: 1 dims, 2 data_type, 4 float_data,
// 5 int32_data, 7 int64_data, 8 name, 9 raw_data, 10 double_data, 11 uint64_data, 13 external_data,
// 14 data_location.

export function metadata(model) {
  const props = {};
  for (const f of fields(model)) {
    if (f.field !== 14) continue;
    const e = fields(f.value);
    props[text(first(e, 1) ?? new Uint8Array())] = text(first(e, 2) ?? new Uint8Array());
  }
  return props;
}

/** A ValueInfoProto's name, element type and dims (a Number, a name, or null per axis; null: no shape). */
export function valueInfo(bytes) {
  const fs = fields(bytes), type = first(fs, 2);
  const tensor = type && first(fields(type), 1);
  const tfs = tensor ? fields(tensor) : [];
  const shape = first(tfs, 2);
  const dims = shape === undefined ? null : fields(shape).filter((f) => f.field === 1).map((d) => {
    const dfs = fields(d.value), value = first(dfs, 1), param = first(dfs, 2);
    return value !== undefined ? Number(value) : param !== undefined ? text(param) : null;
  });
  return { name: text(first(fs, 1) ?? new Uint8Array()), elemType: first(tfs, 1) ?? 0, dims };
}

/** A ValueInfoProto of a tensor; `dims` as `valueInfo` gives them (a Number, a name, or null: unknown). */
export function encodeValueInfo(name, elemType, dims) {
  const dimBytes = dims.map((d) => lenField(1, typeof d === "number" ? varintField(1, d)
    : d === null ? new Uint8Array() : lenField(2, utf8enc.encode(d))));
  const tensor = concat([varintField(1, elemType), lenField(2, concat(dimBytes))]);
  return concat([lenField(1, utf8enc.encode(name)), lenField(2, lenField(1, tensor))]);
}

/** A TensorProto as {name, elemType, dims, data (a TypedArray), external ({location, offset, length}|null)}. */
export function tensor(bytes) {
  const fs = fields(bytes);
  const elemType = first(fs, 2) ?? 0;
  const entry = DTYPES[elemType];
  if (!entry) throw new Error(`tensor: ONNX data type ${elemType} is not supported by the onnxopt runner`);
  const [, Typed] = entry;
  const dims = ints(fs, 1).map(Number);
  const count = dims.reduce((a, b) => a * b, 1);
  const name = text(first(fs, 8) ?? new Uint8Array());
  let data, external = null;
  const rawData = first(fs, 9);
  if (first(fs, 14) === 1) {
    external = {};
    for (const f of fs.filter((g) => g.field === 13)) {
      const e = fields(f.value);
      external[text(first(e, 1))] = text(first(e, 2));
    }
    external.offset = Number(external.offset ?? 0);
    external.length = external.length === undefined ? count * Typed.BYTES_PER_ELEMENT : Number(external.length);
  } else if (rawData !== undefined) {
    data = new Typed(count);
    new Uint8Array(data.buffer).set(rawData);  // NOTE: copied: raw_data is rarely aligned for a typed view
  } else if (elemType === 1) {
    const packed = first(fs, 4) ?? new Uint8Array();  // NOTE: float_data, packed (proto3's default)
    data = new Float32Array(packed.slice().buffer, 0, count);
  } else if (elemType === 11) {
    data = new Float64Array((first(fs, 10) ?? new Uint8Array()).slice().buffer, 0, count);
  } else if (elemType === 7) {
    data = BigInt64Array.from(ints(fs, 7), (v) => BigInt(v));
  } else if (elemType === 13) {
    data = BigUint64Array.from(ints(fs, 11), (v) => BigInt.asUintN(64, BigInt(v)));
  } else {
    data = Typed.from(ints(fs, 5));  // NOTE: int32_data holds every type of 32 bits or fewer
  }
  return { name, elemType, dims, data, external };
}

export function encodeTensor(name, elemType, dims, data) {
  const bytes = new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  return concat([...dims.map((d) => varintField(1, d)), varintField(2, elemType),
    lenField(8, utf8enc.encode(name)), lenField(9, bytes)]);
}

/** Rebuilds `model` with `graph(graphBytes) -> graphBytes` applied to its graph and `keep(f)` on its fields. */
export function rewriteModel(model, graph, keep = () => true) {
  const parts = [];
  for (const f of fields(model)) {
    if (f.field === 7) parts.push(lenField(7, graph(f.value)));
    else if (keep(f)) parts.push(raw(model, f));
  }
  return concat(parts);
}
