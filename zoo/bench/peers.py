"""The peers ``zoo bench`` holds the zoo's variants against: transformers' Longformer and BigBird attention modules
and lucidrains' performer-pytorch and local-attention (the ``bench`` extra), each wrapped as a
:class:`~zoo.bench.contestants.Contestant` around the shared q/k/v projections.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Any, ClassVar

import torch
from torch import nn

from zoo.bench.contestants import Contestant, PatternFn, QKVProjections, merge_heads
from zoo.pattern import (
    Pattern,
    TokenSet,
    and_masks,
    band,
    causal_mask_function,
    global_columns,
    global_rows,
    union,
)
from zoo.registry import get_variant_class
from zoo.variant import AttentionCall, VariantParameterError


class Peer(Contestant):
    """A peer implementation. ``links`` maps a peer parameter to ``(zoo variant, parameter, convert)``: by default
    the peer runs with the same setting as the zoo variant it is compared with."""

    kind = "peer"
    module: ClassVar[str]  # import name, to tell whether it is installed
    distribution: ClassVar[str]
    defaults: ClassVar[dict[str, Any]] = {}
    links: ClassVar[dict[str, tuple[str, str, Any]]] = {}

    def __init__(self, params: dict[str, Any] | None = None, variant_params: dict[str, dict] | None = None) -> None:
        params = params or {}
        unknown = sorted(set(params) - set(self.defaults))
        if unknown:
            raise VariantParameterError(
                f"zoo bench peer {self.name!r} has no parameter {unknown[0]!r}; its parameters: "
                f"{', '.join(sorted(self.defaults))}."
            )
        resolved = dict(self.defaults)
        for key, (variant, pname, convert) in self.links.items():
            linked = _linked_value(variant, pname, (variant_params or {}).get(variant, {}))
            if linked is not None:
                resolved[key] = convert(linked)
        resolved.update(params)
        super().__init__(resolved)

    @classmethod
    def installed(cls) -> bool:
        try:
            return importlib.util.find_spec(cls.module) is not None
        except ModuleNotFoundError:
            return False

    def source(self) -> tuple[str, str]:
        return self.distribution, importlib.metadata.version(self.distribution)


def _linked_value(variant: str, pname: str, overrides: dict[str, Any]) -> Any:
    """The effective value of a zoo variant's parameter (override, else its default), or None if unknown."""
    if pname in overrides:
        return overrides[pname]
    try:
        spec = get_variant_class(variant).params.get(pname)
    except Exception:  # the variant is not installed or broken: keep the peer's own default
        return None
    return spec.default if spec is not None else None


def _first(value: Any) -> Any:
    """A per-layer list's first value (the benchmark measures one layer)."""
    return value[0] if isinstance(value, (list, tuple)) else value


def _window_pattern(each_side: int, global_tokens: tuple[int, ...] = (), causal: bool = False) -> PatternFn:
    """The peer's pattern from :mod:`zoo.pattern`'s predicates: a band of ``each_side`` and global rows/columns."""
    tokens = TokenSet(tuple(global_tokens))
    rule = union([band(each_side), *([global_rows(tokens), global_columns(tokens)] if global_tokens else [])])
    rule = and_masks(rule, causal_mask_function) if causal else rule

    def pattern(call: AttentionCall, q_len: int, kv_len: int) -> Pattern:
        return Pattern(rule, reach=each_side)

    return pattern


def _pad_length(x: torch.Tensor, multiple: int) -> tuple[torch.Tensor, int]:
    extra = (-x.shape[1]) % multiple
    return (torch.nn.functional.pad(x, (0, 0, 0, extra)) if extra else x), extra


class HFLongformerLayer(nn.Module):
    """transformers' ``LongformerSelfAttention`` fed the mask ``LongformerModel`` would build (0 local, +10000
    global, -10000 padding), the input padded to a window multiple as ``LongformerModel`` does."""

    def __init__(self, attention: nn.Module, window: int, global_tokens: list[int]) -> None:
        super().__init__()
        self.attention, self.window, self.global_tokens = attention, window, list(global_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        padded, extra = _pad_length(x, self.window)
        mask = torch.zeros(padded.shape[:2], device=x.device, dtype=x.dtype)
        mask[:, n:] = -10000.0
        globals_here = [g for g in self.global_tokens if g < n]
        mask[:, globals_here] = 10000.0
        out = self.attention(
            padded,
            attention_mask=mask,
            is_index_masked=mask < 0,
            is_index_global_attn=mask > 0,
            is_global_attn=bool(globals_here),
        )[0]
        return out[:, :n]


class HFLongformerPeer(Peer):
    name = "hf_longformer"
    module = "transformers.models.longformer.modeling_longformer"
    distribution = "transformers"
    matches = ("longformer",)
    exact = True
    supports_dropout = True
    time_complexity, memory_complexity = "O(n·w)", "O(n·w)"
    defaults = {"window": 512, "global_tokens": [0]}
    links = {"window": ("longformer", "window", _first), "global_tokens": ("longformer", "global_tokens", list)}

    def unsupported(self, n: int, causal: bool) -> str | None:
        return "transformers' LongformerSelfAttention is bidirectional only" if causal else None

    def flops(self, n: int, heads: int, head_dim: int, causal: bool) -> float:
        # Overlapping chunks of 2·(w/2) keys give each query ~2w scores; global rows/columns add ~2·n each.
        window, n_global = self.params["window"], len(self.params["global_tokens"])
        return 4.0 * heads * head_dim * n * (2 * window + 2 * n_global)

    def build(self, proj: QKVProjections, n: int, causal: bool, dropout: float = 0.0) -> nn.Module:
        from transformers import LongformerConfig
        from transformers.models.longformer.modeling_longformer import LongformerSelfAttention

        hidden = proj.heads * proj.head_dim
        config = LongformerConfig(
            hidden_size=hidden,
            num_attention_heads=proj.heads,
            attention_window=[self.params["window"]],
            attention_probs_dropout_prob=dropout,
        )
        attention = LongformerSelfAttention(config, layer_id=0)
        # Shared projections; the global ones equal the local ones (as the zoo's longformer documents).
        attention.query = attention.query_global = proj.query
        attention.key = attention.key_global = proj.key
        attention.value = attention.value_global = proj.value
        return HFLongformerLayer(attention, self.params["window"], self.params["global_tokens"])

    def reference_pattern(self, layer: nn.Module) -> PatternFn | None:
        return _window_pattern(self.params["window"] // 2, tuple(self.params["global_tokens"]))


class HFBigBirdLayer(nn.Module):
    """transformers' ``BigBirdBlockSparseAttention`` with the block masks ``BigBirdModel`` would build."""

    def __init__(self, attention: nn.Module, block_size: int) -> None:
        super().__init__()
        self.attention, self.block_size = attention, block_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.models.big_bird.modeling_big_bird import BigBirdModel

        n = x.shape[1]
        padded, extra = _pad_length(x, self.block_size)
        mask = torch.ones(padded.shape[:2], device=x.device, dtype=x.dtype)
        mask[:, n:] = 0.0
        blocked, band, from_mask, to_mask = BigBirdModel.create_masks_for_block_sparse_attn(mask, self.block_size)
        out = self.attention(
            padded, band_mask=band, from_mask=from_mask, to_mask=to_mask,
            from_blocked_mask=blocked, to_blocked_mask=blocked,
        )[0]
        return out[:, :n]


class HFBigBirdPeer(Peer):
    name = "hf_bigbird"
    module = "transformers.models.big_bird.modeling_big_bird"
    distribution = "transformers"
    matches = ("bigbird",)
    exact = True
    has_reference = False  # its random blocks are drawn inside the module (NumPy), not reconstructible here
    supports_dropout = False  # BigBirdBlockSparseAttention applies no attention dropout (only BigBird's full path)
    memory_grows_quadratically = True  # transformers 5.x builds a dense (B, H, N, N) probability tensor
    time_complexity, memory_complexity = "O(n·b·(3+2+r))", "O(n²) (dense probabilities in 5.x)"
    defaults = {"block_size": 64, "num_random_blocks": 3, "seed": 0}
    links = {
        "block_size": ("bigbird", "block_size", int),
        "num_random_blocks": ("bigbird", "num_random_blocks", int),
    }

    def unsupported(self, n: int, causal: bool) -> str | None:
        if causal:
            return "transformers' BigBirdBlockSparseAttention is bidirectional only"
        limit = (5 + 2 * self.params["num_random_blocks"]) * self.params["block_size"]
        if n <= limit:
            return f"n <= {limit}: transformers' BigBird switches to full attention there"
        return None

    def flops(self, n: int, heads: int, head_dim: int, causal: bool) -> float:
        block, rand = self.params["block_size"], self.params["num_random_blocks"]
        sparse_rows = 4.0 * heads * head_dim * n * (5 + rand) * block  # window 3 + global 2 + random blocks
        global_rows = 4.0 * heads * head_dim * (2 * block) * n  # the first and last query blocks see everything
        return sparse_rows + global_rows

    def build(self, proj: QKVProjections, n: int, causal: bool, dropout: float = 0.0) -> nn.Module:
        from transformers import BigBirdConfig
        from transformers.models.big_bird.modeling_big_bird import BigBirdBlockSparseAttention

        block = self.params["block_size"]
        config = BigBirdConfig(
            hidden_size=proj.heads * proj.head_dim,
            num_attention_heads=proj.heads,
            block_size=block,
            num_random_blocks=self.params["num_random_blocks"],
            attention_type="block_sparse",
            max_position_embeddings=max(4096, n + (-n) % block),
            attention_probs_dropout_prob=0.0,
            use_bias=True,
        )
        attention = BigBirdBlockSparseAttention(config, seed=self.params["seed"])
        attention.query, attention.key, attention.value = proj.query, proj.key, proj.value
        return HFBigBirdLayer(attention, block)


class SplitHeadsLayer(nn.Module):
    """Shared projections + an attention module taking ``(B, heads, N, head_dim)`` q, k, v (lucidrains' style)."""

    def __init__(self, proj: QKVProjections, attention: nn.Module) -> None:
        super().__init__()
        self.proj, self.attention = proj, attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return merge_heads(self.attention(*self.proj.split(x)))


class PerformerPytorchPeer(Peer):
    name = "performer_pytorch"
    module = "performer_pytorch"
    distribution = "performer-pytorch"
    matches = ("performer",)
    exact = False
    supports_dropout = False  # FastAttention has none (performer-pytorch's dropout is on SelfAttention's output)
    time_complexity, memory_complexity = "O(n·m·d)", "O(n·m)"
    defaults = {"nb_features": 256}
    links = {"nb_features": ("performer", "nb_features", int)}

    def unsupported(self, n: int, causal: bool) -> str | None:
        # Without its CUDA extension, causal FastAttention builds the full n·m·d cumulative tensor (minutes at 8K).
        if causal and not torch.cuda.is_available():
            return "performer-pytorch's causal CPU path builds an n·m·d cumulative tensor"
        return None

    def flops(self, n: int, heads: int, head_dim: int, causal: bool) -> float:
        # features of q and k (2·n·m·d each), k^T v and q (k^T v) (2·n·m·d each)
        return 8.0 * heads * head_dim * n * self.params["nb_features"]

    def build(self, proj: QKVProjections, n: int, causal: bool, dropout: float = 0.0) -> nn.Module:
        from performer_pytorch import FastAttention

        return SplitHeadsLayer(proj, FastAttention(dim_heads=proj.head_dim, nb_features=self.params["nb_features"],
                                                   causal=causal))


class LocalAttentionPeer(Peer):
    name = "local_attention"
    module = "local_attention"
    distribution = "local-attention"
    matches = ("longformer",)
    exact = True
    supports_dropout = True
    time_complexity, memory_complexity = "O(n·w)", "O(n·w)"
    defaults = {"window": 256}  # keys on each side, as the zoo longformer's window // 2
    links = {"window": ("longformer", "window", lambda w: _first(w) // 2)}

    def flops(self, n: int, heads: int, head_dim: int, causal: bool) -> float:
        blocks_seen = 2 if causal else 3  # each query bucket scores its own and its neighbour buckets
        return 4.0 * heads * head_dim * n * blocks_seen * self.params["window"]

    def build(self, proj: QKVProjections, n: int, causal: bool, dropout: float = 0.0) -> nn.Module:
        from local_attention import LocalAttention

        attention = LocalAttention(
            window_size=self.params["window"], causal=causal, look_backward=1, look_forward=0 if causal else 1,
            exact_windowsize=True, autopad=True, dropout=dropout,
        )
        return SplitHeadsLayer(proj, attention)

    def reference_pattern(self, layer: nn.Module) -> PatternFn | None:
        return _window_pattern(self.params["window"], causal=layer.attention.causal)


PEERS: dict[str, type[Peer]] = {
    peer.name: peer for peer in (HFLongformerPeer, HFBigBirdPeer, PerformerPytorchPeer, LocalAttentionPeer)
}
