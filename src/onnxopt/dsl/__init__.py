"""The DSL: losses, penalties, update rules and schedules as onnxscript functions.

>>> from onnxopt.dsl import updates
>>> updates.momentum(momentum=0.5).state
('velocity',)
"""

from onnxopt.dsl import losses, penalties, schedules, updates
from onnxopt.dsl.core import (
    DOUBLE, FLOAT, INT64, Loss, Penalty, Schedule, UpdateRule, loss, op, penalty, schedule, update_rule,
)

__all__ = ["op", "FLOAT", "DOUBLE", "INT64", "loss", "penalty", "update_rule", "schedule", "Loss", "Penalty",
           "UpdateRule", "Schedule", "losses", "penalties", "updates", "schedules"]
