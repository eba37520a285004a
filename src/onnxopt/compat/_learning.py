"""onnxcustom's learning-rate, loss and penalty objects, each a thin holder of the DSL declaration it means.

onnxcustom counted its learning-rate schedule in epochs (``update_learning_rate(epoch)`` after each one):
epoch e (0-based) trains with ``eta0 / max(e, 1)^power_t`` ('invscaling'). The schedules below compute the
same value inside the fused graph from the step counter and the number of steps per epoch. ``alpha`` only
enters the 'optimal' schedule, as in onnxcustom: it is not a weight penalty there either.
"""

from __future__ import annotations

import inspect

import numpy as np

from onnxopt.dsl import losses, penalties, updates
from onnxopt.dsl.core import DOMAIN, Loss, Penalty, Schedule, UpdateRule, op, script
from onnxopt.errors import DslError

__all__ = ["BaseLearningRate", "LearningRateSGD", "LearningRateSGDNesterov", "BaseLearningLoss", "SquareLearningLoss",
           "AbsoluteLearningLoss", "ElasticLearningLoss", "NegLogLearningLoss", "BaseLearningPenalty",
           "NoLearningPenalty", "ElasticLearningPenalty", "select_rate", "select_loss", "select_penalty"]


@script(DOMAIN)
def epoch_invscaling(step, eta0: float = 0.01, power_t: float = 0.25, steps_per_epoch: float = 1.0):
    """lr = eta0 / max(e, 1)^power_t, e = floor((t − 1) / steps_per_epoch) the 0-based epoch (onnxcustom's)."""
    one = op.CastLike(1.0, step)
    e = op.Floor(op.Div(op.Sub(step, one), op.CastLike(steps_per_epoch, step)))
    return op.Div(op.CastLike(eta0, step), op.Pow(op.Max(e, one), op.CastLike(power_t, step)))


@script(DOMAIN)
def epoch_optimal(step, eta0: float = 0.01, t0: float = 1.0, steps_per_epoch: float = 1.0):
    """lr = eta0·t0 / (t0 + max(e − 1, 0)): onnxcustom's 'optimal', scaled so epochs 0 and 1 use eta0."""
    one = op.CastLike(1.0, step)
    e = op.Floor(op.Div(op.Sub(step, one), op.CastLike(steps_per_epoch, step)))
    t = op.CastLike(t0, step)
    return op.Div(op.Mul(op.CastLike(eta0, step), t), op.Add(t, op.Max(op.Sub(e, one), op.CastLike(0.0, step))))


@script(DOMAIN)
def epoch_constant(step, eta0: float = 0.01):
    """lr = eta0."""
    return op.CastLike(eta0, step)


class _Params:
    """``repr`` listing the constructor's parameters, like onnxcustom's objects print."""

    def __repr__(self) -> str:
        names = [p for p in inspect.signature(type(self).__init__).parameters if p != "self"]
        return f"{type(self).__name__}({', '.join(f'{n}={getattr(self, n)!r}' for n in names)})"


class BaseLearningRate(_Params):
    """onnxcustom's base class of learning rates; ``select`` builds one from a name, a float or an object."""

    @staticmethod
    def select(class_name, **kwargs) -> LearningRateSGD:
        return select_rate(class_name, **kwargs)


class LearningRateSGD(BaseLearningRate):
    """SGD whose learning rate follows scikit-learn's schedules counted in epochs: 'constant' (eta0),
    'invscaling' (eta0 / e^power_t) or 'optimal' (from ``alpha``); ``w ← w − lr·g``.

    >>> [round(v, 4) for v in LearningRateSGD(0.1).loop(4)]   # eta0 / (i + 1)^power_t, as onnxcustom's loop
    [0.1, 0.0841, 0.076, 0.0707]

    ``fit`` uses eta0 for epochs 0 and 1, then eta0 / e^power_t (onnxcustom updated the rate with the
    0-based epoch it had just finished).
    """

    needs_grad = False

    def __init__(self, eta0: float = 0.01, alpha: float = 0.0001, power_t: float = 0.25,
                 learning_rate: str = "invscaling"):
        # NOTE: ValueError as onnxcustom raised (DslError is a TypeError)
        if learning_rate not in ("invscaling", "optimal", "constant"):
            raise ValueError(f"learning_rate: expected 'invscaling', 'optimal' or 'constant', got {learning_rate!r}")
        if isinstance(eta0, bool) or not isinstance(eta0, (int, float)) or not eta0 > 0:
            raise ValueError(f"eta0: expected a number > 0, got {eta0!r}")
        if learning_rate == "optimal" and not alpha > 0:
            raise ValueError(f"alpha: expected a number > 0 for learning_rate='optimal', got {alpha!r}")
        self.eta0, self.alpha, self.power_t, self.learning_rate = eta0, alpha, power_t, learning_rate
        self.value_ = None

    def _t0(self) -> float:
        """onnxcustom's ``optimal_init_``: Léon Bottou's heuristic for the first step, 1 / (eta0'·alpha)."""
        typw = (1.0 / self.alpha**0.5) ** 0.5
        return 1.0 / (typw / max(1.0, (1 + typw) * 2) * self.alpha)

    def rate(self, epoch: int) -> float:
        """The learning rate of epoch ``epoch`` (0-based), as the fused graph computes it."""
        if self.learning_rate == "invscaling":
            return self.eta0 / max(epoch, 1) ** self.power_t
        if self.learning_rate == "optimal":
            t0 = self._t0()
            return self.eta0 * t0 / (t0 + max(epoch - 1, 0))
        return self.eta0

    def schedule(self, steps_per_epoch: int, scale: float = 1.0) -> Schedule:
        """The in-graph schedule for ``steps_per_epoch`` steps an epoch, every rate multiplied by ``scale``."""
        eta0, spe = self.eta0 * scale, float(steps_per_epoch)
        if self.learning_rate == "invscaling":
            return Schedule("epoch_invscaling", epoch_invscaling)(eta0=eta0, power_t=self.power_t, steps_per_epoch=spe)
        if self.learning_rate == "optimal":
            return Schedule("epoch_optimal", epoch_optimal)(eta0=eta0, t0=self._t0(), steps_per_epoch=spe)
        return Schedule("epoch_constant", epoch_constant)(eta0=eta0)

    def update(self) -> UpdateRule:
        """The update rule: plain SGD."""
        return updates.sgd()

    # onnxcustom's Python-side API, kept for code that plots or inspects the schedule
    @property
    def value(self) -> float:
        """The current learning rate (after ``init_learning_rate``/``update_learning_rate`` or a fit)."""
        if self.value_ is None:
            raise DslError("value: expected init_learning_rate() or fit() to have been called, got no value yet")
        return self.value_

    def init_learning_rate(self):
        self.value_ = self.rate(0)
        return self

    def update_learning_rate(self, t: int):
        """The rate after epoch ``t`` (0-based) ends, i.e. the one epoch t + 1 uses."""
        self.value_ = self.rate(t + 1)
        return self

    def loop(self, n: int = 1000):
        """Yields ``n`` learning rates: eta0, then the rate after each update (onnxcustom's loop)."""
        self.init_learning_rate()
        for i in range(n):
            yield self.value
            self.update_learning_rate(i + 1)


class LearningRateSGDNesterov(LearningRateSGD):
    """SGD with momentum, Nesterov's when ``nesterov``: ``v ← μ·v + g; w ← w − lr·(g + μ·v)`` (torch's form)."""

    needs_grad = True

    def __init__(self, eta0: float = 0.01, alpha: float = 0.0001, power_t: float = 0.25,
                 learning_rate: str = "invscaling", momentum: float = 0.9, nesterov: bool = True):
        super().__init__(eta0, alpha, power_t, learning_rate)
        self.momentum, self.nesterov = momentum, nesterov

    def update(self) -> UpdateRule:
        """``dsl.updates.nesterov`` or ``dsl.updates.momentum``."""
        return (updates.nesterov if self.nesterov else updates.momentum)(momentum=self.momentum)


def select_rate(value, **kwargs) -> LearningRateSGD:
    """onnxcustom's ``BaseLearningRate.select``: an object, a float (SGD) or 'SGD' / 'Nesterov'."""
    if isinstance(value, LearningRateSGD):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return LearningRateSGD(float(value), **kwargs)
    names = {"SGD": LearningRateSGD, "LearningRateSGD": LearningRateSGD, "SGDRegressor": LearningRateSGD,
             "Nesterov": LearningRateSGDNesterov, "SGDNesterov": LearningRateSGDNesterov,
             "LearningRateSGDNesterov": LearningRateSGDNesterov}
    if isinstance(value, str) and value in names:
        return names[value](**kwargs)
    raise ValueError(f"learning_rate: expected a float, a LearningRateSGD(Nesterov) or one of {sorted(names)}, "
                     f"got {value!r}")


class BaseLearningLoss(_Params):
    """onnxcustom's base class of losses; ``select('elastic', l1_weight=..)`` builds one by name."""

    @staticmethod
    def select(class_name, **kwargs):
        return select_loss(class_name, **kwargs)

    def loss_scores(self, y, pred, weight=None):
        """Per-sample losses (NumPy): ``y`` reshaped like the prediction, summed over its columns."""
        pred = np.asarray(pred, dtype=np.float64).reshape((len(pred), -1))
        y = np.asarray(y, dtype=np.float64).reshape(pred.shape)
        scores = self._scores(y, pred).sum(axis=1)
        return scores if weight is None else scores * np.asarray(weight, dtype=np.float64).reshape(-1)


class SquareLearningLoss(BaseLearningLoss):
    """(y − t)², averaged over the batch: ``dsl.losses.square()``."""

    def __init__(self):
        pass

    def to_dsl(self) -> Loss:
        return losses.square()

    def _scores(self, y, p):
        return (y - p) ** 2


class AbsoluteLearningLoss(BaseLearningLoss):
    """|y − t|, averaged over the batch: ``dsl.losses.absolute()``."""

    def __init__(self):
        pass

    def to_dsl(self) -> Loss:
        return losses.absolute()

    def _scores(self, y, p):
        return np.abs(y - p)


class ElasticLearningLoss(BaseLearningLoss):
    """l1_weight·|y − t| + l2_weight·(y − t)², averaged over the batch: ``dsl.losses.elastic``."""

    def __init__(self, l1_weight: float = 0.5, l2_weight: float = 0.5):
        self.l1_weight, self.l2_weight = l1_weight, l2_weight

    def to_dsl(self) -> Loss:
        return losses.elastic(l1=self.l1_weight, l2=self.l2_weight)

    def _scores(self, y, p):
        return self.l1_weight * np.abs(y - p) + self.l2_weight * (y - p) ** 2


class NegLogLearningLoss(BaseLearningLoss):
    """Binary log loss on a raw score s (probability sigmoid(s)): ``dsl.losses.log(from_logits=True)``.

    ``eps`` is accepted for compatibility; the loss is computed from the raw score without clipping.
    """

    def __init__(self, eps: float = 1e-5, probability_function: str = "sigmoid"):
        if probability_function != "sigmoid":
            raise ValueError(f"probability_function: expected 'sigmoid', got {probability_function!r}")
        self.eps, self.probability_function = eps, probability_function

    def to_dsl(self) -> Loss:
        return losses.log(from_logits=True)

    def _scores(self, y, p):
        """-(y·log(q) + (1 − y)·log(1 − q)), q = sigmoid(p) clipped to [eps, 1 − eps] (onnxcustom's)."""
        q = np.clip(1 / (1 + np.exp(-np.clip(p, -700, 700))), self.eps, 1 - self.eps)
        return -(y * np.log(q) + (1 - y) * np.log(1 - q))


def select_loss(value, **kwargs):
    """onnxcustom's ``BaseLearningLoss.select``: an object or one of its names."""
    if isinstance(value, BaseLearningLoss):
        return value
    names = {"square_error": SquareLearningLoss, "square": SquareLearningLoss,
             "absolute_error": AbsoluteLearningLoss, "absolute": AbsoluteLearningLoss,
             "elastic_error": ElasticLearningLoss, "elastic": ElasticLearningLoss,
             "log": NegLogLearningLoss, "neglog": NegLogLearningLoss, "logloss": NegLogLearningLoss}
    if isinstance(value, str) and value in names:
        return names[value](**kwargs)
    raise ValueError(f"learning_loss: expected a *LearningLoss object or one of {sorted(names)}, got {value!r}")


class BaseLearningPenalty(_Params):
    """onnxcustom's base class of penalties; ``select('elastic', l1=.., l2=..)`` builds one by name."""

    @staticmethod
    def select(class_name, **kwargs):
        return select_penalty(class_name, **kwargs)


class NoLearningPenalty(BaseLearningPenalty):
    """No penalty."""

    def __init__(self):
        pass

    def to_dsl(self) -> Penalty | None:
        return None


class ElasticLearningPenalty(BaseLearningPenalty):
    """l1·Σ|w| + l2·Σw² on every trained weight, added to the loss: ``dsl.penalties.elastic(l1, l2)``.

    Its gradient l1·sign(w) + 2·l2·w joins the weight's gradient, so the learning rate scales it.
    """

    def __init__(self, l1: float = 0.5, l2: float = 0.5):
        self.l1, self.l2 = l1, l2

    def to_dsl(self) -> Penalty:
        return penalties.elastic(l1=self.l1, l2=self.l2)


def select_penalty(value, **kwargs):
    """onnxcustom's ``BaseLearningPenalty.select``: an object, None/'' (none) or 'elastic'/'l1l2'."""
    if isinstance(value, BaseLearningPenalty):
        return value
    if value is None or value in ("", "penalty", "NoLearningPenalty"):
        return NoLearningPenalty()
    if value in ("elastic", "l1l2", "ElasticLearningPenalty"):
        return ElasticLearningPenalty(**kwargs)
    raise ValueError(f"learning_penalty: expected None, NoLearningPenalty(), ElasticLearningPenalty(...), 'elastic' "
                   f"or 'l1l2', got {value!r}")
