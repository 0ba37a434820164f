"""The (gated) delta rule (``deltanet``, ``gated_deltanet``): the chunkwise UT form (:mod:`.chunk`; its kernel
choice, fla's triton kernels for bf16/fp16 CUDA calls when installed, else the zoo's own, is the first line of
:func:`delta_rule`), the fused L2 norm of q and k (:mod:`.l2norm`) and the recurrence (:mod:`.naive`, the tests'
oracle and the variants' ``reference``)."""

from zoo.ops.delta_rule.chunk import DEFAULT_CHUNK, delta_rule, delta_rule_flops, unit_lower_inverse, unit_lower_solve
from zoo.ops.delta_rule.l2norm import l2_normalized
from zoo.ops.delta_rule.naive import delta_rule_recurrence

__all__ = [
    "DEFAULT_CHUNK",
    "delta_rule",
    "delta_rule_flops",
    "delta_rule_recurrence",
    "l2_normalized",
    "unit_lower_inverse",
    "unit_lower_solve",
]
