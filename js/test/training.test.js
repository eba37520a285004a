// TrainingSession (the shape of onnxruntime-web's removed training API) against Python's
// onnxopt.compat.onnxruntime_training.api on the same artifacts (tests/js_fixtures.py write_training_fixtures;
// ONNXOPT_JS_TRAINING names the folder), on onnxruntime-node and onnxruntime-web's wasm backend.

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { describe, test } from "node:test";

import { TrainingSession } from "onnxopt";

const FIXTURES = process.env.ONNXOPT_JS_TRAINING;
const skip = FIXTURES ? false : "ONNXOPT_JS_TRAINING is not set (tests/test_js.py writes the artifacts and sets it)";
const manifest = FIXTURES ? JSON.parse(readFileSync(join(FIXTURES, "training.json"), "utf8")) : { cases: [] };
const BINDINGS = { node: "onnxruntime-node", web: "onnxruntime-web" };

function tensor(ort, folder, spec, a, b) {
  const buf = readFileSync(join(folder, spec.file));
  const bytes = buf.buffer.slice(buf.byteOffset, buf.byteOffset + buf.byteLength);
  const data = spec.type === "int64" ? new BigInt64Array(bytes) : new Float32Array(bytes);
  const row = spec.dims.slice(1).reduce((p, q) => p * q, 1);
  return new ort.Tensor(spec.type, data.subarray(a * row, b * row), [b - a, ...spec.dims.slice(1)]);
}

const close = (a, e, what, rtol = 1e-4) => assert.ok(Math.abs(a - e) <= rtol * Math.abs(e) + 1e-6, `${what}: ${a}, Python's ${e}`);

for (const name of Object.keys(BINDINGS)) {
  describe(`TrainingSession on ${BINDINGS[name]}`, { skip }, () => {
    for (const c of manifest.cases) {
      test(`${c.name}: runTrainStep, runOptimizerStep, lazyResetGrad, runEvalStep give Python's losses`, async () => {
        const ort = await import(BINDINGS[name]);
        ort.env.logLevel = "error";
        const folder = join(FIXTURES, c.name);
        const session = await TrainingSession.create(ort, {
          checkpointState: join(folder, c.nominal ? "nominal_checkpoint" : "checkpoint"), trainModel: join(folder, "training_model.onnx"),
          evalModel: join(folder, "eval_model.onnx"), optimizerModel: join(folder, "optimizer_model.onnx") });
        assert.deepEqual(session.trainingInputNames, session.evalInputNames);
        assert.deepEqual(session.trainingOutputNames, ["loss"]);
        const [xName, yName] = session.trainingInputNames;
        const feeds = (i) => ({ [xName]: tensor(ort, folder, c.X, i, i + c.batch), [yName]: tensor(ort, folder, c.y, i, i + c.batch) });
        if (c.nominal) {
          await assert.rejects(session.runTrainStep(feeds(0)), /nominal; load the parameters first/);
          await session.loadParametersBuffer(new Uint8Array(Float32Array.from(c.initial).buffer), false);
        }
        assert.equal(await session.getParametersSize(false), c.initial.length);
        assert.equal(await session.getParametersSize(true), c.initial.length - (c.frozen.length ? 3 : 0));
        for (let k = 0; k < c.train.length; k++) {
          const out = await session.runTrainStep(feeds(k * c.batch));
          close(out.loss.data[0], c.train[k], `train[${k}]`);
          await session.runOptimizerStep();
          await session.lazyResetGrad();
          close((await session.runEvalStep(feeds(k * c.batch))).loss.data[0], c.eval[k], `eval[${k}]`);
        }
        const params = (await session.getContiguousParameters()).data;
        c.params.forEach((v, i) => close(params[i], v, `parameter ${i}`));
        await assert.rejects(session.loadParametersBuffer(new Uint8Array(12)), /expected \d+ bytes/);
        await assert.rejects(session.runTrainStep({ [xName]: feeds(0)[xName] }), new RegExp(`feeds lack inputs \\["${yName}"\\]`));
        await session.release();
      });
    }
  });
}
