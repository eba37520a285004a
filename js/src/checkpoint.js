// onnxopt checkpoint files (src/onnxopt/checkpoint.py), both ways: MAGIC, an 8-byte little-endian header
// length, a JSON header ({meta, arrays: [{name, dtype, shape, offset, nbytes}]}), the raw array bytes, then the
// SHA-256 of everything before it. Python's Runner.load_checkpoint reads what writeCheckpoint writes.

import { concat, DTYPES } from "./proto.js";

const MAGIC = new TextEncoder().encode("ONNXOPT-CHECKPOINT-1\n");
const DIGEST = 32;
const BY_NUMPY = Object.fromEntries(Object.values(DTYPES).map(([type, Typed, np]) => [np, [type, Typed]]));
// NOTE: numpy writes "|b1" for bool and "<f4" etc.; a big-endian file would need swapping, which numpy never
// writes on the platforms onnxruntime runs on
const NUMPY = Object.fromEntries(Object.values(DTYPES).map(([type, , np]) => [type, np]));

async function sha256(bytes) {
  const subtle = globalThis.crypto?.subtle;
  if (subtle) return new Uint8Array(await subtle.digest("SHA-256", bytes));
  const { createHash } = await import("node:crypto");  // NOTE: Node without a global WebCrypto (< 19)
  return new Uint8Array(createHash("sha256").update(bytes).digest());
}

/**
 * Serializes `tensors` ({name: {type, dims, data}}, e.g. ort.Tensor) and `meta` (JSON values) in onnxopt's
 * checkpoint format.
 * @returns {Promise<Uint8Array>}
 */
export async function writeCheckpoint(tensors, meta = {}) {
  const entries = [], blobs = [];
  let offset = 0;
  for (const [name, t] of Object.entries(tensors)) {
    const dtype = NUMPY[t.type];
    if (!dtype) throw new Error(`checkpoint: ${JSON.stringify(name)} has type ${t.type}, expected a numeric or bool tensor`);
    const data = await (t.getData ? t.getData() : t.data);
    const bytes = new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
    entries.push({ name, dtype, shape: [...t.dims], offset, nbytes: bytes.length });
    blobs.push(bytes);
    offset += bytes.length;
  }
  const header = new TextEncoder().encode(JSON.stringify({ meta, arrays: entries }));
  const size = new Uint8Array(8);
  new DataView(size.buffer).setBigUint64(0, BigInt(header.length), true);
  const body = concat([MAGIC, size, header, ...blobs]);
  return concat([body, await sha256(body)]);
}

/**
 * Reads a checkpoint: verifies its SHA-256 and returns {arrays: {name: {type, dims, data}}, meta}.
 * @param {Uint8Array} bytes
 */
export async function readCheckpoint(bytes, what = "checkpoint") {
  const head = bytes.subarray(0, MAGIC.length);
  if (head.length < MAGIC.length || head.some((b, i) => b !== MAGIC[i])) {
    throw new Error(`${what}: not an onnxopt checkpoint (expected it to start with "ONNXOPT-CHECKPOINT-1\\n", ` +
      `got ${JSON.stringify(new TextDecoder().decode(head))})`);
  }
  if (bytes.length < MAGIC.length + 8 + DIGEST) throw new Error(`${what}: truncated (${bytes.length} bytes)`);
  const body = bytes.subarray(0, bytes.length - DIGEST), stored = bytes.subarray(bytes.length - DIGEST);
  const actual = await sha256(body);
  if (actual.some((b, i) => b !== stored[i])) {
    throw new Error(`${what}: truncated or corrupted (the SHA-256 stored in it does not match its content); ` +
      "nothing was loaded");
  }
  const view = new DataView(body.buffer, body.byteOffset, body.byteLength);
  const size = Number(view.getBigUint64(MAGIC.length, true)), start = MAGIC.length + 8;
  const header = JSON.parse(new TextDecoder().decode(body.subarray(start, start + size)));
  const base = start + size, arrays = {};
  for (const e of header.arrays) {
    const found = BY_NUMPY[e.dtype];
    if (!found) throw new Error(`${what}: array ${JSON.stringify(e.name)} has dtype ${e.dtype}, which the runner does not read`);
    const [type, Typed] = found;
    const count = e.shape.reduce((a, b) => a * b, 1);
    if (e.nbytes !== count * Typed.BYTES_PER_ELEMENT || base + e.offset + e.nbytes > body.length) {
      throw new Error(`${what}: array ${JSON.stringify(e.name)} does not fit the file (a malformed header)`);
    }
    const data = new Typed(count);  // NOTE: copied: the file's offsets need not be aligned for a typed view
    new Uint8Array(data.buffer).set(body.subarray(base + e.offset, base + e.offset + e.nbytes));
    arrays[e.name] = { type, dims: e.shape, data };
  }
  return { arrays, meta: header.meta };
}
