"""Kernelized (linear) attention from non-negative feature maps (``performer``, ``linear``, ``based``): the chunked
prefix-sum kernel (:mod:`.chunk`) and the definition written out (:mod:`.naive`, the tests' oracle)."""

from zoo.ops.linear.chunk import default_chunk_size, linear_attention, linear_attention_flops
from zoo.ops.linear.naive import linear_attention_reference

__all__ = ["default_chunk_size", "linear_attention", "linear_attention_flops", "linear_attention_reference"]
