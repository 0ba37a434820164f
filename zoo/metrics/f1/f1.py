"""F1 as an ``evaluate`` metric module, shipped with attention-zoo so it loads offline.

Same inputs and output key as the Hub's ``f1`` module: ``{"f1": float}`` (an array when ``average=None``).
The recipes use ``average="macro"``: the unweighted mean over classes, so rare genres count as much as
frequent ones.
"""

import datasets
import evaluate
import numpy as np
from sklearn.metrics import f1_score

_DESCRIPTION = "Harmonic mean of precision and recall (scikit-learn f1_score)."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted class ids.
    references (list of int): true class ids.
    labels (list of int): classes to include (and their order when average is None).
    pos_label (int): the positive class when average="binary".
    average (str or None): "binary" (default), "micro", "macro", "weighted", or None for per-class scores.
    sample_weight (list of float): optional per-example weights.
Returns:
    f1 (float, or array of float when average is None)
"""


class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}),
            reference_urls=["https://scikit-learn.org/stable/modules/generated/sklearn.metrics.f1_score.html"],
        )

    def _compute(self, predictions, references, labels=None, pos_label=1, average="binary", sample_weight=None):
        score = f1_score(
            references, predictions, labels=labels, pos_label=pos_label, average=average, sample_weight=sample_weight
        )
        return {"f1": float(score) if np.ndim(score) == 0 else score}
