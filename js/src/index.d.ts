// Types of the onnxopt npm package. `ort` is the onnxruntime binding the caller loaded (onnxruntime-node,
// onnxruntime-web, onnxruntime-react-native): the package depends on none of them, only on onnxruntime-common's types.
import type { InferenceSession, Tensor } from "onnxruntime-common";

/** The onnxruntime module: `import * as ort from "onnxruntime-node"` (or "onnxruntime-web"). */
export interface OrtBinding {
  InferenceSession: { create(model: Uint8Array, options?: InferenceSession.SessionOptions): Promise<InferenceSession> };
  Tensor: typeof Tensor;
}

/** A saved step: its bytes, a path (Node) or a URL. */
export type StepSource = Uint8Array | ArrayBuffer | string | URL;

export interface StepRunnerOptions {
  /** Merged over the runner's defaults (optimization "all", sequential, one thread for small steps). */
  sessionOptions?: InferenceSession.SessionOptions;
  /** External data files by the location the step names: bytes, a path or a URL. Default: beside the step. */
  externalData?: Record<string, Uint8Array | string | URL>;
  /** The usual batch length (epoch's default; picks one thread for small steps). Default 32. */
  batchSize?: number;
  /** false: run the step as saved instead of its packed form (ship.for_js: one input and one output for all the
   * weights and state); a session told to keep outputs on a device (preferredOutputLocation) always does. */
  packed?: boolean;
}

/** A batch's data: one tensor, or {name: tensor} for a step with several data inputs (`dataNames`). */
export type Features = Tensor | Record<string, Tensor>;

export class StepRunner {
  /** Loads a step written by `TrainStep.save` / `onnxopt compile` into a session of `ort`. */
  static create(ort: OrtBinding, step: StepSource, options?: StepRunnerOptions): Promise<StepRunner>;
  readonly weightNames: string[];
  /** The step's data inputs, in order: X's name, or the keys X must have when there are several. */
  readonly dataNames: string[];
  /** Running statistics, optimizer state and the step counter "optim.step". */
  readonly stateNames: string[];
  /** "float" (targets like the prediction) or "index" (class indices, int64 or int32). */
  readonly targetKind: string;
  readonly batchSize: number;
  /** Steps completed so far. */
  readonly stepCount: number;
  /** One step on a batch; resolves to the loss. A NaN or infinite loss rejects and keeps the weights. */
  /** `outputGrad`: the gradient on the output of a step compiled with external_grad=True (then y is null). */
  step(X: Features, y?: Tensor | null, sampleWeight?: Tensor | null, options?: { outputGrad?: Tensor }): Promise<number>;
  /** One step per batch of `batchSize` rows (one Scan run for steps compiled with --js); resolves to the losses. */
  epoch(X: Features, y?: Tensor | null, options?: { batchSize?: number; sampleWeight?: Tensor; outputGrad?: Tensor }): Promise<Float64Array>;
  getWeights(): Record<string, Tensor>;
  setWeights(values: Record<string, Tensor | Tensor.DataType>): void;
  getState(): Record<string, Tensor>;
  setState(values: Record<string, Tensor | Tensor.DataType>): void;
  /** Weights, state and step count in onnxopt's checkpoint format (Python: Runner.load_checkpoint). */
  saveCheckpoint(meta?: Record<string, unknown>): Promise<Uint8Array>;
  /** Restores a checkpoint (bytes, path or URL) from saveCheckpoint or Python's Runner.save_checkpoint. */
  loadCheckpoint(source: StepSource, options?: { kind?: string }): Promise<Record<string, unknown>>;
  /** The inference model with the trained weights (Python: Runner.export). */
  export(): Promise<Uint8Array>;
  release(): Promise<void>;
}

export interface CheckpointArray { type: Tensor.Type; dims: readonly number[]; data: Tensor.DataType }

export function writeCheckpoint(tensors: Record<string, CheckpointArray | Tensor>, meta?: Record<string, unknown>): Promise<Uint8Array>;
export function readCheckpoint(bytes: Uint8Array): Promise<{ arrays: Record<string, CheckpointArray>; meta: Record<string, unknown> }>;

/** Files of generate_artifacts (onnxopt.compat.onnxruntime_training.artifacts): bytes, paths or URLs. */
export interface TrainingSessionCreateOptions {
  checkpointState: StepSource;
  trainModel: StepSource;
  evalModel?: StepSource;
  optimizerModel?: StepSource;
}

/** The shape of onnxruntime-web's training API (1.17-1.19) on an inference binding. */
export class TrainingSession {
  static create(ort: OrtBinding, options: TrainingSessionCreateOptions, sessionOptions?: InferenceSession.SessionOptions): Promise<TrainingSession>;
  readonly trainingInputNames: readonly string[];
  readonly trainingOutputNames: readonly string[];
  readonly evalInputNames: readonly string[];
  readonly evalOutputNames: readonly string[];
  runTrainStep(feeds: Record<string, Tensor>, fetches?: readonly string[], options?: InferenceSession.RunOptions): Promise<Record<string, Tensor>>;
  runOptimizerStep(): Promise<void>;
  lazyResetGrad(): Promise<void>;
  runEvalStep(feeds: Record<string, Tensor>, fetches?: readonly string[], options?: InferenceSession.RunOptions): Promise<Record<string, Tensor>>;
  getParametersSize(trainableOnly?: boolean): Promise<number>;
  getContiguousParameters(trainableOnly?: boolean): Promise<Tensor>;
  loadParametersBuffer(buffer: Uint8Array, trainableOnly?: boolean): Promise<void>;
  setLearningRate(learningRate: number): void;
  getLearningRate(): number;
  release(): Promise<void>;
}

/** onnxruntime's training checkpoint (flatbuffers, "ODTC"). */
export function readOrtCheckpoint(bytes: Uint8Array): {
  params: Record<string, CheckpointArray & { name: string; requiresGrad: boolean }>;
  nominal: boolean;
  group: { step: number; lr: number; states: Record<string, Record<string, Float32Array>> } | null;
};
