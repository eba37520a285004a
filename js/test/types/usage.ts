// Compiled by `tsc -p test/types` (tests/test_js.py): the declarations in src/index.d.ts type a real use.
import * as ort from "onnxruntime-node";
import { readCheckpoint, StepRunner, TrainingSession } from "onnxopt";

export async function train(step: Uint8Array, X: ort.Tensor, y: ort.Tensor): Promise<Uint8Array> {
  const runner: StepRunner = await StepRunner.create(ort, step, { batchSize: 16, sessionOptions: { intraOpNumThreads: 1 } });
  const loss: number = await runner.step(X, y);
  const losses: Float64Array = await runner.epoch(X, y, { batchSize: 8 });
  const weights: Record<string, ort.Tensor> = runner.getWeights();
  runner.setWeights(weights);
  runner.setState(runner.getState());
  const ckpt = await runner.saveCheckpoint({ loss, last: losses[losses.length - 1] });
  const { meta } = await readCheckpoint(ckpt);
  await runner.loadCheckpoint(ckpt, { kind: String(meta.kind) });
  return runner.export();
}

export async function external(step: string, a: ort.Tensor, b: ort.Tensor, g: ort.Tensor): Promise<number> {
  const two = await StepRunner.create(ort, step, { packed: false });
  const names: string[] = two.dataNames;
  await two.epoch({ [names[0]]: a, [names[1]]: b }, null, { outputGrad: g });
  return two.step({ a, b }, null, null, { outputGrad: g });
}

export async function port(feeds: Record<string, ort.Tensor>): Promise<number> {
  const session = await TrainingSession.create(ort, { checkpointState: "checkpoint", trainModel: "training_model.onnx",
    evalModel: "eval_model.onnx", optimizerModel: "optimizer_model.onnx" });
  const out = await session.runTrainStep(feeds);
  await session.runOptimizerStep();
  await session.lazyResetGrad();
  const params: ort.Tensor = await session.getContiguousParameters(true);
  await session.loadParametersBuffer(new Uint8Array((params.data as Float32Array).buffer), true);
  return Number(out[session.trainingOutputNames[0]].data[0]) + (await session.getParametersSize());
}
