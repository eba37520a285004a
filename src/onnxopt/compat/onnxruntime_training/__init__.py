"""onnxruntime-training's on-device training API on stock onnxruntime."""
