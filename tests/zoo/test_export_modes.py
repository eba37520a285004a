"""Runner.export() writes a valid model in both modes for every zoo model.

The zoo's ``test_exported_model_predicts_better`` checks each export in the mode it was exported in
(``assert_same_outputs``: onnx's full checker, then an InferenceSession). The mode changes the compiled step
only where BatchNormalization or Dropout stay in the graph, which happens in the TorchScript exports of the
stateful models alone (dynamo folds BatchNorm and drops Dropout): those are checked here in the other mode.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import onnxopt
from zoo import models, models_more
from zoo.common import assert_same_outputs, predict

CASES = [(zoo, name, exporter) for zoo, specs in ((models, models.TORCH_MODELS), (models_more, models_more.MODELS))
         for name, spec in specs.items() if spec.stateful for exporter in ("script", "script_train")]


@pytest.mark.parametrize(("zoo", "name", "exporter"), CASES, ids=lambda v: getattr(v, "__name__", v).split(".")[-1])
def test_export_in_the_other_mode_is_valid(zoo, name, exporter):
    model = zoo.exported(name, exporter, 0.0 if exporter == "script_train" else None)
    mode = "eval" if exporter == "script_train" else "train"  # NOTE: the other mode than the export's
    step = onnxopt.compile_train_step(model, mode=mode, loss=zoo.loss_name(name), learning_rate=0.01)
    runner = onnxopt.Runner(step)
    X, y = zoo.make_data(name, n=16)
    runner.step(X, y)
    exported = runner.export()
    assert_same_outputs(model, exported)
    assert np.isfinite(predict(exported, X)).all()
    stats = set(step.buffers)  # NOTE: mode="train" writes the moved running statistics into the export
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in exported.graph.initializer}
    for name_, value in {**runner.get_weights(), **{k: v for k, v in runner.get_state().items() if k in stats}}.items():
        np.testing.assert_array_equal(inits[name_], value)
