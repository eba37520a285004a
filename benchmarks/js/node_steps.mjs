// Times onnxopt's StepRunner in Node on one step file: ms per step for `step()` over the batches of an epoch and
// for `epoch()` (one Scan run for the full batches). Called by node_vs_python.py, which alternates it with the
// Python Runner. Args: STEP X.bin Y.bin XDIMS(comma) YTYPE BATCH EPOCHS [unpacked: the step as saved, not its packed form]
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { pathToFileURL } from "node:url";
import { StepRunner } from "../../js/src/index.js";

// NOTE: resolved from js/, where npm installed it (this script lives outside the package)
const ort = await import(pathToFileURL(createRequire(new URL("../../js/package.json", import.meta.url)).resolve("onnxruntime-node")));

ort.env.logLevel = "error";
const [step, xFile, yFile, xDims, yType, batchText, epochsText, form] = process.argv.slice(2);
const read = (p) => { const b = readFileSync(p); return b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength); };
const dims = xDims.split(",").map(Number), batch = Number(batchText), epochs = Number(epochsText), n = dims[0];
const X = new ort.Tensor("float32", new Float32Array(read(xFile)), dims);
const yData = yType === "int64" ? new BigInt64Array(read(yFile)) : new Float32Array(read(yFile));
const y = new ort.Tensor(yType, yData, [n]);
const row = dims.slice(1).reduce((a, b) => a * b, 1);
const xs = [], ys = [];
for (let i = 0; i < n; i += batch) {
  const end = Math.min(n, i + batch);
  xs.push(new ort.Tensor("float32", X.data.subarray(i * row, end * row), [end - i, ...dims.slice(1)]));
  ys.push(new ort.Tensor(yType, yData.subarray(i, end), [end - i]));
}
const runner = await StepRunner.create(ort, step, { batchSize: batch, packed: form !== "unpacked" });
for (let i = 0; i < xs.length; i++) await runner.step(xs[i], ys[i]);  // NOTE: warm-up epoch
await runner.epoch(X, y, { batchSize: batch });
await new Promise((r) => setTimeout(r, 200));  // NOTE: ORT's threads spin ~35 ms after a run
let t = performance.now();
for (let e = 0; e < epochs; e++) for (let i = 0; i < xs.length; i++) await runner.step(xs[i], ys[i]);
const stepMs = (performance.now() - t) / (epochs * xs.length);
await new Promise((r) => setTimeout(r, 200));
t = performance.now();
for (let e = 0; e < epochs; e++) await runner.epoch(X, y, { batchSize: batch });
const epochMs = (performance.now() - t) / (epochs * xs.length);
// NOTE: the floor: onnxruntime-node's InferenceSession.run on the same model and one batch's feeds, as many runs
let runMs = NaN;
if (runner._packed) {
  const { session, feeds } = await runner._feeds(runner._batch(xs[0], ys[0]));  // NOTE: as step() feeds it
  const steps = epochs * xs.length;
  for (let i = 0; i < xs.length; i++) await session.run(feeds, runner._fetches);
  await new Promise((r) => setTimeout(r, 200));
  t = performance.now();
  for (let i = 0; i < steps; i++) await session.run(feeds, runner._fetches);
  runMs = (performance.now() - t) / steps;
}
console.log(JSON.stringify({ step_ms: stepMs, epoch_ms: epochMs, run_ms: runMs }));
