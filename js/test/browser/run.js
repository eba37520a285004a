// Drives index.html in a headless Chromium: serves js/ and the fixtures (ONNXOPT_JS_FIXTURES), prints the page's
// result as one JSON line (tests/test_js.py compares it with the Python Runner's losses).
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { launch, serve } from "./serve.js";

const root = join(dirname(fileURLToPath(import.meta.url)), "..", "..");
const server = await serve({ "/": root, "/fixtures/": process.env.ONNXOPT_JS_FIXTURES });
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
  console.log(JSON.stringify(result));
} finally {
  await browser.close();
  await server.close();
}
