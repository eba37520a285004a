"""Graph passes of the compiler, one idea per module, each ``ir.Model -> ir.Model`` in the onnx-ir style.

- ``decompose``: ops the gradient builder lacks or gets wrong, rewritten into differentiable standard ONNX
  (the rewrites the ``onnxopt.autodiff`` family modules register);
- ``modes``: training and evaluation mode (Dropout, BatchNormalization) before differentiation;
- ``lower``: training-only ops of the builder's backward graph lowered to standard ONNX (portable steps).
- ``update``: multi-tensor updates (one elementwise rule over all weights concatenated) and the Runner's
  flat layout of them;
- ``fuse_update``: rewrite rules folding the update into the kernels around it (SGD into the gradient Gemm).
- ``products``: a Transpose of a matrix product moved onto its operands, where it cancels or fuses into it;
- ``kernels``: built-in update rules run by onnxruntime-training's optimizer kernels (non-portable steps);
- ``batch``: the Runner's CPU model specialized for how it feeds a batch (targets, sample weights);
- ``epoch``: that model as the body of an ONNX Scan over an epoch's batches (``Runner.epoch``).
- ``unread``: initializers no node reads removed (end of compilation, the epoch and side models).
"""
