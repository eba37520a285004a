// Trains a classifier from a CSV in Node with a step compiled by `onnxopt compile ... --js` (see ../make_data.py):
//   node train.js STEP.onnx DATA.csv [--target label] [--epochs 20] [--batch-size 32] [-o trained.onnx]
// Prints the mean loss per epoch and the accuracy of the trained model, writes the trained inference model and
// a checkpoint Python's Runner.load_checkpoint reads (trained.onnx.ckpt).
import { readFileSync, writeFileSync } from "node:fs";
import * as ort from "onnxruntime-node";
import { StepRunner } from "onnxopt";

const args = process.argv.slice(2);
const option = (name, fallback) => { const i = args.indexOf(name); return i < 0 ? fallback : args.splice(i, 2)[1]; };
const target = option("--target", "label"), epochs = Number(option("--epochs", "20"));
const batchSize = Number(option("--batch-size", "32")), out = option("-o", "trained.onnx");
const [stepPath, csvPath] = args;
if (!stepPath || !csvPath) {
  console.error("usage: node train.js STEP.onnx DATA.csv [--target label] [--epochs 20] [--batch-size 32] [-o trained.onnx]");
  process.exit(2);
}

// -- the CSV: numeric columns, a header row; the target column holds class indices ----------------------------
const [header, ...lines] = readFileSync(csvPath, "utf8").trim().split(/\r?\n/);
const columns = header.split(","), t = columns.indexOf(target);
if (t < 0) throw new Error(`--target: no column ${JSON.stringify(target)} in ${csvPath} (columns: ${columns})`);
const n = lines.length, width = columns.length - 1;
const features = new Float32Array(n * width), labels = new BigInt64Array(n);
lines.forEach((line, i) => {
  const cells = line.split(",").map(Number);
  labels[i] = BigInt(cells[t]);
  cells.filter((_, j) => j !== t).forEach((v, j) => { features[i * width + j] = v; });
});

// -- training -------------------------------------------------------------------------------------------------
ort.env.logLevel = "error";
const runner = await StepRunner.create(ort, stepPath, { batchSize });
let seed = 1;  // NOTE: a fixed shuffle per epoch, so runs are repeatable
const random = () => ((seed = (seed * 1103515245 + 12345) % 2 ** 31) / 2 ** 31);
const order = Array.from({ length: n }, (_, i) => i);
const X = new Float32Array(n * width), y = new BigInt64Array(n);
for (let epoch = 1; epoch <= epochs; epoch++) {
  for (let i = n - 1; i > 0; i--) { const j = Math.floor(random() * (i + 1)); [order[i], order[j]] = [order[j], order[i]]; }
  order.forEach((k, i) => { X.set(features.subarray(k * width, (k + 1) * width), i * width); y[i] = labels[k]; });
  const losses = await runner.epoch(new ort.Tensor("float32", X.slice(), [n, width]), new ort.Tensor("int64", y.slice(), [n]));
  console.log(`epoch ${epoch}: mean loss ${(losses.reduce((a, b) => a + b, 0) / losses.length).toFixed(4)}`);
}

// -- the trained model, used as any ONNX model ------------------------------------------------------------------
const trained = await runner.export();
writeFileSync(out, trained);
writeFileSync(`${out}.ckpt`, await runner.saveCheckpoint({ epochs }));
const session = await ort.InferenceSession.create(trained);
const scores = (await session.run({ [session.inputNames[0]]: new ort.Tensor("float32", features, [n, width]) }))[session.outputNames[0]];
const classes = scores.dims[1];
let right = 0;
for (let i = 0; i < n; i++) {
  const row = scores.data.subarray(i * classes, (i + 1) * classes);
  if (BigInt(row.indexOf(Math.max(...row))) === labels[i]) right++;
}
console.log(`accuracy ${(right / n).toFixed(4)} on ${n} rows; wrote ${out} and ${out}.ckpt`);
