"""Accuracy as an ``evaluate`` metric module, shipped with attention-zoo so it loads offline.

``evaluate.load("accuracy")`` downloads the module from the Hub; ``zoo.metrics.load("accuracy")`` loads this
file instead. Same inputs and output key as the Hub module: ``{"accuracy": float}``.
"""

import datasets
import evaluate
from sklearn.metrics import accuracy_score

_DESCRIPTION = "Fraction of predictions equal to the references (scikit-learn accuracy_score)."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted class ids.
    references (list of int): true class ids.
    normalize (bool): False returns the number of correct predictions instead of the fraction.
    sample_weight (list of float): optional per-example weights.
Returns:
    accuracy (float)
"""


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}),
            reference_urls=["https://scikit-learn.org/stable/modules/generated/sklearn.metrics.accuracy_score.html"],
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        score = accuracy_score(references, predictions, normalize=normalize, sample_weight=sample_weight)
        return {"accuracy": float(score)}
