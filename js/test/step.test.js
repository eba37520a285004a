// StepRunner against the Python Runner: the losses it wrote for the same steps and batches (tests/js_fixtures.py
// writes them; ONNXOPT_JS_FIXTURES names the folder), on onnxruntime-node and onnxruntime-web's wasm backend.
// What the runners write back (checkpoints, exported models) goes to ONNXOPT_JS_OUT for tests/test_js.py to read.

import assert from "node:assert/strict";
import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { describe, test } from "node:test";

import { readCheckpoint, StepRunner } from "onnxopt";

const FIXTURES = process.env.ONNXOPT_JS_FIXTURES;
const OUT = process.env.ONNXOPT_JS_OUT;
const RTOL = 1e-4;
const skip = FIXTURES ? false : "ONNXOPT_JS_FIXTURES is not set (tests/test_js.py writes the fixtures and sets it)";
const manifest = FIXTURES ? JSON.parse(readFileSync(join(FIXTURES, "cases.json"), "utf8")) : { cases: [] };

const BINDINGS = { node: "onnxruntime-node", web: "onnxruntime-web" };

async function binding(name) {
  const ort = await import(BINDINGS[name]);
  ort.env.logLevel = "error";
  if (name === "web") ort.env.wasm.numThreads = 1;
  return ort;
}

function tensor(ort, spec) {
  const buf = readFileSync(join(FIXTURES, spec.file));
  const bytes = buf.buffer.slice(buf.byteOffset, buf.byteOffset + buf.byteLength);
  return new ort.Tensor(spec.type, spec.type === "int64" ? new BigInt64Array(bytes) : new Float32Array(bytes), spec.dims);
}

function rows(ort, t, a, b) {
  const row = t.dims.slice(1).reduce((p, q) => p * q, 1);
  return new ort.Tensor(t.type, t.data.subarray(a * row, b * row), [b - a, ...t.dims.slice(1)]);
}

function close(actual, expected, what) {
  assert.equal(actual.length, expected.length, `${what}: ${actual.length} losses, expected ${expected.length}`);
  actual.forEach((a, i) => {
    const e = expected[i];
    assert.ok(Math.abs(a - e) <= RTOL * Math.abs(e), `${what}[${i}]: ${a}, Python's ${e} (rtol ${RTOL})`);
  });
}

async function steps(ort, runner, c, from = 0) {
  const X = tensor(ort, c.X), y = tensor(ort, c.y), w = c.sample_weight && tensor(ort, c.sample_weight);
  const losses = [];
  for (let i = from * c.batch; i < X.dims[0]; i += c.batch) {
    const end = Math.min(X.dims[0], i + c.batch);
    losses.push(await runner.step(rows(ort, X, i, end), rows(ort, y, i, end), w && rows(ort, w, i, end)));
  }
  return losses;
}

for (const name of Object.keys(BINDINGS)) {
  describe(`StepRunner on ${BINDINGS[name]}`, { skip }, () => {
    for (const c of manifest.cases) {
      test(`${c.name}: one step per batch gives the Python Runner's losses`, async () => {
        const ort = await binding(name);
        const runner = await StepRunner.create(ort, join(FIXTURES, c.step), { batchSize: c.batch });
        close(await steps(ort, runner, c), c.steps, `${c.name} steps`);
        assert.equal(runner.stepCount, c.steps.length);
        for (const [w, value] of Object.entries(c.weights_after)) {
          const got = runner.getWeights()[w].data, want = value.flat(Infinity);
          want.forEach((v, i) => assert.ok(Math.abs(got[i] - v) <= 1e-4 * (1 + Math.abs(v)), `${w}[${i}]: ${got[i]} vs ${v}`));
        }
        if (OUT) {
          writeFileSync(join(OUT, `${c.name}.${name}.ckpt`), await runner.saveCheckpoint({ from: name }));
          writeFileSync(join(OUT, `${c.name}.${name}.trained.onnx`), await runner.export());
        }
        await runner.release();
      });
      if (c.epoch) {
        test(`${c.name}: epoch (one Scan run) gives the Python Runner's epoch losses`, async () => {
          const ort = await binding(name);
          const runner = await StepRunner.create(ort, join(FIXTURES, c.step), { batchSize: c.batch });
          const losses = await runner.epoch(tensor(ort, c.X), tensor(ort, c.y));
          close(Array.from(losses), c.epoch, `${c.name} epoch`);
          assert.equal(runner.stepCount, c.epoch.length);
        });
      }
    }

    for (const c of manifest.more ?? []) {
      test(`${c.name}: packed and as saved, one step per batch gives Python's losses`, async () => {
        const ort = await binding(name);
        const Xs = c.X.file ? tensor(ort, c.X) : Object.fromEntries(Object.entries(c.X).map(([k, v]) => [k, tensor(ort, v)]));
        const n = (c.X.file ? c.X : Object.values(c.X)[0]).dims[0];
        const part = (t, i, end) => (t.dims ? rows(ort, t, i, end) : Object.fromEntries(Object.entries(t).map(([k, v]) => [k, rows(ort, v, i, end)])));
        for (const packed of [true, false]) {
          const runner = await StepRunner.create(ort, join(FIXTURES, c.step), { batchSize: c.batch, packed });
          assert.equal(Boolean(runner._packed), packed);
          const y = c.y && tensor(ort, c.y), g = c.output_grad && tensor(ort, c.output_grad), losses = [];
          for (let i = 0; i < n; i += c.batch) {
            const end = Math.min(n, i + c.batch);
            losses.push(await runner.step(part(Xs, i, end), y && rows(ort, y, i, end), undefined,
              { outputGrad: g && rows(ort, g, i, end) }));
          }
          close(losses, c.steps, `${c.name} (packed: ${packed})`);
          for (const [w, value] of Object.entries(c.weights_after ?? {})) {
            const got = runner.getWeights()[w].data, want = value.flat(Infinity);
            want.forEach((v, i) => assert.ok(Math.abs(got[i] - v) <= 1e-4 * (1 + Math.abs(v)), `${w}[${i}]: ${got[i]} vs ${v}`));
          }
          const epoch = await StepRunner.create(ort, join(FIXTURES, c.step), { batchSize: c.batch, packed });
          close(Array.from(await epoch.epoch(Xs, y, { outputGrad: g })), c.steps, `${c.name} epoch (packed: ${packed})`);
          if (g) {
            await assert.rejects(runner.step(part(Xs, 0, 8)), /outputGrad: the step takes "Y.grad" \(compiled with external_grad=True\), got undefined/);
          } else {
            await assert.rejects(runner.step(rows(ort, Xs.a, 0, 8), rows(ort, y, 0, 8)), /X: the step reads the data inputs \["a","b"\]/);
            await assert.rejects(runner.step({ a: rows(ort, Xs.a, 0, 8), b: rows(ort, Xs.b, 0, 5) }, rows(ort, y, 0, 8)), /X.b: input "b" expected 8 rows/);
          }
        }
      });
    }

    const mlp = manifest.cases.find((c) => c.name === "mlp");
    test("a Python checkpoint continues training where Python left it", async () => {
      const ort = await binding(name);
      const runner = await StepRunner.create(ort, join(FIXTURES, mlp.step), { batchSize: mlp.batch });
      const meta = await runner.loadCheckpoint(join(FIXTURES, mlp.checkpoint), { kind: "onnxopt.Runner" });
      assert.equal(meta.from, "python");
      assert.equal(runner.stepCount, mlp.checkpoint_steps);
      close(await steps(ort, runner, mlp, mlp.checkpoint_steps), mlp.steps.slice(mlp.checkpoint_steps), "continued");
    });

    test("a checkpoint round-trips; a corrupted one is refused whole", async () => {
      const ort = await binding(name);
      const runner = await StepRunner.create(ort, join(FIXTURES, mlp.step), { batchSize: mlp.batch });
      const X = tensor(ort, mlp.X), y = tensor(ort, mlp.y);
      for (const i of [0, 8]) await runner.step(rows(ort, X, i, i + 8), rows(ort, y, i, i + 8));
      const bytes = await runner.saveCheckpoint();
      const { arrays, meta } = await readCheckpoint(bytes);
      assert.equal(meta.step, 2);
      assert.deepEqual(arrays["optim.step"].dims, []);
      const fresh = await StepRunner.create(ort, join(FIXTURES, mlp.step));
      await fresh.loadCheckpoint(bytes);
      assert.deepEqual(Array.from(fresh.getWeights().coef_0.data), Array.from(runner.getWeights().coef_0.data));
      const bad = bytes.slice();
      bad[bad.length - 40] ^= 1;
      const before = Array.from(fresh.getWeights().coef_0.data);
      await assert.rejects(fresh.loadCheckpoint(bad), /corrupted.*nothing was loaded/);
      assert.deepEqual(Array.from(fresh.getWeights().coef_0.data), before);
    });

    test("a step with external data loads from its path", async () => {
      const ort = await binding(name);
      const runner = await StepRunner.create(ort, join(FIXTURES, mlp.external));
      close(await steps(ort, runner, mlp), mlp.steps, "external data");
      const bytes = readFileSync(join(FIXTURES, mlp.external));
      await assert.rejects(StepRunner.create(ort, bytes), /external file "mlp_ext.onnx.data".*options.externalData/);
      const data = readFileSync(join(FIXTURES, "mlp_ext.onnx.data"));
      const again = await StepRunner.create(ort, bytes, { externalData: { "mlp_ext.onnx.data": new Uint8Array(data) } });
      close(await steps(ort, again, mlp), mlp.steps, "external data as bytes");
    });

    test("setWeights and setState check names, shapes and types", async () => {
      const ort = await binding(name);
      const runner = await StepRunner.create(ort, join(FIXTURES, mlp.step));
      const w = runner.getWeights().bias_0;
      runner.setWeights({ bias_0: new Float32Array(w.data.length).fill(0.5) });
      assert.equal(runner.getWeights().bias_0.data[3], 0.5);
      assert.throws(() => runner.setWeights({ bias_0: new Float32Array(3) }), /weights: "bias_0" expected float32\[16\], got a Float32Array of 3 values/);
      assert.throws(() => runner.setWeights({ nope: new Float32Array(3) }), /"nope" is not one of/);
      assert.throws(() => runner.setState({ "optim.step": new Float32Array(1) }), /state: "optim.step" expected int64\[\], got a Float32Array of 1 values/);
      runner.setState({ "optim.step": new ort.Tensor("int64", BigInt64Array.of(5n), []) });
      assert.equal(runner.stepCount, 5);
    });

    test("a NaN loss throws and keeps the weights before the step", async () => {
      const ort = await binding(name);
      const runner = await StepRunner.create(ort, join(FIXTURES, mlp.step));
      const X = tensor(ort, mlp.X), y = tensor(ort, mlp.y);
      await runner.step(rows(ort, X, 0, 8), rows(ort, y, 0, 8));
      const bias = runner.getWeights().bias_1;
      runner.setWeights({ bias_1: new Float32Array(bias.data.length).fill(NaN) });
      const before = runner.getWeights();
      await assert.rejects(runner.step(rows(ort, X, 8, 16), rows(ort, y, 8, 16)), /loss became NaN at step 2; the weights were kept/);
      assert.equal(runner.stepCount, 1);
      assert.deepEqual(runner.getWeights().coef_0.data, before.coef_0.data);
      await assert.rejects(runner.epoch(X, y, { batchSize: 8 }), /batch 1: loss became NaN/);
    });

    const cnn = manifest.cases.find((c) => c.name === "cnn");
    test("class indices given as int32 train as int64", { skip: cnn ? false : "no CNN case (torch missing)" }, async () => {
      const ort = await binding(name);
      const runner = await StepRunner.create(ort, join(FIXTURES, cnn.step));
      const y = tensor(ort, cnn.y), y32 = new ort.Tensor("int32", Int32Array.from(y.data, Number), y.dims);
      const loss = await runner.step(rows(ort, tensor(ort, cnn.X), 0, 8), rows(ort, y32, 0, 8));
      close([loss], cnn.steps.slice(0, 1), "int32 targets");
      await assert.rejects(runner.step(rows(ort, tensor(ort, cnn.X), 0, 8), new ort.Tensor("float32", new Float32Array(8), [8])),
        /y: input "target" expected int64/);
    });

    test("errors name the input, the expected and the actual value", async () => {
      const ort = await binding(name);
      const runner = await StepRunner.create(ort, join(FIXTURES, mlp.step));
      const X = tensor(ort, mlp.X), y = tensor(ort, mlp.y);
      const x3 = new ort.Tensor("float32", new Float32Array(8 * 3), [8, 3]);
      await assert.rejects(runner.step(x3, rows(ort, y, 0, 8)), /X: input "X" expected float32\[N, 4\], got float32\[8, 3\]/);
      const x64 = new ort.Tensor("float64", new Float64Array(8 * 4), [8, 4]);
      await assert.rejects(runner.step(x64, rows(ort, y, 0, 8)), /X: input "X" expected float32\[N, 4\], got float64\[8, 4\]/);
      await assert.rejects(runner.step(rows(ort, X, 0, 8), rows(ort, y, 0, 5)), /y: input "target" expected 8 rows.*got float32\[5, 3\]/);
      await assert.rejects(runner.step(rows(ort, X, 0, 8)), /y: the step's loss needs targets for "target"/);
      await assert.rejects(runner.step([1, 2, 3], rows(ort, y, 0, 8)), /X: expected an ort.Tensor for input "X", got a Array/);
      await assert.rejects(StepRunner.create(ort, join(FIXTURES, manifest.inference)),
        /step: an ONNX model but not a train step saved by onnxopt \(metadata "onnxopt.train_step" missing/);
      await assert.rejects(StepRunner.create(ort, new Uint8Array([1, 2, 3, 4])), /step: expected an ONNX model/);
      await assert.rejects(StepRunner.create({}, join(FIXTURES, mlp.step)), /ort: expected an onnxruntime binding/);
      await assert.rejects(StepRunner.create(ort, join(FIXTURES, manifest.no_kernel)), /step: this onnxruntime binding has no kernel for the op ReluGrad/);
      assert.equal(runner.stepCount, 0);  // NOTE: no refused batch ran a step
    });
  });
}
