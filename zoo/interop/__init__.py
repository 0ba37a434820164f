"""Running zoo-configured models in other tools' harnesses (``python -m zoo.interop.lm_eval``)."""
