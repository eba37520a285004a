// Serves js/ (the package and node_modules), this folder (/bench/) and the benchmark data (/data/), opens
// browser.html in a headless Chromium and prints its window.result as one JSON line (browser_vs_tfjs.py reads it).
import { fileURLToPath } from "node:url";
import { launch, serve } from "../../js/test/browser/serve.js";

const js = fileURLToPath(new URL("../../js/", import.meta.url)), here = fileURLToPath(new URL(".", import.meta.url));
const server = await serve({ "/": js, "/bench/": here, "/data/": process.env.ONNXOPT_BENCH_DATA });
const browser = await launch();
try {
  const page = await browser.newPage();
  await page.goto(`${server.url}/bench/browser.html`);
  await page.waitForFunction(() => window.result !== undefined, null, { timeout: 590_000, polling: 1000 });
  const result = await page.evaluate(() => window.result);
  if (result.error) { console.error(result.error); process.exitCode = 1; }
  console.log(JSON.stringify(result));
} finally {
  await browser.close();
  await server.close();
}
