"""Retrofit a pretrained causal LM with any attention-zoo variant: attention transfer layer by layer
(:mod:`zoo.retrofit.transfer`, from the layers' inputs captured once, :mod:`zoo.retrofit.capture`), a measured choice of
which layers keep full attention (:mod:`zoo.retrofit.selection`), long-document fine-tuning with distillation (the
fine-tune recipe) and ``zoo eval`` (:mod:`zoo.retrofit.recipe`, run by ``recipes/retrofit.py CONFIG``).

How it works and what it measured: docs/recipes/retrofit.md
"""
