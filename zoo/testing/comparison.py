"""Outputs against the dense reference: real rows, the relative error, the exact/approximate comparison, and the
check that the amount of padding changes nothing.
"""

from __future__ import annotations

import torch
import transformers

from zoo.plug.dispatch import run_variant
from zoo.registry import get_variant_class
from zoo.testing.inputs import (
    ATOL,
    DECODER_FAMILIES,
    HEAD_DIM,
    HEADS,
    N,
    make_call,
    model_inputs,
    modes,
    tiny_model_config,
)
from zoo.variant import Variant


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


AUTOCAST_TOLERANCE = {torch.bfloat16: 0.05, torch.float16: 0.01}  # relative logits error vs fp32 (autocast)
APPROXIMATE_AUTOCAST_FACTOR = 3  # approximate variants: bf16 rounding may flip a discrete choice (LSH buckets)


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
