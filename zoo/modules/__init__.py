"""The learned pieces of the zoo's layers (fla's ``fla/modules``): ``nn.Module`` s the variants' layer weights hold
and the helpers that read a call's weights or cache, kept out of :mod:`zoo.ops` (plain tensors in and out). The
short convolution of q, k and v (:class:`ShortConv`, :func:`short_conv_inputs`), decay gates (:class:`LowRankDecay`,
:class:`Mamba2Decay`, :func:`retnet_log_decay`, Liger's :func:`key_log_decay`), the per-head output norm
(:class:`OutputNorm`, :func:`normalized`) and where gates are projected from (:func:`gate_source`)."""

from zoo.modules.decay import LowRankDecay, Mamba2Decay, key_log_decay, retnet_log_decay
from zoo.modules.gates import gate_source
from zoo.modules.norm import OutputNorm, normalized
from zoo.modules.short_conv import STATE_KEYS, ShortConv, short_conv_inputs

__all__ = [
    "STATE_KEYS",
    "LowRankDecay",
    "Mamba2Decay",
    "OutputNorm",
    "ShortConv",
    "gate_source",
    "key_log_decay",
    "normalized",
    "retnet_log_decay",
    "short_conv_inputs",
]
