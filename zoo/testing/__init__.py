"""Helpers for testing an attention variant beyond the contract suite (:mod:`zoo.contract` is built on them).

A plugin author's own tests use the same inputs (:func:`make_inputs`, :func:`make_call`, :func:`make_variant`), dense
:func:`reference`, comparisons (:func:`assert_matches_reference`), allocation probe (:class:`LargestAllocation`),
reload and learned-weight checks as the suite.

Example and the full list: docs/notes/internals.md#testing
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from zoo.cache import BudgetedLayer, RecurrentLayer, WindowedLayer, cache_nbytes
from zoo.ops import allowed_mask, softmax_attention
from zoo.pattern import row_starts
from zoo.plug.dispatch import run_variant
from zoo.plug.generation import make_cache
from zoo.plug.install import configure
from zoo.plug.spec import IMPLEMENTATION, variant_spec
from zoo.plug.weights import WEIGHTS_NAME, build
from zoo.registry import get_variant_class
from zoo.variant import AttentionCall, Variant, reference

__all__ = [
    "ATOL", "BATCH", "HEADS", "HEAD_DIM", "MEMORY_CHECK_LENGTH", "N", "REAL_LENGTH", "LargestAllocation",
    "allowed_mask", "assert_cache_bytes_bounded", "assert_decodes_like_the_full_forward",
    "assert_invariant_to_padding_amount", "assert_matches_reference", "assert_memory_below_quadratic",
    "assert_reloads_identically", "assert_weights_train_and_reload", "causal_lm",
    "declares_bounded_cache", "declares_subquadratic_memory", "declares_weights", "decode_prompts",
    "decoding_refusal", "greedy", "largest_allocation", "make_call", "make_inputs", "make_variant", "make_weights",
    "model_inputs", "modes", "padding_amount_difference", "real_rows", "reference", "relative_error", "run_variant",
    "softmax_attention",
    "tiny_model_config",
]  # fmt: skip

BATCH, HEADS, N, HEAD_DIM = 2, 2, 100, 16
REAL_LENGTH = 73  # real tokens in the second (padded) row
ATOL = 1e-5
MEMORY_CHECK_LENGTH = 4096
QUADRATIC_FRACTION = 8  # a tensor of n²/8 elements or more counts as quadratic

# ------------------------------------------------------------------------------------------------------
# inputs


def make_variant(name: str, **overrides) -> Variant:
    """Variant ``name`` built with its ``test_params`` (the small settings of the contract suite) and ``overrides``."""
    cls = get_variant_class(name)
    return cls(**{**cls.test_params, **overrides})


def modes(name_or_class: str | type[Variant]) -> list[bool]:
    """The ``causal`` values the variant supports: [False, True], [False] or [True]."""
    cls = get_variant_class(name_or_class) if isinstance(name_or_class, str) else name_or_class
    return [c for c, ok in ((False, cls.supports_bidirectional), (True, cls.supports_causal)) if ok]


def make_inputs(
    seed: int = 0,
    dtype=torch.float32,
    n: int = N,
    padding: str | None = "right",
    batch: int = BATCH,
    heads: int = HEADS,
    head_dim: int = HEAD_DIM,
):
    """``q, k, v`` (batch, heads, n, head_dim) ~ N(0, 1) and a padding mask (batch, n) bool with the last row holding
    ``REAL_LENGTH`` (at most n - 1) real tokens on the right (``padding="right"``) or on the left; None when
    ``padding`` is None."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, n, head_dim, generator=gen).to(dtype) for _ in range(3))
    mask = None
    if padding is not None:
        mask = torch.ones(batch, n, dtype=torch.bool)
        real = min(REAL_LENGTH, n - 1)
        if padding == "right":
            mask[-1, real:] = False
        else:
            mask[-1, : n - real] = False
    return q, k, v, mask


def make_call(
    causal: bool, padding_mask=None, head_dim: int = HEAD_DIM, variant: Variant | None = None, heads: int = HEADS,
    dtype: torch.dtype = torch.float32, **kwargs,
) -> AttentionCall:
    """An :class:`AttentionCall` with softmax scaling ``head_dim ** -0.5``; ``kwargs`` set the other fields.
    With ``variant``, the call carries that variant's learned weights (:func:`make_weights` for ``heads`` x
    ``head_dim``, in ``dtype`` as in a model of that dtype) when it declares any."""
    if variant is not None and "weights" not in kwargs:
        weights = make_weights(variant, heads=heads, head_dim=head_dim)
        kwargs["weights"] = weights.to(dtype) if weights is not None else None
    kwargs.setdefault("row_start", row_starts(padding_mask))  # as the plug sets it: where each row's tokens start
    return AttentionCall(causal=causal, scaling=head_dim**-0.5, padding_mask=padding_mask, **kwargs)


def make_weights(
    variant: Variant, heads: int = HEADS, head_dim: int = HEAD_DIM, layer_idx: int = 0,
    max_positions: int = MEMORY_CHECK_LENGTH,
) -> torch.nn.Module | None:
    """The variant's learned weights for one layer (None if it declares none), built as in a model (seeded per
    layer, so every call returns the same values) for a BERT config of ``heads`` x ``head_dim`` with
    ``max_positions`` positions."""
    hidden = heads * head_dim
    config = transformers.BertConfig(
        hidden_size=hidden, num_attention_heads=heads, num_hidden_layers=1, intermediate_size=2 * hidden,
        max_position_embeddings=max_positions,
    )
    return build(variant, layer_idx, config, head_dim, heads)


def declares_weights(variant: Variant) -> bool:
    """True when the variant, at its current parameters, has learned per-layer weights (parameters; a module holding
    only buffers, such as performer's redraw counter, has none to train)."""
    weights = make_weights(variant)
    return weights is not None and any(True for _ in weights.parameters())


DECODER_FAMILIES = {  # rotary decoders with grouped key/value heads
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
}
AUTOCAST_TOLERANCE = {torch.bfloat16: 0.05, torch.float16: 0.01}  # relative logits error vs fp32 (autocast)
APPROXIMATE_AUTOCAST_FACTOR = 3  # approximate variants: bf16 rounding may flip a discrete choice (LSH buckets)


def tiny_model_config(family: str, name: str, **params) -> transformers.PretrainedConfig:
    """A 2-layer, hidden-32 ``bert``, ``modernbert``, ``llama``, ``mistral`` or ``qwen2`` (GQA) config using variant
    ``name`` with its ``test_params`` and ``params``."""
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    if family == "bert":
        config = transformers.BertConfig(**common, attention_probs_dropout_prob=0.0, max_position_embeddings=256)
    elif family == "modernbert":
        config = transformers.ModernBertConfig(
            **common, attention_dropout=0.0, global_attn_every_n_layers=2, local_attention=16, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
        )
    elif family in DECODER_FAMILIES:
        config = DECODER_FAMILIES[family](**common, num_key_value_heads=2, attention_dropout=0.0, pad_token_id=0)
    else:
        raise ValueError(
            f"tiny_model_config: unknown family {family!r}; use 'bert', 'modernbert' or one of "
            f"{list(DECODER_FAMILIES)}."
        )
    return configure(config, name, **{**get_variant_class(name).test_params, **params})


def model_inputs(n: int = N, batch: int = BATCH, vocab_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` (batch, n) and an ``attention_mask`` whose last row is padded after ``REAL_LENGTH`` tokens."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab_size, (batch, n), generator=gen)
    mask = torch.ones(batch, n, dtype=torch.long)
    mask[-1, min(REAL_LENGTH, n - 1) :] = 0
    return ids, mask


def assert_runs_under_autocast(name: str, family: str, dtype: torch.dtype, **params) -> None:
    """Forward and backward of a tiny ``family`` model with variant ``name`` under CPU autocast in ``dtype``
    (padded batch): finite logits and gradients, logits at real tokens within ``AUTOCAST_TOLERANCE[dtype]``
    (relative; times ``APPROXIMATE_AUTOCAST_FACTOR`` for approximate variants) of the fp32 forward."""
    torch.manual_seed(0)
    config = tiny_model_config(family, name, **params)
    auto = transformers.AutoModelForCausalLM if family in DECODER_FAMILIES else transformers.AutoModelForMaskedLM
    model = auto.from_config(config).eval()
    ids, mask = model_inputs()
    real = mask.bool()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits[real]
    with torch.autocast("cpu", dtype=dtype):
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
    assert torch.isfinite(out.logits).all(), f"{name} in {family} under {dtype} autocast: non-finite logits"
    out.loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), f"{name}: non-finite gradient of {pname}"
    err = relative_error(out.logits.float()[real], ref)
    tolerance = AUTOCAST_TOLERANCE[dtype] * (1 if get_variant_class(name).exact else APPROXIMATE_AUTOCAST_FACTOR)
    assert err < tolerance, f"{name} in {family} under {dtype}: relative error {err:.4f} vs fp32"


# ------------------------------------------------------------------------------------------------------
# the reference and comparisons


def real_rows(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Outputs (batch, heads, n, d) at real (unpadded) query positions, flattened to (real tokens, heads, d)."""
    if mask is None:
        return x
    return x.transpose(1, 2)[mask]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ (Frobenius), the measure of ``Variant.error_bound``."""
    return float((out - ref).detach().norm() / ref.detach().norm())


def assert_matches_reference(variant: Variant, out, ref, what: str = "output") -> None:
    """Exact variants: equal within ``ATOL`` (rtol 1e-4); approximate ones: relative error within ``error_bound``."""
    if variant.exact:
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-4, msg=lambda m: f"{variant.name} {what}: {m}")
    else:
        err = relative_error(out, ref)
        if err > variant.error_bound:
            raise AssertionError(f"{variant.name}: relative {what} error {err:.4f} > error_bound {variant.error_bound}")


PAD_AMOUNT = 37  # pad tokens added to a row by the padding-amount check (changes the block count of every built-in)


def padding_amount_difference(variant: Variant, causal: bool, n: int = N, pad: int = PAD_AMOUNT, seed: int = 0,
                              head_dim: int = HEAD_DIM) -> float:
    """Largest difference of one row's outputs at its ``n`` real tokens between running it alone and padded by ``pad``
    tokens (noise) in a batch with a full row of ``n + pad`` tokens: on the left when ``causal`` (as decoders pad),
    on the right otherwise."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, HEADS, n + pad, head_dim, generator=gen) for _ in range(3))
    mask = torch.ones(2, n + pad, dtype=torch.bool)
    real = slice(pad, None) if causal else slice(0, n)
    mask[0] = False
    mask[0, real] = True
    with torch.no_grad():
        alone = run_variant(variant, *(x[:1, :, real] for x in (q, k, v)), make_call(causal, variant=variant))
        batched = run_variant(variant, q, k, v, make_call(causal, mask, variant=variant))
    return float((batched[:1, :, real] - alone).abs().max())


def assert_invariant_to_padding_amount(variant: Variant, n: int = N, pad: int = PAD_AMOUNT) -> None:
    """A row's outputs at its real tokens are the same alone and padded by ``pad`` tokens in a longer batch (left
    for causal, right for bidirectional), in every mode the variant supports: within ``ATOL`` for exact variants,
    ``error_bound`` (relative) for approximate ones. A variant that declares ``padding_amount_invariant = False``
    is not checked."""
    if not variant.padding_amount_invariant:
        return
    for causal in modes(type(variant)):
        difference = padding_amount_difference(variant, causal, n, pad)
        limit = ATOL if variant.exact else variant.error_bound  # approximate: the same scale as its bound
        if difference > limit:
            raise AssertionError(
                f"attention-zoo variant {variant.name!r} ({'causal' if causal else 'bidirectional'}): a row of {n} "
                f"real tokens gives outputs {difference:.3g} apart alone and padded by {pad} tokens "
                f"({'left' if causal else 'right'}) in a batch (limit {limit:g}). What its pattern depends on (block "
                "boundaries, columns, a random layout) must count from each row's first real token (call.row_start) "
                "and its own length, or the variant declares padding_amount_invariant = False with a "
                "padding_amount_reason."
            )


# ------------------------------------------------------------------------------------------------------
# memory


class LargestAllocation(TorchDispatchMode):
    """Records the largest storage (in elements, ``largest``) and the longest dimension (``longest_dim``) of any
    tensor an op produces, forward and backward: tests use it to show a sub-quadratic kernel never allocates
    anything of size n x n (or pads a short input up to a window).

    ``with LargestAllocation() as probe: ...; probe.largest``."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.longest_dim = 0
        self.largest_op = ""  # the aten op that produced the largest tensor, and that tensor's shape and dtype
        self.largest_shape: tuple[int, ...] = ()
        self.largest_dtype: torch.dtype | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                size = t.untyped_storage().nbytes() // t.element_size()
                if size > self.largest:
                    self.largest, self.largest_op = size, str(func)
                    self.largest_shape, self.largest_dtype = tuple(t.shape), t.dtype
                self.longest_dim = max(self.longest_dim, *t.shape, 0)
        return out

    def describe(self) -> str:
        """What allocated the largest tensor: ``aten.op -> (shape) dtype``."""
        return f"{self.largest_op} -> {tuple(self.largest_shape)} {self.largest_dtype}"


def declares_subquadratic_memory(cls: type[Variant] | Variant) -> bool:
    """False when ``memory_complexity`` mentions n² anywhere (``n²``, ``n^2``, ``n**2``, ``n·n``, ``n x n``)."""
    return re.search(r"n\s*(²|\^\s*2|\*\*\s*2|[·*×x]\s*n\b)", cls.memory_complexity) is None


def largest_allocation(
    variant: Variant, n: int = MEMORY_CHECK_LENGTH, causal: bool = False, padded: bool = True, head_dim: int = 16,
    batch: int = 1, heads: int = 1, probe: LargestAllocation | None = None, **call_fields,
) -> int:
    """Elements of the largest tensor one forward and backward of ``variant`` produces at length ``n``
    (q/k/v (batch, heads, n, head_dim); ``padded``: the last n/16 tokens of the last row are padding;
    ``call_fields``: other :class:`AttentionCall` fields, e.g. ``extra={"global_attention_mask": ...}``). Pass a
    ``probe`` to read what allocated it (:meth:`LargestAllocation.describe`)."""
    q, k, v, _ = make_inputs(n=n, padding=None, batch=batch, heads=heads, head_dim=head_dim)
    mask = None
    if padded:
        mask = torch.ones(batch, n, dtype=torch.bool)
        mask[-1, n - n // 16 :] = False
    leaves = [x.requires_grad_() for x in (q, k, v)]
    call = make_call(causal, mask, head_dim=head_dim, variant=variant, heads=heads, **call_fields)
    probe = probe if probe is not None else LargestAllocation()
    with probe:
        out = run_variant(variant, *leaves, call)
        out.sum().backward()
    return probe.largest


def assert_memory_below_quadratic(variant: Variant, n: int = MEMORY_CHECK_LENGTH, **kwargs) -> None:
    """A variant that declares sub-quadratic memory allocates no tensor of n²/8 elements or more at length n,
    forward and backward, in every mode it supports (batch 1, one head: the limit is per (batch, head))."""
    batch, heads = kwargs.get("batch", 1), kwargs.get("heads", 1)
    limit = n * n // QUADRATIC_FRACTION * batch * heads
    for causal in modes(type(variant)):
        probe = LargestAllocation()
        largest = largest_allocation(variant, n, causal=causal, probe=probe, **kwargs)
        if largest >= limit:
            raise AssertionError(
                f"attention-zoo variant {variant.name!r} declares memory {variant.memory_complexity} but allocated a "
                f"tensor of {largest} elements (>= n²/{QUADRATIC_FRACTION} per head = {limit} at n = {n}, batch "
                f"{batch}, {heads} head(s), {'causal' if causal else 'bidirectional'}, forward and backward): "
                f"{probe.describe()}. Find the op that builds it (an n x n score or mask, or a tensor that grows "
                "faster than the keys each query reads) and compute it in blocks; if the variant really needs "
                "O(n²) memory, declare it."
            )


# ------------------------------------------------------------------------------------------------------
# persistence


def assert_reloads_identically(
    model: transformers.PreTrainedModel, inputs: dict, path: str | Path | None = None, **compare
) -> transformers.PreTrainedModel:
    """Save ``model`` (put in eval mode) with ``save_pretrained``, load it back with ``from_pretrained`` of the same
    class, check it uses the same variant and parameters and gives the same first output (``last_hidden_state``
    or ``logits``) on ``inputs``; returns the reloaded model. ``path``: where to save (default a temporary folder);
    ``compare``: tolerances for ``torch.testing.assert_close``."""
    model.eval()
    with torch.no_grad():
        before = model(**inputs)[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(path if path is not None else tmp)
        model.save_pretrained(folder)
        reloaded = type(model).from_pretrained(folder).eval()
    saved, loaded = variant_spec(model.config), variant_spec(reloaded.config)
    if saved is not None:
        if loaded is None or (loaded["variant"], loaded["params"]) != (saved["variant"], saved["params"]):
            raise AssertionError(f"the reloaded model's attention-zoo entry {loaded} differs from the saved {saved}")
        if reloaded.config._attn_implementation != IMPLEMENTATION:
            raise AssertionError(f"the reloaded model runs {reloaded.config._attn_implementation!r}, not the zoo")
    with torch.no_grad():
        after = reloaded(**inputs)[0]
    torch.testing.assert_close(after, before, msg=lambda m: f"reloaded model's output differs: {m}", **compare)
    return reloaded


def assert_weights_train_and_reload(model: transformers.PreTrainedModel, inputs: dict) -> None:
    """The variant's learned weights in ``model`` are parameters the optimizer sees, every one gets a finite, nonzero
    gradient, and after a change (as training makes) ``save_pretrained`` / ``from_pretrained`` restores them exactly
    and the outputs with them."""
    named = {key: p for key, p in model.named_parameters() if f".{WEIGHTS_NAME}." in f".{key}"}
    if not named:
        raise AssertionError(f"{type(model).__name__} has no {WEIGHTS_NAME!r} parameters: make_module returned None?")
    model.train()
    out = model(**inputs)[0]
    (out.float() * torch.randn(out.shape, generator=torch.Generator().manual_seed(0))).sum().backward()
    for key, param in named.items():
        if param.grad is None or not torch.isfinite(param.grad).all() or param.grad.abs().max() == 0:
            raise AssertionError(f"learned weight {key} gets no (finite, nonzero) gradient: {param.grad}")
    with torch.no_grad():
        for param in named.values():
            param.add_(0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)).to(param))
    reloaded = assert_reloads_identically(model, inputs)
    state = reloaded.state_dict()
    for key, param in named.items():
        torch.testing.assert_close(state[key], param.detach(), atol=0, rtol=0, msg=lambda m, k=key: f"{k}: {m}")


# ------------------------------------------------------------------------------------------------------
# decoding

DECODE_PROMPT_LENGTH = 40  # longer than every test_params window, stride and block of the built-ins
DECODE_NEW_TOKENS = 6


def causal_lm(name: str, **params) -> transformers.PreTrainedModel:
    """A tiny 2-layer Llama (GQA) running variant ``name`` with its ``test_params`` and ``params``, in eval mode,
    its output embeddings scaled so that greedy choices of an untrained model are not ties."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_model_config("llama", name, **params)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    return model


def decode_prompts(length: int = DECODE_PROMPT_LENGTH, batch: int = 2, left_pad: int = 5):
    """``input_ids`` (batch, length) and an ``attention_mask`` whose first row is left-padded by ``left_pad``."""
    ids = torch.randint(3, 64, (batch, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :left_pad] = 0
    return ids, mask


def greedy(model: transformers.PreTrainedModel, ids, mask, new_tokens: int = DECODE_NEW_TOKENS, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                          **kwargs)


def decoding_refusal(model: transformers.PreTrainedModel) -> str | None:
    """The variant's documented refusal to decode with a cache (its ``cache_layer`` raises), or None."""
    try:
        make_cache(model)
    except (ValueError, NotImplementedError) as exc:
        return str(exc)
    return None


def assert_decodes_like_the_full_forward(name: str, **params) -> None:
    """Greedy ``generate`` with the variant's own cache gives the tokens of ``generate(use_cache=False)`` (a full
    forward per step), on a batch with a left-padded row and prompts longer than any window of its
    ``test_params``. A variant whose cache is refused must refuse ``generate`` too (with its message)."""
    model = causal_lm(name, **params)
    ids, mask = decode_prompts()
    with torch.no_grad():
        full = greedy(model, ids, mask, use_cache=False)
        refusal = decoding_refusal(model)
        if refusal is not None:
            try:
                greedy(model, ids, mask)
            except (ValueError, NotImplementedError):
                return
            raise AssertionError(f"{name}: make_cache refuses ({refusal}) but generate with a cache ran")
        cached = greedy(model, ids, mask)
    if not torch.equal(cached, full):
        raise AssertionError(
            f"attention-zoo variant {name!r}: greedy decoding with its cache differs from the full forward "
            f"(left-padded batch, prompt of {ids.shape[-1]} tokens):\ncached {cached[:, ids.shape[-1]:].tolist()}\n"
            f"full   {full[:, ids.shape[-1]:].tolist()}. Its cache drops keys its pattern still reaches, or its "
            "decoding path reads other keys than its pattern."
        )


def declares_bounded_cache(name: str, **params) -> bool:
    """True when the variant decodes with a cache that does not grow with the context (windowed, recurrent or
    budgeted)."""

    config = tiny_model_config("llama", name, **params)
    try:
        cache = make_cache(config)
    except (ValueError, NotImplementedError):
        return False
    return all(isinstance(layer, (WindowedLayer, RecurrentLayer, BudgetedLayer)) for layer in cache.layers)


def assert_cache_bytes_bounded(name: str, lengths: tuple[int, int] = (64, 96), **params) -> None:
    """A bounded cache holds the same bytes after decoding from prompts of two lengths."""

    model = causal_lm(name, **params)
    sizes = []
    for length in lengths:
        with torch.no_grad():
            out = greedy(model, *decode_prompts(length), return_dict_in_generate=True)
        sizes.append(cache_nbytes(out.past_key_values))
    if sizes[0] != sizes[1]:
        raise AssertionError(
            f"attention-zoo variant {name!r} declares a bounded decoding cache, but it holds {sizes[0]} bytes after a "
            f"{lengths[0]}-token prompt and {sizes[1]} after a {lengths[1]}-token one."
        )
