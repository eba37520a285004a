// StepRunner: trains a step saved by onnxopt's TrainStep.save with the onnxruntime binding the caller loaded.
//
// The step's protocol (metadata "onnxopt.protocol", or the older "onnxopt.train_step" fields) names each input's
// role and which output replaces which input at the next step. onnxruntime's JS bindings take no feed for an
// initializer, so the model given to the session has the carried tensors (weights, optimizer state, running
// statistics, the step counter) as plain graph inputs; their initial values come from the file's initializers.
// Between steps the output tensors of one run are the inputs of the next: nothing is copied through JS arrays.
// A step saved by `ship.for_js` also holds its packed form ("onnxopt.packed"): the model Python's Runner runs on CPU
// with every carried tensor of the weights' type in one flat input "carry" and one output "carry.new". onnxruntime's
// JS bindings convert each input and output of a run (and onnxruntime-node copies each output into a new buffer), so
// W1-adam's 22 inputs and 20 outputs become 5 and 3; the weights and state are views of the carry.

import { readCheckpoint, writeCheckpoint } from "./checkpoint.js";
import * as pb from "./proto.js";
import { base64, describe, readBeside, readSource } from "./source.js";

const TRAIN_STEP = "onnxopt.train_step", PROTOCOL = "onnxopt.protocol", EPOCH = "onnxopt.epoch", PACKED = "onnxopt.packed";
const CARRIED = new Set(["weight", "state", "step", "buffer"]);
const NEW = ".new", STEP = "optim.step", CARRY = "carry";
const SMALL_STEP = 1_000_000;  // NOTE: parameters × batch below which one thread is faster (as Python's Runner)

/** The protocol of a step saved before "onnxopt.protocol" existed, from its TrainStep fields. */
function protocolFromFields(f, graphInputs) {
  const roles = new Map(f.inputs.map((n) => [n, "data"]));
  for (const [name, role] of [[f.target, "target"], [f.sample_weight, "sample_weight"], [f.output_grad, "output_grad"]]) {
    if (name) roles.set(name, role);
  }
  for (const n of f.weights) roles.set(n, "weight");
  for (const n of f.state) roles.set(n, n === STEP ? "step" : "state");
  for (const n of f.buffers ?? []) roles.set(n, "buffer");
  const inputs = [...graphInputs.filter((n) => roles.has(n)), ...[...roles.keys()].filter((n) => !graphInputs.includes(n))]
    .map((name) => ({ name, role: roles.get(name) }));
  const outputs = [{ name: f.loss, role: "loss" }, ...inputs.filter((i) => CARRIED.has(i.role))
    .map((i) => ({ name: i.name + NEW, role: i.role, feeds: i.name }))];
  return { version: 1, inputs, outputs, target_kind: f.target_kind ?? "float", classes: f.classes ?? null };
}

const shapeText = (dims) => `[${dims.map((d) => (d === null ? "?" : d)).join(", ")}]`;
const sizeOf = (dims) => dims.reduce((a, b) => a * b, 1);

/** Parses a saved step: its fields, protocol, the session model (carried tensors as inputs) and initial values. */
async function parseStep(bytes, base, options) {
  let top, props;
  try {
    top = pb.fields(bytes);
    props = pb.metadata(bytes);
  } catch (err) {
    throw new Error(`step: expected an ONNX model saved by onnxopt's TrainStep.save, got bytes that are not a ` +
      `protobuf message (${err.message})`);
  }
  if (!top.some((f) => f.field === 7 && f.wire === 2)) {
    throw new Error(`step: expected an ONNX model saved by onnxopt's TrainStep.save, got ${bytes.length} bytes ` +
      "without an ONNX graph");
  }
  if (!(TRAIN_STEP in props)) {
    throw new Error(`step: an ONNX model but not a train step saved by onnxopt (metadata "${TRAIN_STEP}" missing, ` +
      `found ${JSON.stringify(Object.keys(props))}); compile it first: onnxopt compile MODEL.onnx -o step.onnx`);
  }
  const fields = JSON.parse(props[TRAIN_STEP]);
  const graphBytes = pb.first(top, 7);
  const graphFields = pb.fields(graphBytes);
  const inputs = graphFields.filter((f) => f.field === 11).map((f) => pb.valueInfo(f.value));
  const protocol = PROTOCOL in props ? JSON.parse(props[PROTOCOL]) : protocolFromFields(fields, inputs.map((i) => i.name));
  if (protocol.version !== 1) {
    throw new Error(`step: metadata "${PROTOCOL}" has protocol version ${JSON.stringify(protocol.version)}, expected 1 ` +
      "(a newer onnxopt saved this step; update the onnxopt npm package)");
  }
  const carried = protocol.inputs.filter((i) => CARRIED.has(i.role)).map((i) => i.name);
  const carriedSet = new Set(carried), initial = {}, extern = options.externalData ?? {};
  const external = async (t) => {
    const file = extern[t.external.location] ?? await readBeside(base, t.external.location, "step");
    const src = file instanceof Uint8Array ? file : (await readSource(file, "options.externalData")).bytes;
    const [, Typed] = pb.DTYPES[t.elemType];
    const data = new Typed(t.external.length / Typed.BYTES_PER_ELEMENT);
    new Uint8Array(data.buffer).set(src.subarray(t.external.offset, t.external.offset + t.external.length));
    return data;
  };
  const parts = [];
  for (const f of graphFields) {
    if (f.field !== 5) { parts.push(pb.raw(graphBytes, f)); continue; }
    const name = pb.text(pb.first(pb.fields(f.value), 8) ?? new Uint8Array());
    if (!carriedSet.has(name) && pb.first(pb.fields(f.value), 14) !== 1) { parts.push(pb.raw(graphBytes, f)); continue; }
    const t = pb.tensor(f.value);
    if (t.external) t.data = await external(t);
    if (carriedSet.has(name)) initial[name] = t;  // NOTE: dropped from the graph: fed as an input instead
    else parts.push(pb.lenField(5, pb.encodeTensor(t.name, t.elemType, t.dims, t.data)));  // NOTE: inlined
  }
  const declared = new Map(inputs.map((i) => [i.name, i]));
  for (const name of carried) {  // NOTE: an initializer that is not also a graph input becomes one
    if (!declared.has(name) && initial[name]) {
      const t = initial[name];
      parts.push(pb.lenField(11, pb.encodeValueInfo(name, t.elemType, t.dims)));
      declared.set(name, { name, elemType: t.elemType, dims: t.dims });
    }
  }
  const graph = pb.concat(parts);
  const model = pb.rewriteModel(bytes, () => graph, (f) => f.field !== 14);  // NOTE: metadata stays out of ORT
  const epoch = EPOCH in props ? JSON.parse(props[EPOCH]) : null;
  const packed = PACKED in props ? JSON.parse(props[PACKED]) : null;
  return { fields, protocol, carried, initial, declared, model, epoch, packed, metadata: props };
}

export class StepRunner {
  /**
   * Loads a step written by onnxopt's `TrainStep.save` (or `onnxopt compile`) into a session of `ort`.
   * @param {object} ort the onnxruntime binding: `import * as ort from "onnxruntime-node"` or "onnxruntime-web"
   * @param {Uint8Array|ArrayBuffer|string|URL} step the saved step's bytes, path (Node) or URL
   * @param {object} [options] {sessionOptions, externalData: {location: bytes|path|URL}, batchSize}
   */
  static async create(ort, step, options = {}) {
    if (!ort || typeof ort.InferenceSession?.create !== "function" || typeof ort.Tensor !== "function") {
      throw new Error(`ort: expected an onnxruntime binding (import * as ort from "onnxruntime-node" or ` +
        `"onnxruntime-web"), got ${describe(ort)}`);
    }
    const { bytes, base } = await readSource(step, "step");
    const parsed = await parseStep(bytes, base, options);
    const runner = new StepRunner(ort, parsed, options);
    const packed = runner._packed;
    if (packed?.side) runner._side = await runner._open(base64(packed.side), "step");
    runner._session = packed && await runner._specialized();
    runner._general = runner._session ? null : runner._open(packed ? base64(packed.model) : parsed.model, "step");
    runner._session ??= await runner._general;
    const taken = new Set(runner._session.inputNames);  // NOTE: a counter the step does not read is no input
    runner._fed = Object.keys(runner._current).filter((n) => taken.has(n));
    return runner;
  }

  /** @private the packed model's session for unweighted batches of `batchSize` rows (as the Python Runner's): the
   * batch axis fixed and the values hoisted from the sample weights inlined, so a run converts fewer inputs
   * (onnxruntime-node: ~2-3 µs each). Other batches run the packed model as shipped. Null when the step hoists
   * nothing or onnxruntime refuses the specialized model. */
  async _specialized() {
    const w = this._names.w, rows = this.batchSize;
    if (!w || !Number.isInteger(rows) || rows < 1) return null;
    const values = await this._hoist({ [w]: this._onesOf(rows) }, rows);
    const x = this._names.x, model = pb.rewriteModel(base64(this._packed.model), (graph) => {
      const gf = pb.fields(graph), infos = gf.map((f) => (f.field === 11 ? pb.valueInfo(f.value) : null));
      const axis = infos.find((i) => i?.name === x)?.dims?.[0];
      return pb.concat(gf.map((f, k) => {
        const info = infos[k], t = info && values[info.name];
        if (t) return pb.lenField(5, pb.encodeTensor(info.name, pb.ONNX_TYPE[t.type], t.dims, t.data));
        if (!info || typeof axis !== "string" || !info.dims?.includes(axis)) return pb.raw(graph, f);
        return pb.lenField(11, pb.encodeValueInfo(info.name, info.elemType, info.dims.map((d) => (d === axis ? rows : d))));
      }));
    });
    try {
      const session = await this._open(model, "step");
      this._fixedRows = rows;
      return session;
    } catch {
      return null;  // NOTE: the packed model as shipped says what is wrong, if anything
    }
  }

  /** @private */
  constructor(ort, parsed, options) {
    Object.assign(this, { ort, _p: parsed, _options: options, _epochSession: null });
    const { protocol, fields } = parsed;
    const role = (r) => protocol.inputs.filter((i) => i.role === r).map((i) => i.name);
    const data = role("data");
    this.dataNames = data;
    this.weightNames = role("weight");
    this.stateNames = [...role("buffer"), ...role("state"), ...role("step")];
    this._names = { x: data[0], y: role("target")[0] ?? null, w: role("sample_weight")[0] ?? null,
      g: role("output_grad")[0] ?? null };
    this._loss = protocol.outputs.find((o) => o.role === "loss").name;
    this.targetKind = protocol.target_kind;
    this.batchSize = options.batchSize ?? 32;
    this._fields = fields;
    this._ones = new Map();
    this._hoisted = new Map();
    // NOTE: the packed form keeps its carry on the CPU: a binding told to leave outputs on a device runs the step as saved
    const packed = options.packed !== false && !options.sessionOptions?.preferredOutputLocation ? parsed.packed : null;
    this._packed = packed?.version === 1 ? packed : null;
    const initial = Object.fromEntries(parsed.carried.map((n) => [n, this._initialTensor(n)]));
    this.dtype = initial[this.weightNames[0]]?.type ?? "float32";
    // NOTE: groups: the session's carried inputs, each with the output that replaces it and the tensors it holds
    this._groups = {};
    this._where = {};
    this._current = {};
    const layout = this._packed?.carry ?? [];
    if (layout.length) {
      const size = layout.reduce((n, [, offset, dims]) => Math.max(n, offset + sizeOf(dims)), 0) +
        (this._packed.loss_at === null ? 0 : 1);
      const data = new (initial[layout[0][0]].data.constructor)(size);
      for (const [name, offset, dims] of layout) {
        data.set(initial[name].data, offset);
        this._where[name] = { group: CARRY, offset, dims, size: sizeOf(dims) };
      }
      this._groups[CARRY] = CARRY + NEW;
      this._current[CARRY] = new this.ort.Tensor(this.dtype, data, [size]);
    }
    for (const name of parsed.carried.filter((n) => !(n in this._where))) {
      // NOTE: a counted step counter (the packed form's "counted") is advanced here, not fetched
      if (!(name === STEP && this._packed?.counted)) {
        this._groups[name] = this._packed ? name + NEW : protocol.outputs.find((o) => o.feeds === name).name;
      }
      this._where[name] = { group: name };
      this._current[name] = initial[name];
    }
    const at = this._packed?.loss_at ?? null;
    this._fetches = [...(at === null ? [this._loss] : []), ...Object.values(this._groups)];
  }

  /** @private the carried tensor `name` (a weight, a state): a view of the carry that holds it, no copy. */
  _tensor(name) {
    const w = this._where[name], t = this._current[w.group];
    return w.dims ? new this.ort.Tensor(t.type, t.data.subarray(w.offset, w.offset + w.size), w.dims) : t;
  }

  /** @private makes `values` ({name: TypedArray}) current: a carry that holds one is copied, then written. */
  _assign(values) {
    const next = {};
    for (const [name, data] of Object.entries(values)) {
      const w = this._where[name];
      if (!w.dims) {
        next[name] = new this.ort.Tensor(this._current[name].type, data, this._current[name].dims);
        continue;
      }
      const t = next[w.group] ??= new this.ort.Tensor(this._current[w.group].type, this._current[w.group].data.slice(),
        this._current[w.group].dims);
      t.data.set(data, w.offset);
    }
    this._replace(next);
  }

  /** @private */
  _initialTensor(name) {
    const { initial, declared } = this._p;
    const t = initial[name];
    if (t) return new this.ort.Tensor(pb.DTYPES[t.elemType][0], t.data, t.dims);
    // NOTE: optimizer state and the step counter start at zero, shaped as declared or as their weight (W.<state>)
    const info = declared.get(name);
    let dims = info?.dims;
    if (!dims || dims.some((d) => typeof d !== "number")) {
      const owner = initial[name.slice(0, name.lastIndexOf("."))];
      if (!owner) throw new Error(`step: input ${JSON.stringify(name)} has no initial value and no static shape`);
      dims = owner.dims;
    }
    const elemType = info?.elemType || (name === STEP ? 7 : 1);
    const [type, Typed] = pb.DTYPES[elemType];
    return new this.ort.Tensor(type, new Typed(sizeOf(dims)), dims);
  }

  /** @private */
  async _open(model, what) {
    const params = Object.values(this._p.initial).reduce((n, t) => n + t.data.length, 0);
    const defaults = { graphOptimizationLevel: "all", executionMode: "sequential", logSeverityLevel: 3 };
    if (params * this.batchSize < SMALL_STEP) defaults.intraOpNumThreads = 1;
    try {
      return await this.ort.InferenceSession.create(model, { ...defaults, ...this._options.sessionOptions });
    } catch (err) {
      const msg = String(err?.message ?? err);
      const missing = /implementation for (\w+)\((\d+)\) node with name '([^']*)'/.exec(msg) ??
        /(?:[\w.]+:)?(\w+)\(-?\d+\) is not a registered function\/op/.exec(msg) ??
        /(?:unsupported|not supported|No Op registered for) (\w+)/i.exec(msg);
      if (missing) {
        throw new Error(`${what}: this onnxruntime binding has no kernel for the op ${missing[1]}` +
          (missing[3] !== undefined ? ` (opset ${missing[2]}, node ${JSON.stringify(missing[3])})` : "") +
          `, which the step uses; expected a binding that runs every op of the step (onnxruntime-node or ` +
          `onnxruntime-web's wasm backend run standard ONNX; compile with portable=True), got: ${msg}`);
      }
      throw new Error(`${what}: onnxruntime could not load the step: ${msg}`);
    }
  }

  /** Steps completed so far (the step counter the step carries). */
  get stepCount() {
    return this._where[STEP] ? Number(this._tensor(STEP).data[0]) : 0;
  }

  /** @private checks one batch tensor against the step's input `name`. */
  _check(value, name, label, rows) {
    if (!(value instanceof this.ort.Tensor)) {
      throw new Error(`${label}: expected an ort.Tensor for input ${JSON.stringify(name)}, got ${describe(value)}`);
    }
    const info = this._p.declared.get(name);
    const type = info && pb.DTYPES[info.elemType]?.[0];
    const dims = info?.dims;
    const got = () => `${value.type}${shapeText(value.dims)}`;  // NOTE: messages are built only on an error
    const fail = () => new Error(`${label}: input ${JSON.stringify(name)} expected ` +
      `${type ?? "any type"}${dims ? shapeText(dims) : ""}, got ${got()}`);
    if (type && value.type !== type) throw fail();
    if (rows !== undefined && value.dims[0] !== rows) {
      throw new Error(`${label}: input ${JSON.stringify(name)} expected ${rows} rows (one per sample of X), got ${got()}`);
    }
    if (dims && (dims.length !== value.dims.length || dims.some((d, i) => typeof d === "number" && d !== value.dims[i]))) {
      throw fail();
    }
  }

  /** @private the feeds of one batch, checked: X is a tensor, or {name: tensor} for a step with several data
   * inputs; `outputGrad` feeds a step compiled with external_grad=True. */
  _batch(X, y, sampleWeight, outputGrad) {
    const { y: yName, w, g } = this._names, names = this.dataNames;
    const single = names.length === 1 && X?.constructor !== Object;
    if (!single && (X?.constructor !== Object || names.some((k) => !(k in X)) || Object.keys(X).length !== names.length)) {
      throw new Error(`X: the step reads the data inputs ${JSON.stringify(names)}, expected {name: ort.Tensor} with ` +
        `each of them, got ${X?.constructor === Object ? JSON.stringify(Object.keys(X)) : describe(X)}`);
    }
    const feeds = {};
    let n;
    for (const name of names) {
      const label = names.length === 1 ? "X" : `X.${name}`, value = single ? X : X[name];
      this._check(value, name, label, n);
      n ??= value.dims[0];
      if (!n) throw new Error(`${label}: expected at least one sample, got ${value.type}${shapeText(value.dims)}`);
      feeds[name] = value;
    }
    if (yName) {
      if (y === undefined || y === null) throw new Error(`y: the step's loss needs targets for ${JSON.stringify(yName)}, got ${y}`);
      if (this.targetKind === "index" && y instanceof this.ort.Tensor && y.type === "int32") {
        y = new this.ort.Tensor("int64", BigInt64Array.from(y.data, BigInt), y.dims);  // NOTE: class indices
      }
      this._check(y, yName, "y", n);
      feeds[yName] = y;
    } else if (y !== undefined && y !== null) {
      throw new Error(`y: the step takes no targets (${g ? "it reads the output gradient: pass { outputGrad }" :
        "its loss reads none"}), got ${describe(y)}`);
    }
    if (w && (sampleWeight === undefined || sampleWeight === null)) {
      feeds[w] = this._onesOf(n);  // NOTE: made here, of the declared type
    } else if (w) {
      this._check(sampleWeight, w, "sampleWeight", n);
      if (sampleWeight.dims.length !== 1) {
        throw new Error(`sampleWeight: expected shape [${n}] (one weight per sample), got ${shapeText(sampleWeight.dims)}`);
      }
      feeds[w] = sampleWeight;
    } else if (sampleWeight !== undefined && sampleWeight !== null) {
      throw new Error("sampleWeight: the step's loss takes no sample weights, got a tensor");
    }
    if ((g === null) !== (outputGrad === undefined || outputGrad === null)) {
      throw new Error(`outputGrad: the step takes ${g ? JSON.stringify(g) : "no output gradient"} (compiled ` +
        `${g ? "with" : "without"} external_grad=True), got ${describe(outputGrad)}`);
    }
    if (g) {
      this._check(outputGrad, g, "outputGrad", n);
      feeds[g] = outputGrad;
    }
    return feeds;
  }

  /** @private */
  _onesOf(n) {
    if (!this._ones.has(n)) {
      const type = pb.DTYPES[this._p.declared.get(this._names.w)?.elemType ?? 1][0];
      const Typed = type === "float64" ? Float64Array : Float32Array;
      this._ones.set(n, new this.ort.Tensor(type, new Typed(n).fill(1), [n]));
    }
    return this._ones.get(n);
  }

  /** @private runs `session`, turning onnxruntime's refusal into an error naming the batch. */
  async _run(session, feeds, fetches, batch) {
    try {
      return await session.run(feeds, fetches);
    } catch (err) {
      const given = Object.entries(batch).map(([n, t]) => `${n}${shapeText(t.dims)} ${t.type}`).join(", ");
      const expected = Object.keys(batch).map((n) => {
        const i = this._p.declared.get(n);
        return `${n}${i?.dims ? shapeText(i.dims) : ""} ${i ? pb.DTYPES[i.elemType]?.[0] : "?"}`;
      }).join(", ");
      throw new Error(`batch: onnxruntime refused it (${String(err?.message ?? err).split("\n")[0]}); expected ` +
        `${expected}, got ${given}`);
    }
  }

  /**
   * One training step on a batch: forward, loss, backward and update in one session run.
   * @param {object} X ort.Tensor, rows first
   * @param {object} [y] ort.Tensor of targets (int64 or int32 class indices for a classification loss)
   * @param {object} [sampleWeight] ort.Tensor [rows]
   * @param {object} [options] {outputGrad}: the gradient on the output, for a step compiled with external_grad=True
   *   (its loss is then the penalty alone), as Python's `Runner.step(X, output_grad=...)`
   * @returns {Promise<number>} the loss; a NaN or infinite loss throws and keeps the weights before the step
   */
  async step(X, y, sampleWeight, { outputGrad } = {}) {
    const batch = this._batch(X, y, sampleWeight, outputGrad);
    const { session, feeds } = await this._feeds(batch, sampleWeight);
    const at = this._packed?.loss_at ?? null;
    const out = await this._run(session, feeds, this._fetches, batch);
    const lossTensor = out[at === null ? this._loss : CARRY + NEW];
    const loss = Number((lossTensor.location && lossTensor.location !== "cpu" ? await lossTensor.getData() : lossTensor.data)[at ?? 0]);
    if (!Number.isFinite(loss)) {
      throw new Error(`loss became ${loss} at step ${this.stepCount + 1}; the weights were kept as they were ` +
        "before it (see getWeights()): lower the learning rate or check the data for extreme values");
    }
    const next = {};
    for (const [name, output] of Object.entries(this._groups)) next[name] = out[output];
    if (this._packed?.counted) next[STEP] = new this.ort.Tensor("int64", BigInt64Array.of(this._current[STEP].data[0] + 1n), []);
    this._replace(next);
    return loss;
  }

  /** @private the session a checked `batch` runs on and its feeds, the carried tensors included. */
  async _feeds(batch, sampleWeight) {
    let session = this._session, feeds = batch;
    if (this._packed) {
      feeds = this._packedFeeds(batch);
      const n = batch[this._names.x].dims[0], usual = n === this._fixedRows && !sampleWeight;
      if (this._fixedRows !== undefined && !usual) session = await (this._general ??= this._open(base64(this._packed.model), "step"));
      if (this._names.w && !usual) {  // NOTE: a side run only for a new batch length or given sample weights
        Object.assign(feeds, (!sampleWeight && this._hoisted.get(n)) || await this._hoist(batch, n, sampleWeight));
      }
    }
    for (const name of this._fed) feeds[name] = this._current[name];
    return { session, feeds };
  }

  /** @private the packed model's feeds for `batch`: the target shaped like the prediction, the sample weights
   * left for `_hoist`. */
  _packedFeeds(batch) {
    const { x, y, w } = this._names, shape = this._packed.target_shape, feeds = { ...batch };
    if (y && shape) feeds[y] = new this.ort.Tensor(batch[y].type, batch[y].data, [batch[x].dims[0], ...shape]);
    if (w) delete feeds[w];
    return feeds;
  }

  /** @private what the packed model reads in place of the sample weights: the values the side model computes from
   * them (Python's `runner.cpu_model` hoists them), kept per batch length when none are given. */
  async _hoist(batch, n, sampleWeight) {
    const w = this._names.w, values = this._side ? await this._side.run({ [w]: batch[w] }, this._packed.hoisted) : {};
    if (this._packed.weight_kept) values[w] = batch[w];
    if (!sampleWeight) this._hoisted.set(n, values);
    return values;
  }

  /** @private makes `next` current; tensors held on a device (not by JS) are released. */
  _replace(next) {
    for (const name in next) {
      const t = this._current[name];
      if (t.location && t.location !== "cpu" && next[name] !== t) t.dispose();
      this._current[name] = next[name];
    }
  }

  /** @private a view of rows [a, b) of `t`, no copy. */
  _rows(t, a, b, lead = [b - a]) {
    const row = t.dims.slice(1).reduce((p, q) => p * q, 1);
    return new this.ort.Tensor(t.type, t.data.subarray(a * row, b * row), [...lead, ...t.dims.slice(1)]);
  }

  /**
   * `step` over the batches of `X` in order, `batchSize` rows each (the last may be shorter); returns their
   * losses. A step saved with its epoch form (onnxopt.ship.with_epoch, `onnxopt compile --epoch`) runs the full
   * batches in one session run (an ONNX Scan), giving the losses of one step per batch.
   * @returns {Promise<Float64Array>}
   */
  async epoch(X, y, { batchSize = this.batchSize, sampleWeight, outputGrad } = {}) {
    const all = this._batch(X, y, sampleWeight, outputGrad);  // NOTE: the whole epoch is checked before any step runs
    const n = all[this._names.x].dims[0];
    if (!Number.isInteger(batchSize) || batchSize < 1) throw new Error(`batchSize: expected a positive integer, got ${batchSize}`);
    const full = Math.floor(n / batchSize);
    let losses = [];
    if (this._p.epoch && full > 1 && !sampleWeight && this.dataNames.length === 1 && this._names.y) {
      losses = await this._scan(all[this._names.x], all[this._names.y], full, batchSize);
    }
    for (let start = losses.length * batchSize; start < n; start += batchSize) {
      const end = Math.min(n, start + batchSize), part = (t) => (t ? this._rows(t, start, end) : t);
      const xs = Object.fromEntries(this.dataNames.map((name) => [name, part(all[name])]));
      try {
        losses.push(await this.step(xs, part(all[this._names.y]), part(sampleWeight),
          { outputGrad: part(all[this._names.g]) }));
      } catch (err) {
        throw new Error(`batch ${losses.length + 1}: ${err.message}`);
      }
    }
    return Float64Array.from(losses);
  }

  /** @private full batches as one Scan run (passes/epoch.py); [] on a non-finite value (epoch replays them). */
  async _scan(X, y, steps, batch) {
    const { model, carried } = this._p.epoch;
    if (!this._epochSession) {
      this._epochSession = await this._open(base64(model), "epoch");
      this._epochInputs = new Set(this._epochSession.inputNames);
    }
    const P = "epoch.", cut = (steps - 1) * batch, feeds = {};
    for (const [name, t] of [[this._names.x, X], [this._names.y, y]]) {
      feeds[P + name] = this._rows(t, 0, cut, [steps - 1, batch]);
      feeds[P + name + ".last"] = this._rows(t, cut, cut + batch);
    }
    for (const name of carried) feeds[P + name] = this._tensor(name);
    if (this._names.w) feeds[this._names.w] = this._onesOf(batch);
    if (this._epochInputs.has(P + "count")) feeds[P + "count"] = new this.ort.Tensor("int64", BigInt64Array.of(BigInt(steps - 1)), []);
    const fetches = [P + "losses", P + "check", ...carried.map((c) => P + c + NEW)];
    const out = await this._run(this._epochSession, feeds, fetches, { [this._names.x]: X });
    if (!Number.isFinite(Number(out[P + "check"].data[0]))) return [];
    this._assign(Object.fromEntries(carried.map((c) => [c, out[P + c + NEW].data])));
    return Array.from(out[P + "losses"].data, Number);
  }

  /** The current weights, {name: ort.Tensor}; the runner never writes into them (a step makes new ones). */
  getWeights() {
    return Object.fromEntries(this.weightNames.map((n) => [n, this._tensor(n)]));
  }

  /** Optimizer state, running statistics and the step counter ("optim.step"), {name: ort.Tensor}. */
  getState() {
    return Object.fromEntries(this.stateNames.map((n) => [n, this._tensor(n)]));
  }

  /** Replaces some or all weights: {name: ort.Tensor | TypedArray} of the weight's shape and type. */
  setWeights(values) { this._set(values, this.weightNames, "weights"); }

  /** Replaces some or all of the state (getState's names). */
  setState(values) { this._set(values, this.stateNames, "state"); }

  /** @private */
  _set(values, names, what) {
    const next = {};
    for (const [name, value] of Object.entries(values)) {
      if (!names.includes(name)) throw new Error(`${what}: ${JSON.stringify(name)} is not one of ${JSON.stringify(names)}`);
      const ref = this._tensor(name);
      const isTensor = value instanceof this.ort.Tensor, data = isTensor ? value.data : value;
      const got = isTensor ? `${value.type}${shapeText(value.dims)}` : `a ${value?.constructor?.name} of ${data?.length} values`;
      const ok = data?.constructor === ref.data.constructor && data.length === ref.data.length &&
        (!isTensor || shapeText(value.dims) === shapeText(ref.dims));
      if (!ok) throw new Error(`${what}: ${JSON.stringify(name)} expected ${ref.type}${shapeText(ref.dims)}, got ${got}`);
      next[name] = data.slice();  // NOTE: a copy: the caller keeps its array
    }
    this._assign(next);
  }

  /**
   * Weights, state and step count in onnxopt's checkpoint format (Python: `Runner.load_checkpoint(path)`).
   * @param {object} [meta] JSON values stored with them
   * @returns {Promise<Uint8Array>}
   */
  async saveCheckpoint(meta = {}) {
    return writeCheckpoint({ ...this.getWeights(), ...this.getState() },
      { kind: "onnxopt.Runner", step: this.stepCount, ...meta });
  }

  /**
   * Restores a checkpoint written by `saveCheckpoint` or Python's `Runner.save_checkpoint` (bytes, path or URL);
   * it is verified whole (checksum, names, shapes, types) before anything changes. Returns its metadata.
   */
  async loadCheckpoint(source, { kind } = {}) {
    const { bytes } = await readSource(source, "checkpoint");
    const { arrays, meta } = await readCheckpoint(bytes);
    const expected = [...this.weightNames, ...this.stateNames];
    const missing = expected.filter((n) => !(n in arrays)), extra = Object.keys(arrays).filter((n) => !expected.includes(n));
    if (missing.length || extra.length) {
      throw new Error(`checkpoint: holds the ${Object.keys(arrays).length} arrays of another model or optimizer, ` +
        `expected ${expected.length} (missing ${JSON.stringify(missing.slice(0, 3))}, unexpected ` +
        `${JSON.stringify(extra.slice(0, 3))}); nothing was loaded`);
    }
    for (const name of expected) {
      const a = arrays[name], ref = this._tensor(name);
      if (a.type !== ref.type || shapeText(a.dims) !== shapeText(ref.dims)) {
        throw new Error(`checkpoint: array ${JSON.stringify(name)} is ${a.type}${shapeText(a.dims)}, expected ` +
          `${ref.type}${shapeText(ref.dims)}; nothing was loaded`);
      }
    }
    if (kind !== undefined && meta.kind !== kind) throw new Error(`checkpoint: written by ${JSON.stringify(meta.kind)}, expected ${JSON.stringify(kind)}`);
    this._assign(Object.fromEntries(expected.map((n) => [n, arrays[n].data])));
    return meta;
  }

  /**
   * The inference model the step was compiled from, with the trained weights (and running statistics) written
   * into its initializers, as Python's `Runner.export`.
   * @returns {Promise<Uint8Array>}
   */
  async export() {
    const inference = base64(this._fields.inference ?? "");
    if (!inference.length) throw new Error("export: the step holds no inference model (saved without one)");
    const values = {};
    for (const name of [...this.weightNames, ...this.stateNames.filter((n) => this._p.protocol.inputs
      .some((i) => i.name === n && i.role === "buffer"))]) {
      const t = this._tensor(name);
      values[name] = { t, data: t.location && t.location !== "cpu" ? await t.getData() : t.data };
    }
    const graph = (g) => {
      const parts = [];
      for (const f of pb.fields(g)) {
        const name = f.field === 5 ? pb.text(pb.first(pb.fields(f.value), 8) ?? new Uint8Array()) : null;
        if (name !== null && name in values) {
          const { t, data } = values[name];
          parts.push(pb.lenField(5, pb.encodeTensor(name, pb.ONNX_TYPE[t.type], t.dims, data)));
        } else parts.push(pb.raw(g, f));
      }
      return pb.concat(parts);
    };
    return pb.rewriteModel(inference, graph);
  }

  /** Releases the sessions. */
  async release() {
    await this._session?.release();
    const general = await this._general;
    if (general && general !== this._session) await general.release();
    await this._epochSession?.release();
    await this._side?.release();
  }
}
