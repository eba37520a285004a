// TrainingSession: the shape of onnxruntime-web's training API (1.17-1.19, removed since), over the artifacts of
// onnxopt.compat.onnxruntime_training.artifacts.generate_artifacts (training, eval and optimizer models and
// onnxruntime's flatbuffers checkpoint), on an inference binding: code written for onnxruntime-web's
// TrainingSession ports by passing `ort` to create.
//
// onnxruntime-training accumulates gradients and updates weights in place (InPlaceAccumulatorV2, AdamWOptimizer,
// SGDOptimizerV2), kernels no inference binding has. Here the training model is rewritten to output the gradients
// themselves (the accumulation nodes, their buffers and `lazy_reset_grad` removed), and the accumulation and the
// optimizer's update run in JavaScript with the formulas of onnxruntime's CPU kernels (as Python's
// onnxopt.compat.onnxruntime_training.lowering writes them in ONNX).

import * as pb from "./proto.js";
import { describe, readSource } from "./source.js";

const BUFFER = "_grad.accumulation.buffer", RESET = "lazy_reset_grad";

// -- onnxruntime's checkpoint (ort_training_checkpoint.fbs; file identifier "ODTC") ------------------------------
// Checkpoint {version; module_state; optimizer_groups; property_bag}
// ModuleState {requires_grad_params:[Tensor]; frozen_params:[Tensor]; is_nominal_state:bool; has_external_data}
// OptimizerGroup {group_name; step:int64; initial_learning_rate:float; optimizer_states:[{param_name; momentums}]}
// Tensor {name; doc_string; dims:[int64]; data_type:int32; raw_data:[uint8]; string_data}

class FlatBuffer {
  constructor(bytes) { this.bytes = bytes; this.view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength); }
  u32(p) { return this.view.getUint32(p, true); }
  offset(table, slot) {  // NOTE: the field's offset in its table, 0 when absent (the vtable is shorter or holds 0)
    const vtable = table - this.view.getInt32(table, true);
    const at = 4 + 2 * slot;
    return at < this.view.getUint16(vtable, true) ? this.view.getUint16(vtable + at, true) : 0;
  }
  table(t, slot) { const o = this.offset(t, slot); return o ? t + o + this.u32(t + o) : null; }
  vector(t, slot) {
    const o = this.offset(t, slot);
    if (!o) return { start: 0, length: 0 };
    const p = t + o + this.u32(t + o);
    return { start: p + 4, length: this.u32(p) };
  }
  tables(t, slot) {
    const { start, length } = this.vector(t, slot);
    return Array.from({ length }, (_, i) => start + 4 * i + this.u32(start + 4 * i));
  }
  string(t, slot) { const { start, length } = this.vector(t, slot); return pb.text(this.bytes.subarray(start, start + length)); }
  int(t, slot, size, fallback = 0) {
    const o = this.offset(t, slot);
    if (!o) return fallback;
    return size === 8 ? Number(this.view.getBigInt64(t + o, true)) : size === 1 ? this.view.getUint8(t + o) : this.view.getInt32(t + o, true);
  }
  float(t, slot, fallback = 0) { const o = this.offset(t, slot); return o ? this.view.getFloat32(t + o, true) : fallback; }
}

function readTensor(fb, t, nominal) {
  const { start, length } = fb.vector(t, 2);
  const dims = Array.from({ length }, (_, i) => Number(fb.view.getBigInt64(start + 8 * i, true)));
  const elemType = fb.int(t, 3, 4);
  const entry = pb.DTYPES[elemType];
  if (!entry) throw new Error(`checkpointState: tensor ${JSON.stringify(fb.string(t, 0))} has ONNX type ${elemType}, not supported`);
  const [type, Typed] = entry, count = dims.reduce((a, b) => a * b, 1), data = new Typed(count);
  const raw = fb.vector(t, 4);
  if (!nominal && raw.length) {
    if (raw.length !== data.byteLength) throw new Error(`checkpointState: tensor ${JSON.stringify(fb.string(t, 0))} holds ${raw.length} bytes, expected ${data.byteLength}`);
    new Uint8Array(data.buffer).set(fb.bytes.subarray(raw.start, raw.start + raw.length));
  }
  return { name: fb.string(t, 0), type, dims, data };
}

/** Reads onnxruntime's training checkpoint: {params: {name: {type, dims, data, requiresGrad}}, nominal, group}. */
export function readOrtCheckpoint(bytes) {
  if (bytes.length < 8 || pb.text(bytes.subarray(4, 8)) !== "ODTC") {
    throw new Error(`checkpointState: expected onnxruntime's training checkpoint (file identifier "ODTC"), got ` +
      `${JSON.stringify(pb.text(bytes.subarray(4, 8)))}`);
  }
  const fb = new FlatBuffer(bytes), root = fb.u32(0), version = fb.int(root, 0, 4);
  if (version !== 1 && version !== 2) throw new Error(`checkpointState: expected checkpoint version 1 or 2, got ${version}`);
  const module = fb.table(root, 1), params = {};
  const nominal = module !== null && fb.int(module, 2, 1) === 1;
  if (module !== null && fb.int(module, 3, 1) === 1) throw new Error("checkpointState: its parameters are in an external data file, which the JS TrainingSession does not read");
  for (const [slot, requiresGrad] of [[0, true], [1, false]]) {
    for (const t of module === null ? [] : fb.tables(module, slot)) {
      const tensor = readTensor(fb, t, nominal);
      params[tensor.name] = { ...tensor, requiresGrad };
    }
  }
  const groups = fb.tables(root, 2).map((g) => ({
    step: fb.int(g, 1, 8), lr: fb.float(g, 2),
    states: Object.fromEntries(fb.tables(g, 3).map((s) => [fb.string(s, 0),
      Object.fromEntries(fb.tables(s, 1).map((m) => { const t = readTensor(fb, m, false); return [t.name, t.data]; }))])),
  }));
  return { params, nominal, group: groups[0] ?? null };
}

// -- the models ---------------------------------------------------------------------------------------------

/** A model's graph inputs and outputs (ValueInfo) and nodes ({opType, domain, inputs, outputs, attributes}). */
function graphOf(model) {
  const graph = pb.first(pb.fields(model), 7);
  if (graph === undefined) throw new Error("model: expected an ONNX model, got bytes without a graph");
  const fs = pb.fields(graph);
  const nodes = fs.filter((f) => f.field === 1).map((f) => {
    const n = pb.fields(f.value), strings = (k) => n.filter((g) => g.field === k).map((g) => pb.text(g.value));
    const attributes = {};
    for (const a of n.filter((g) => g.field === 5).map((g) => pb.fields(g.value))) {
      const name = pb.text(pb.first(a, 1)), floatBytes = pb.first(a, 2);
      attributes[name] = floatBytes !== undefined ? new DataView(floatBytes.buffer, floatBytes.byteOffset, 4).getFloat32(0, true) : pb.first(a, 3);
    }
    return { field: f, inputs: strings(1), outputs: strings(2), opType: pb.text(pb.first(n, 4) ?? new Uint8Array()),
      domain: pb.text(pb.first(n, 7) ?? new Uint8Array()), attributes };
  });
  return { graph, fs, nodes, inputs: fs.filter((f) => f.field === 11).map((f) => pb.valueInfo(f.value)),
    outputs: fs.filter((f) => f.field === 12).map((f) => pb.valueInfo(f.value)) };
}

/** The training model without in-place accumulation: the gradient of each trained parameter is an output. */
function withGradientOutputs(model) {
  const g = graphOf(model);
  const accumulators = g.nodes.filter((n) => n.opType === "InPlaceAccumulatorV2");
  const grads = new Map(accumulators.map((n) => [n.inputs[0].slice(0, -BUFFER.length), n.inputs[1]]));
  const dropped = new Set(accumulators.map((n) => n.field));
  const removedOutputs = new Set(accumulators.flatMap((n) => n.outputs));
  const read = new Set(g.nodes.filter((n) => !dropped.has(n.field)).flatMap((n) => n.inputs));
  const declared = new Map(g.inputs.map((i) => [i.name, i]));
  const parts = [];
  for (const f of g.fs) {
    if (dropped.has(f)) continue;
    if (f.field === 11) {
      const name = pb.valueInfo(f.value).name;
      if ((name.endsWith(BUFFER) || name === RESET) && !read.has(name)) continue;
    }
    if (f.field === 12 && removedOutputs.has(pb.valueInfo(f.value).name)) continue;
    parts.push(pb.raw(g.graph, f));
  }
  for (const [param, grad] of grads) {
    const info = declared.get(param + BUFFER) ?? declared.get(param);
    parts.push(pb.lenField(12, pb.encodeValueInfo(grad, info.elemType, info.dims)));
  }
  const graph = pb.concat(parts);
  return { model: pb.rewriteModel(model, () => graph), grads, inputs: g.inputs, outputs: g.outputs.filter((o) => !removedOutputs.has(o.name)) };
}

/** The optimizer of onnxruntime's optimizer model: {kind: "AdamW"|"SGD", attributes}. */
function optimizerOf(model) {
  const kinds = { AdamWOptimizer: "AdamW", SGDOptimizerV2: "SGD" };
  const found = graphOf(model).nodes.filter((n) => n.opType in kinds);
  if (found.length !== 1) {
    throw new Error(`optimizerModel: expected one com.microsoft AdamWOptimizer or SGDOptimizerV2 node, got ${found.length}`);
  }
  return { kind: kinds[found[0].opType], attributes: found[0].attributes };
}

async function bytesOf(source, what) {
  if (source === undefined || source === null) return null;
  return (await readSource(source, what)).bytes;
}

export class TrainingSession {
  /**
   * @param {object} ort the onnxruntime binding (onnxruntime-web or onnxruntime-node)
   * @param {{checkpointState, trainModel, evalModel?, optimizerModel?}} options each bytes, a path or a URL
   * @param {object} [sessionOptions] passed to ort.InferenceSession.create
   */
  static async create(ort, options, sessionOptions = {}) {
    if (!ort || typeof ort.InferenceSession?.create !== "function") {
      throw new Error(`ort: expected an onnxruntime binding, got ${describe(ort)}`);
    }
    const { checkpointState, trainModel, evalModel, optimizerModel } = options ?? {};
    if (!checkpointState || !trainModel) throw new Error("options: expected at least checkpointState and trainModel");
    const self = new TrainingSession();
    self.ort = ort;
    const ckpt = readOrtCheckpoint(await bytesOf(checkpointState, "checkpointState"));
    self._params = ckpt.params;
    self._nominal = ckpt.nominal;
    const train = withGradientOutputs(await bytesOf(trainModel, "trainModel"));
    const missing = [...train.grads.keys()].filter((n) => !(n in self._params));
    if (missing.length) throw new Error(`trainModel: parameters ${JSON.stringify(missing)} have gradient buffers but are not in the checkpoint`);
    self._grads = train.grads;
    self._paramOrder = train.inputs.map((i) => i.name).filter((n) => n in self._params);
    self.trainingInputNames = train.inputs.map((i) => i.name).filter((n) => !(n in self._params) && !n.endsWith(BUFFER) && n !== RESET);
    self.trainingOutputNames = train.outputs.map((o) => o.name);
    const open = async (model, what) => {
      try {
        return await ort.InferenceSession.create(model, sessionOptions);
      } catch (err) {
        throw new Error(`${what}: this onnxruntime binding could not load it (${err?.message ?? err}); the JS TrainingSession ` +
          "runs artifacts in standard ONNX plus onnxruntime's gradient accumulation (onnxopt's generate_artifacts writes them)");
      }
    };
    self._train = await open(train.model, "trainModel");
    const evalBytes = await bytesOf(evalModel, "evalModel");
    if (evalBytes) {
      const ev = graphOf(evalBytes);
      self._eval = await open(evalBytes, "evalModel");
      self._evalParams = ev.inputs.map((i) => i.name).filter((n) => n in self._params);
      self.evalInputNames = ev.inputs.map((i) => i.name).filter((n) => !(n in self._params));
      self.evalOutputNames = ev.outputs.map((o) => o.name);
    } else {
      self.evalInputNames = self.evalOutputNames = [];
    }
    const optBytes = await bytesOf(optimizerModel, "optimizerModel");
    self._optimizer = optBytes ? optimizerOf(optBytes) : null;
    self._step = ckpt.group?.step ?? 0;
    self._lr = Math.fround(ckpt.group?.lr ?? 1e-3);
    self._moments = {};
    for (const name of self._grads.keys()) {
      const saved = ckpt.group?.states[name] ?? {}, size = self._params[name].data.length;
      self._moments[name] = Array.from({ length: self._optimizer?.kind === "AdamW" ? 2 : 1 },
        (_, i) => Float32Array.from(saved[`momentum${i}`] ?? new Float32Array(size)));
    }
    self._accumulated = {};
    self._reset = true;
    return self;
  }

  _tensor(name) {
    const p = this._params[name];
    return new this.ort.Tensor(p.type, p.data, p.dims);
  }

  _user(feeds, names, what) {
    const missing = names.filter((n) => !(n in feeds));
    if (missing.length) throw new Error(`${what}: feeds lack inputs ${JSON.stringify(missing)} (expected ${JSON.stringify(names)})`);
    if (this._nominal) throw new Error(`${what}: the checkpoint state is nominal; load the parameters first (loadParametersBuffer)`);
    return Object.fromEntries(names.map((n) => [n, feeds[n]]));
  }

  /** Forward and backward on a batch: the gradients add to the accumulated ones (replace them after lazyResetGrad). */
  async runTrainStep(feeds, fetches, options) {
    const inputs = this._user(feeds, this.trainingInputNames, "runTrainStep");
    for (const n of this._paramOrder) inputs[n] = this._tensor(n);
    const grads = [...this._grads.values()];
    const out = await this._train.run(inputs, [...this.trainingOutputNames, ...grads], options);
    for (const [param, grad] of this._grads) {
      const g = out[grad].data, acc = this._accumulated[param];
      if (this._reset || !acc) this._accumulated[param] = Float32Array.from(g);
      else for (let i = 0; i < acc.length; i++) acc[i] = Math.fround(acc[i] + g[i]);
    }
    this._reset = false;
    return pick(out, Array.isArray(fetches) ? fetches : this.trainingOutputNames);
  }

  /** The next runTrainStep replaces the accumulated gradients instead of adding to them. */
  async lazyResetGrad() { this._reset = true; }

  /** One update of every trained parameter from its accumulated gradient (the optimizer model's AdamW or SGD). */
  async runOptimizerStep() {
    if (!this._optimizer) throw new Error("runOptimizerStep: no optimizerModel was given to create");
    const { kind, attributes: a } = this._optimizer, f = Math.fround, lr = this._lr, step = this._step + 1;
    const alpha = a.alpha ?? 0.9, beta = a.beta ?? 0.999, eps = a.epsilon ?? 1e-8, wd = a.weight_decay ?? 0;
    const mode = a.adam_mode ?? 0, correct = (a.correct_bias ?? 1) !== 0;
    const ac = correct ? f(1 - alpha ** step) : 1, bc = correct ? f(1 - beta ** step) : 1;
    const lrc = f(lr * f(f(Math.sqrt(bc)) / ac));
    for (const name of this._grads.keys()) {
      // NOTE: a copy: tensors handed out earlier (runTrainStep's feeds) keep their values
      const p = Float32Array.from(this._params[name].data), g = this._accumulated[name] ?? new Float32Array(p.length);
      const [m1, m2] = this._moments[name];
      for (let i = 0; i < p.length; i++) {
        if (kind === "SGD") { p[i] = f(p[i] - f(lr * g[i])); continue; }
        let w = p[i];
        if (mode === 0) w = f(w - f(f(w * lr) * wd));
        m1[i] = f(f(alpha * m1[i]) + f(f(1 - alpha) * g[i]));
        m2[i] = f(f(beta * m2[i]) + f(f(f(1 - beta) * g[i]) * g[i]));
        if (mode === 0) w = f(w - f(f(lr * m1[i]) / f(ac * f(f(Math.sqrt(f(m2[i] / bc))) + eps))));
        else {
          w = f(w - f(f(lrc * m1[i]) / f(f(Math.sqrt(m2[i])) + eps)));
          w = f(w - f(f(lr * wd) * w));
        }
        p[i] = w;
      }
      this._params[name].data = p;
    }
    this._step = step;
  }

  /** Forward and loss on a batch with the eval model; changes nothing. */
  async runEvalStep(feeds, fetches, options) {
    if (!this._eval) throw new Error("runEvalStep: no evalModel was given to create");
    const inputs = this._user(feeds, this.evalInputNames, "runEvalStep");
    for (const n of this._evalParams) inputs[n] = this._tensor(n);
    return pick(await this._eval.run(inputs, options), Array.isArray(fetches) ? fetches : this.evalOutputNames);
  }

  _names(trainableOnly) { return this._paramOrder.filter((n) => this._params[n].requiresGrad || !trainableOnly); }

  async getParametersSize(trainableOnly = true) {
    return this._names(trainableOnly).reduce((s, n) => s + this._params[n].data.length, 0);
  }

  /** The parameters flattened into one float32 tensor, in the training model's input order. */
  async getContiguousParameters(trainableOnly = false) {
    const size = await this.getParametersSize(trainableOnly), flat = new Float32Array(size);
    let at = 0;
    for (const n of this._names(trainableOnly)) { flat.set(this._params[n].data, at); at += this._params[n].data.length; }
    return new this.ort.Tensor("float32", flat, [size]);
  }

  /** Fills the parameters from one flat float32 buffer (the bytes of getContiguousParameters' data). */
  async loadParametersBuffer(buffer, trainableOnly = true) {
    const size = await this.getParametersSize(trainableOnly);
    const bytes = buffer instanceof Uint8Array ? buffer : new Uint8Array(buffer.buffer ?? buffer);
    if (bytes.byteLength !== size * 4) {
      throw new Error(`loadParametersBuffer: expected ${size * 4} bytes (${size} float32 parameters), got ${bytes.byteLength}`);
    }
    const flat = new Float32Array(bytes.slice().buffer);
    let at = 0;
    for (const n of this._names(trainableOnly)) {
      const count = this._params[n].data.length;
      this._params[n].data = flat.slice(at, at + count);
      at += count;
    }
    this._nominal = false;
  }

  setLearningRate(lr) { this._lr = Math.fround(lr); }
  getLearningRate() { return this._lr; }

  async release() {
    await this._train?.release();
    await this._eval?.release();
  }
}

function pick(out, names) {
  const missing = names.filter((n) => !(n in out));
  if (missing.length) throw new Error(`fetches: the model has no outputs ${JSON.stringify(missing)}`);
  return Object.fromEntries(names.map((n) => [n, out[n]]));
}
