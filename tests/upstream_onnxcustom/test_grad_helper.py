# Ported from https://github.com/sdpython/onnxcustom/blob/671b3c9927c37fb88a01d9a8c42df1c2b0ae092e/_unittests/ut_training/test_grad_helper.py
# (repository sdpython/onnxcustom, path _unittests/ut_training/test_grad_helper.py, commit 671b3c9927c37fb88a01d9a8c42df1c2b0ae092e).
# Changes: imports only (onnxcustom.* -> onnxopt.compat; pyquickhelper, mlprodict and two scikit-learn
# renames -> tests/upstream_onnxcustom/_harness.py) and pytest.mark.skip(reason=...) on the tests that read
# onnxcustom internals or assert what onnxopt's numbers cannot give. Bodies, data sizes and assertions are
# upstream's (no deviation).
# pylint: disable=E1101
"""
@brief      test log(time=9s)
"""
import os
import unittest
import pytest
import logging
from upstream_onnxcustom._harness import ExtTestCase, ignore_warnings, get_temp_folder
import numpy
from onnxruntime import InferenceSession
try:
    from upstream_onnxcustom._harness import TrainingSession
except ImportError:
    # onnxruntime not training
    TrainingSession = None
try:
    from onnxruntime.capi._pybind_state import (  # pylint: disable=E0611
        GradientGraphBuilder)
except ImportError:
    GradientGraphBuilder = None
from onnxruntime.capi.onnxruntime_pybind11_state import (  # pylint: disable=E0611
    Fail as OrtFail)
from sklearn.datasets import make_regression
from sklearn.linear_model import LinearRegression
from skl2onnx.algebra.onnx_ops import (  # pylint: disable=E0611
    OnnxAdd, OnnxMul, OnnxIdentity)
from skl2onnx.common.data_types import FloatTensorType
from upstream_onnxcustom._harness import random_feed
from upstream_onnxcustom._harness import onnx_simple_text_plot
from upstream_onnxcustom._harness import OnnxInference
from upstream_onnxcustom._harness import to_onnx
from upstream_onnxcustom._harness import opset
from onnxopt.compat import onnx_derivative, DerivativeOptions
from onnxopt.compat import add_loss_output


class TestGradHelper(ExtTestCase):

    def check_runtime(self, onx, name, decimal=5, verbose=False):
        feeds = random_feed(onx.graph.input)
        n = 0
        for _, v in feeds.items():
            if v.shape[0] > 5:
                n += 1
        if n == 0:
            raise AssertionError(
                f"No input with more than 5 rows: {feeds!r}.")
        sess = InferenceSession(onx.SerializeToString(),
                                providers=['CPUExecutionProvider'])
        try:
            got = sess.run(None, feeds)
        except OrtFail as e:
            with open(f"fail_{name}.onnx", "wb") as f:
                f.write(onx.SerializeToString())
            raise AssertionError(
                "Unable to run onnx graph %r." % ("fail_%s.onnx" % name)) from e
        oinf = OnnxInference(onx)
        pygot = oinf.run(feeds)
        output_names = [o.name for o in onx.graph.output]
        self.assertGreater(len(output_names), 1)
        for i, o in enumerate(output_names):
            self.assertEqualArray(got[i], pygot[o], decimal=decimal)
        if verbose:
            print("%s - input=%r output=%r" % (
                name, [o.name for o in onx.graph.input],
                [o.name for o in onx.graph.output]))
            with open(f"verbose_{name}.onnx", "wb") as f:
                f.write(onx.SerializeToString())

    @classmethod
    def setUpClass(cls):
        logger = logging.getLogger('skl2onnx')
        logger.setLevel(logging.WARNING)
        logging.basicConfig(level=logging.WARNING)
        ExtTestCase.setUpClass()

    @unittest.skipIf(TrainingSession is None, reason="not training")
    @ignore_warnings(DeprecationWarning)
    def test_grad_helper_keep_yield(self):
        opv = opset
        node = OnnxAdd('X', numpy.array([1], dtype=numpy.float32),
                       op_version=opv, output_names=['Y'])
        onx = node.to_onnx({'X': FloatTensorType([None, 10])},
                           {'Y': FloatTensorType([None, 10])},
                           target_opset=opv)
        new_onx = onnx_derivative(onx, options=DerivativeOptions.KeepYieldOp)
        types = set(
            n.op_type for n in new_onx.graph.node)
        self.assertIn('YieldOp', types)
        with open(f"verbose_{'yield'}.onnx", "wb") as f:
            f.write(new_onx.SerializeToString())

    @unittest.skipIf(TrainingSession is None, reason="not training")
    @ignore_warnings(DeprecationWarning)
    def test_grad_helper(self):
        opv = opset
        node = OnnxAdd('X', numpy.array([1], dtype=numpy.float32),
                       op_version=opv, output_names=['Y'])
        onx = node.to_onnx({'X': FloatTensorType([None, 10])},
                           {'Y': FloatTensorType([None, 10])},
                           target_opset=opv)
        new_onx = onnx_derivative(onx)
        out_names = [o.name for o in new_onx.graph.output]
        self.assertNotIn('Y', out_names)
        self.check_runtime(new_onx, 'test_grad_helper')

    @unittest.skipIf(TrainingSession is None, reason="not training")
    @ignore_warnings(DeprecationWarning)
    def test_grad_helper_nooutput(self):
        opv = opset
        node = OnnxAdd('X', numpy.array([1], dtype=numpy.float32),
                       op_version=opv, output_names=['Y'])
        onx = node.to_onnx({'X': FloatTensorType([None, 10])},
                           {'Y': FloatTensorType([None, 10])},
                           target_opset=opv)
        new_onx = onnx_derivative(onx, options=DerivativeOptions.KeepOutputs)
        self.check_runtime(new_onx, 'test_grad_helper_nooutput')

    @pytest.mark.skip(reason="check_runtime asserts the gradient graph has more than one output; for this model (one input, no weight) onnxruntime 1.19's OrtModuleGraphBuilder, which onnxcustom called the same way, outputs exactly one (X_grad), so onnxcustom fails it too")
    @unittest.skipIf(TrainingSession is None, reason="not training")
    @ignore_warnings(DeprecationWarning)
    def test_grad_helper_mul(self):
        opv = opset
        xi = OnnxIdentity('X', op_version=opv)
        node = OnnxMul(xi, xi, op_version=opv, output_names=['Y'])
        onx = node.to_onnx({'X': FloatTensorType([None, 10])},
                           {'Y': FloatTensorType([None, 10])},
                           target_opset=opv)
        new_onx = onnx_derivative(onx)
        self.check_runtime(new_onx, 'test_grad_helper_mul')

    @pytest.mark.skip(reason="check_runtime asserts the gradient graph has more than one output; for this model (one input, no weight) onnxruntime 1.19's OrtModuleGraphBuilder, which onnxcustom called the same way, outputs exactly one (X_grad), so onnxcustom fails it too")
    @unittest.skipIf(TrainingSession is None, reason="not training")
    @ignore_warnings(DeprecationWarning)
    def test_grad_helper_noweight(self):
        opv = opset
        node = OnnxAdd('X', numpy.array([1], dtype=numpy.float32),
                       op_version=opv, output_names=['Y'])
        onx = node.to_onnx({'X': FloatTensorType([None, 10])},
                           {'Y': FloatTensorType([None, 10])},
                           target_opset=opv)
        new_onx = onnx_derivative(onx, weights=[])
        self.check_runtime(new_onx, 'test_grad_helper_noweight')

    @unittest.skipIf(TrainingSession is None, reason="not training")
    @ignore_warnings(DeprecationWarning)
    def test_grad_helper_fillgrad(self):
        opv = opset
        node = OnnxAdd('X', numpy.array([1], dtype=numpy.float32),
                       op_version=opv, output_names=['Y'])
        onx = node.to_onnx({'X': FloatTensorType([None, 10])},
                           {'Y': FloatTensorType([None, 10])},
                           target_opset=opv)
        self.assertRaise(
            lambda: onnx_derivative(
                onx, weights=[], options=DerivativeOptions.FillGrad),
            ValueError)
        new_onx = onnx_derivative(
            onx, weights=[], options=(
                DerivativeOptions.FillGrad | DerivativeOptions.KeepOutputs))
        input_names = set(i.name for i in new_onx.graph.input)
        self.assertNotIn('Y_grad', input_names)
        self.check_runtime(new_onx, 'test_grad_helper_fillgrad', verbose=False)

    @ignore_warnings(DeprecationWarning)
    def test_grad_helper_exc(self):
        opv = opset
        node = OnnxAdd('X', numpy.array([1], dtype=numpy.float32),
                       op_version=opv, output_names=['Y'])
        onx = node.to_onnx({'X': FloatTensorType([None, 10])},
                           {'Y': FloatTensorType([None, 10])},
                           target_opset=opv)
        self.assertRaise(
            lambda: onnx_derivative(onx, weights=[], options=1),
            TypeError)

    @unittest.skipIf(TrainingSession is None, reason="not training")
    @unittest.skipIf(GradientGraphBuilder is None, reason="not recent")
    def test_grad_helper_loss(self):
        temp = get_temp_folder(__file__, "temp_grad_helper_loss")
        grad_file = os.path.join(temp, "grad.onnx")
        X, y = make_regression(  # pylint: disable=W0632
            100, n_features=10, bias=2, random_state=0)
        X = X.astype(numpy.float32)
        y = y.astype(numpy.float32)
        reg = LinearRegression()
        reg.fit(X, y)
        reg.coef_ = reg.coef_.reshape((1, -1))
        onx = to_onnx(reg, X, target_opset=opset,
                      black_op={'LinearRegressor'})
        onx_loss = add_loss_output(onx)
        text1 = onnx_simple_text_plot(onx_loss)
        new_onx = onnx_derivative(
            onx, options=DerivativeOptions.Loss,
            label='variable', loss='loss', path_name=grad_file)
        text2 = onnx_simple_text_plot(new_onx)
        self.assertNotEqual(text1, text2)


if __name__ == "__main__":
    unittest.main()
