"""Label conventions of the causal-LM tasks, shared by the builders and the metrics."""

IGNORE_INDEX = -100  # positions without a label (transformers' loss ignores them)
NO_DISTANCE = -1  # the ``distance`` column of a position that is not an answer
