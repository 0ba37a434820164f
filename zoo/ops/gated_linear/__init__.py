"""Gated linear attention (``gla``; Mamba2's and RetNet's scalar decays): the chunkwise form (:mod:`.chunk`; its
kernel choice, fla's ``chunk_gla`` / ``chunk_simple_gla`` for bf16/fp16 CUDA calls when installed, else the zoo's
own, is the first line of :func:`gated_linear_attention`) and the recurrence (:mod:`.naive`, the tests' oracle and
the variant's ``reference``)."""

from zoo.ops.gated_linear.chunk import CHANNEL_CHUNK, SCALAR_CHUNK, gated_linear_attention, gated_linear_flops
from zoo.ops.gated_linear.naive import gated_linear_recurrence

__all__ = ["CHANNEL_CHUNK", "SCALAR_CHUNK", "gated_linear_attention", "gated_linear_flops", "gated_linear_recurrence"]
