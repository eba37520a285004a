// A static file server for the browser test, the browser example and the benchmark: `routes` maps URL prefixes
// to folders. Pages are cross-origin isolated (COOP/COEP), so onnxruntime-web may use wasm threads.
import { createReadStream, statSync } from "node:fs";
import { createServer } from "node:http";
import { extname, join, normalize } from "node:path";

const TYPES = { ".html": "text/html", ".js": "text/javascript", ".mjs": "text/javascript", ".wasm": "application/wasm",
  ".json": "application/json", ".csv": "text/csv" };

/** Serves `routes` ({"/prefix/": folder}) on 127.0.0.1; resolves to {url, close()}. */
export function serve(routes) {
  const server = createServer((req, res) => {
    let path = decodeURIComponent(new URL(req.url, "http://x").pathname);
    if (path.endsWith("/")) path += "index.html";
    const prefix = Object.keys(routes).filter((p) => path.startsWith(p)).sort((a, b) => b.length - a.length)[0];
    const file = prefix === undefined ? null : join(routes[prefix], normalize(path.slice(prefix.length)).replace(/^(\.\.[/\\])+/, ""));
    let ok = false;
    try { ok = file !== null && statSync(file).isFile(); } catch { ok = false; }
    if (!ok) { res.writeHead(404); res.end(`not found: ${path}`); return; }
    res.writeHead(200, { "Content-Type": TYPES[extname(file)] ?? "application/octet-stream",
      "Cross-Origin-Opener-Policy": "same-origin", "Cross-Origin-Embedder-Policy": "require-corp" });
    createReadStream(file).pipe(res);
  });
  return new Promise((resolve) => server.listen(0, "127.0.0.1", () => resolve({
    url: `http://127.0.0.1:${server.address().port}`, close: () => new Promise((r) => server.close(r)) })));
}

/** Launches Debian's chromium (CHROMIUM_PATH or chromium on PATH) headless with playwright-core. */
export async function launch() {
  const { chromium } = await import("playwright-core");
  const executablePath = process.env.CHROMIUM_PATH || "/usr/bin/chromium";
  // NOTE: --no-sandbox: CI runs as root, where chromium's sandbox refuses to start
  return chromium.launch({ executablePath, headless: true, args: ["--no-sandbox"] });
}
