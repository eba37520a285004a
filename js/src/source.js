// Reading a file given as bytes, a path (Node) or a URL (fetch; file: URLs read from disk in Node).

const isNode = typeof process !== "undefined" && !!process.versions?.node;

/** The bytes of `source` (Uint8Array, ArrayBuffer, path string or URL) and the location its neighbours resolve from. */
export async function readSource(source, what) {
  if (source instanceof Uint8Array) return { bytes: source, base: null };
  if (source instanceof ArrayBuffer) return { bytes: new Uint8Array(source), base: null };
  if (typeof source !== "string" && !(source instanceof URL)) {
    throw new Error(`${what}: expected a Uint8Array, an ArrayBuffer, a path or a URL, got ${describe(source)}`);
  }
  const text = String(source);
  if (isNode && (source instanceof URL ? source.protocol === "file:" : !/^[a-z][a-z0-9+.-]*:\/\//i.test(text))) {
    const { readFile } = await import("node:fs/promises");
    const { fileURLToPath } = await import("node:url");
    const path = source instanceof URL || text.startsWith("file:") ? fileURLToPath(text) : text;
    try {
      const buf = await readFile(path);
      return { bytes: new Uint8Array(buf.buffer, buf.byteOffset, buf.byteLength), base: path };
    } catch (err) {
      throw new Error(`${what}: cannot read ${JSON.stringify(path)} (${err.message})`);
    }
  }
  const url = new URL(text, globalThis.location?.href);
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${what}: fetching ${url} gave HTTP ${response.status} ${response.statusText}`);
  return { bytes: new Uint8Array(await response.arrayBuffer()), base: url };
}

/** `location` resolved next to `base` (a path or URL), for external data. */
export async function readBeside(base, location, what) {
  if (base === null) {
    throw new Error(`${what}: the step's tensors are in the external file ${JSON.stringify(location)}; the step ` +
      "was given as bytes, so pass the file's bytes as options.externalData[location]");
  }
  if (base instanceof URL) return (await readSource(new URL(location, base), what)).bytes;
  const { dirname, join } = await import("node:path");
  return (await readSource(join(dirname(base), location), what)).bytes;
}

export function describe(value) {
  if (value === null || value === undefined) return String(value);
  if (value.constructor && value.constructor !== Object) return `a ${value.constructor.name}`;
  return typeof value;
}

export function base64(textValue) {
  if (isNode && globalThis.Buffer) {
    const buf = globalThis.Buffer.from(textValue, "base64");
    return new Uint8Array(buf.buffer, buf.byteOffset, buf.byteLength);
  }
  const bin = atob(textValue), out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}
