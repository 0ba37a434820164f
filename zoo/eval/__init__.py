"""zoo eval: long-context evaluation of pretrained causal models (RULER-style tasks, perplexity by position).

``zoo eval CONFIG`` (or ``python -m zoo.eval CONFIG``) reads a YAML config (:mod:`zoo.eval.config`), writes every
prompt to the run folder, answers them with each contestant (the full cache, ``budget`` policies, a window, any zoo
variant, QuantizedCache, a saved folder; kvpress's presses through ``scripts/kvpress_peer.py``), measures perplexity
by position and speed, and writes the report (:mod:`zoo.eval.report`). The guide: docs/guides/long-context-eval.md.
"""
