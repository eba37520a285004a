// Serves js/ (the package and node_modules), this folder (/bench/) and the benchmark data (/data/), opens
// browser.html in a headless Chromium and prints its window.result as one JSON line (browser_vs_tfjs.py reads it).
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { launch, serve } from "../../js/test/browser/serve.js";

const js = fileURLToPath(new URL("../../js/", import.meta.url)), here = fileURLToPath(new URL(".", import.meta.url));
const server = await serve({ "/": js, "/bench/": here, "/data/": process.env.ONNXOPT_BENCH_DATA });
const browser = await launch();
try {
  const manifest = JSON.parse(readFileSync(join(process.env.ONNXOPT_BENCH_DATA, "manifest.json"), "utf8"));
  const merged = { workloads: [] };
  for (const w of manifest.workloads) {  // NOTE: a page per workload, each with its own time limit
    const page = await browser.newPage();
    await page.goto(`${server.url}/bench/browser.html?w=${encodeURIComponent(w.name)}`);
    await page.waitForFunction(() => window.result !== undefined, null, { timeout: 1_800_000, polling: 1000 });
    const result = await page.evaluate(() => window.result);
    await page.close();
    if (result.error) { console.error(result.error); process.exitCode = 1; break; }
    Object.assign(merged, { ...result, workloads: [...merged.workloads, ...result.workloads] });
  }
  console.log(JSON.stringify(merged));
} finally {
  await browser.close();
  await server.close();
}
