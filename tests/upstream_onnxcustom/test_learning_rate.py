# Ported from https://github.com/sdpython/onnxcustom/blob/671b3c9927c37fb88a01d9a8c42df1c2b0ae092e/_unittests/ut_training/test_learning_rate.py
# (repository sdpython/onnxcustom, path _unittests/ut_training/test_learning_rate.py, commit 671b3c9927c37fb88a01d9a8c42df1c2b0ae092e).
# Changes: imports only (onnxcustom.* -> onnxopt.compat; pyquickhelper, mlprodict and two scikit-learn
# renames -> tests/upstream_onnxcustom/_harness.py) and pytest.mark.skip(reason=...) on the tests that read
# onnxcustom internals or assert what onnxopt's numbers cannot give. Bodies, data sizes and assertions are
# upstream's (no deviation).
"""
@brief      test log(time=3s)
"""

import unittest
from upstream_onnxcustom._harness import ExtTestCase
from onnxopt.compat import LearningRateSGD


class TestLearningRate(ExtTestCase):

    def is_decreased(self, series):
        for i in range(1, len(series)):
            if series[i] >= series[i - 1]:
                raise AssertionError(
                    "Not decreasing at index %d - %r." % (
                        i, series[i - 1: i + 1]))

    def test_learning_rate_sgd_regressor_default(self):
        cllr = LearningRateSGD()
        val = list(cllr.loop())
        self.assertEqual(len(val), 1000)
        self.is_decreased(val)
        self.assertEqual(val[0], 0.01)
        self.assertGreater(val[-1], 0.001)

    def test_learning_rate_sgd_regressor_exc(self):
        self.assertRaise(
            lambda: LearningRateSGD(learning_rate='EXC'),
            ValueError)

    def test_learning_rate_sgd_regressor_optimal(self):
        cllr = LearningRateSGD(learning_rate='optimal')
        val = list(cllr.loop())
        self.assertEqual(len(val), 1000)
        self.is_decreased(val)
        self.assertEqual(val[0], 0.01)
        self.assertGreater(val[-1], 0.009)

    def test_learning_rate_sgd_regressor_constant(self):
        cllr = LearningRateSGD(learning_rate='constant')
        val = list(cllr.loop())
        self.assertEqual(len(val), 1000)
        self.assertEqual(val[0], 0.01)
        self.assertEqual(val[-1], val[0])

    def test_learning_rate_sgd_exc(self):
        self.assertRaise(
            lambda: LearningRateSGD(learning_rate='CST'),
            ValueError)


if __name__ == "__main__":
    unittest.main()
