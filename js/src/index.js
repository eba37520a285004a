// onnxopt for JavaScript: train steps compiled by onnxopt (Python) with any onnxruntime binding.
export { StepRunner } from "./runner.js";
export { readCheckpoint, writeCheckpoint } from "./checkpoint.js";
export { readOrtCheckpoint, TrainingSession } from "./training.js";
