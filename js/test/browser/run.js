// Drives index.html in a headless Chromium: serves js/ and the fixtures (ONNXOPT_JS_FIXTURES), prints the page's
// result as one JSON line (tests/test_js.py compares it with the Python Runner's losses). With ONNXOPT_JS_EXAMPLE
// (a folder holding step.onnx and data.csv) it also runs examples/browser/ and reports its losses.
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { launch, serve } from "./serve.js";

const root = join(dirname(fileURLToPath(import.meta.url)), "..", "..");
const example = process.env.ONNXOPT_JS_EXAMPLE;
const server = await serve({ "/": root, "/fixtures/": process.env.ONNXOPT_JS_FIXTURES,
  ...(example ? { "/examples/browser/data/": example } : {}) });
const browser = await launch();
try {
  const page = await browser.newPage();
  const errors = [];
  page.on("pageerror", (err) => errors.push(String(err)));
  await page.goto(`${server.url}/test/browser/index.html`);
  await page.waitForFunction(() => window.result !== undefined, null, { timeout: 240_000 });
  const result = await page.evaluate(() => window.result);
  if (result.error || errors.length) {
    console.error(result.error ?? "", errors.join("\n"));
    process.exitCode = 1;
  }
  if (example) {
    await page.goto(`${server.url}/examples/browser/?auto`);
    await page.waitForFunction(() => window.done !== undefined, null, { timeout: 240_000 });
    result.example = await page.evaluate(() => window.done);
    if (result.example.error) { console.error(result.example.error); process.exitCode = 1; }
  }
  console.log(JSON.stringify(result));
} finally {
  await browser.close();
  await server.close();
}
