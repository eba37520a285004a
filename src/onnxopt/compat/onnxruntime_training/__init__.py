"""onnxruntime-training's on-device training API on stock onnxruntime: replace ``onnxruntime.training`` by
``onnxopt.compat.onnxruntime_training`` in the imports (``artifacts``, ``api``, ``onnxblock``).

The files are onnxruntime's: artifacts written here train in its runtimes, and its artifacts and checkpoints
train here (docs/onnxruntime_training.md). Importing this package needs neither torch nor scikit-learn.
"""
