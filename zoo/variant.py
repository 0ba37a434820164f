"""The variant contract: what every attention variant (built-in or plugin) declares and implements.

A variant file holds two things side by side:

* its **pattern** -- for sparse variants an index predicate ``(batch, head, q_idx, kv_idx) -> bool``
  in the style of ``transformers.masking_utils`` (the spec the tests hold the kernel to), and
* its **kernel** -- `Variant.attend`, the fast implementation.

The plug (`zoo.plug.dispatch.run_variant`) hands the kernel grouped-query-expanded ``q, k, v`` of shape
``(batch, heads, seq, head_dim)`` and an `zoo.call.AttentionCall` describing causality, padding,
scaling and dropout. The kernel returns ``(batch, heads, q_len, head_dim)``.

This module, `zoo.call`, `zoo.pattern`, `zoo.cache`, `zoo.ops` and `zoo.testing` are the
plugin API (`PLUGIN_API_VERSION`, changes in CHANGELOG.md).
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers.cache_utils import CacheLayerMixin

from zoo.cache import pattern_cache_layer
from zoo.call import AttentionCall
from zoo.ops import allowed_mask, softmax_attention
from zoo.ops.patterned import pattern_attention, pattern_flops
from zoo.pattern import Pattern, PredicateOnly

__all__ = [
    "AttentionCall",
    "LayerWeights",
    "PLUGIN_API_VERSION",
    "Param",
    "TransferStage",
    "Variant",
    "VariantParameterError",
    "auxiliary_losses",
    "reference",
]

PLUGIN_API_VERSION = 2
"""The version of the plugin API (what docs/plugins/index.md, "Writing a variant", uses). 1: attention-zoo 0.1.0, where
``pattern()`` returned a bare predicate; 2: ``pattern()`` returns a `zoo.pattern.Pattern` (CHANGELOG.md)."""

logger = logging.getLogger(__name__)


class VariantParameterError(ValueError):
    """A variant parameter has the wrong type or is out of its allowed range."""


@dataclass(frozen=True)
class Param:
    """One public parameter of a variant: default, type and allowed values.

    ``per_layer=True`` also accepts a list with one value per layer (e.g. Longformer's window).
    """

    default: Any
    type: type | tuple[type, ...]
    doc: str = ""
    min: float | None = None
    max: float | None = None
    choices: tuple | None = None
    per_layer: bool = False
    optional: bool = False
    list_of: type | None = None

    def allowed(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        kind = f"list of {self.list_of.__name__}" if self.list_of else _type_name(self.type)
        if self.min is not None and self.max is not None:
            kind += f" in [{self.min}, {self.max}]"
        elif self.min is not None:
            kind += f" >= {self.min}"
        elif self.max is not None:
            kind += f" <= {self.max}"
        if self.per_layer:
            kind += " (or a list with one value per layer)"
        if self.optional:
            kind += " or None"
        return kind

    def validate(self, variant: str, name: str, value: Any) -> Any:
        def fail() -> VariantParameterError:
            return VariantParameterError(
                f"attention-zoo variant {variant!r}: parameter {name!r} = {value!r} is invalid; "
                f"allowed: {self.allowed()}."
            )

        if value is None and self.optional:
            return None
        if self.per_layer and isinstance(value, (list, tuple)):
            if not value:
                raise fail()
            return [self._check_scalar(v, fail) for v in value]
        if self.list_of is not None:
            if not isinstance(value, (list, tuple)):
                raise fail()
            return [self._check_scalar(v, fail, self.list_of) for v in value]
        return self._check_scalar(value, fail)

    def _check_scalar(self, value: Any, fail: Callable[[], Exception], expected: Any = None) -> Any:
        expected = expected or self.type
        if isinstance(value, bool) and expected in (int, float):
            raise fail()
        if expected is float and isinstance(value, int):
            value = float(value)
        if not isinstance(value, expected):
            raise fail()
        if self.choices is not None and value not in self.choices:
            raise fail()
        if self.min is not None and value < self.min:
            raise fail()
        if self.max is not None and value > self.max:
            raise fail()
        return value


def _type_name(t: type | tuple[type, ...]) -> str:
    if isinstance(t, tuple):
        return " or ".join(x.__name__ for x in t)
    return t.__name__


_INSTANCE_MEMBERS = ("config",)  # set in Variant.__init__, not on the class


class LayerWeights(torch.nn.Module):
    """Base class of a variant's learned per-layer weights (what `Variant.make_module` returns), declaring the
    two optional hooks the zoo calls (a plain ``nn.Module`` works too, without hooks):

    * ``needs_hidden_states = True``: the attention module's input is in ``self.hidden_states`` during the call
      (Longformer's global projections project the hidden states, not the layer's q/k/v);
    * `initialize_from`: derive initial values from the layer's own weights, once they are final;
    * ``auxiliary_loss = "name"``: the weights add a loss of their own to the backward in a training forward (DSA's
      indexer KL) and keep its last value, detached, in ``self.last_loss``; `auxiliary_losses` collects them for the
      recipes' logs.
    """

    needs_hidden_states: ClassVar[bool] = False
    auxiliary_loss: ClassVar[str | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.hidden_states: torch.Tensor | None = None
        self.last_loss: torch.Tensor | None = None

    def initialize_from(self, attention: torch.nn.Module) -> None:
        """Called (under no_grad) with the attention module; the default keeps the constructor's values."""


def auxiliary_losses(model: torch.nn.Module, reset: bool = False) -> dict[str, torch.Tensor]:
    """``{name: sum}`` of the last `LayerWeights.auxiliary_loss` values held in ``model`` (detached; empty before a
    training forward); ``reset`` forgets them, so the next read sees only later forwards."""
    sums: dict[str, torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, LayerWeights) and module.auxiliary_loss and module.last_loss is not None:
            value, name = module.last_loss.detach().float(), module.auxiliary_loss
            sums[name] = value if name not in sums else sums[name] + value.to(sums[name].device)
            if reset:
                module.last_loss = None
    return sums


@dataclass(frozen=True)
class TransferStage:
    """A variant's own stage 1 of a retrofit (`Variant.transfer_stage`): its layer trains with ``params`` over the
    configured ones, by its weights' auxiliary loss ``measure`` (reported before and after, per layer); the
    retrofitted model runs the configured parameters."""

    params: Mapping[str, Any]
    measure: str


class Variant:
    """Base class for attention variants. Subclass it, fill the class attributes, implement ``attend``.

    Class attributes (all public, shown by ``zoo list``):

    * ``name`` -- registry name (the entry-point name).
    * ``exact`` -- True if the output equals softmax attention restricted to ``pattern`` (fp32, atol 1e-5).
    * ``supports_causal`` / ``supports_bidirectional``.
    * ``time_complexity`` / ``memory_complexity`` -- in n (sequence length), e.g. ``"O(n·w)"``.
    * ``params`` -- ``{name: Param}``; validated at `zoo.configure` time. Read a parameter as an attribute
      (``self.window``), a ``per_layer`` one with `per_layer`. A parameter may not be named like a member
      of the class (``name``, ``exact``, ``flops``, ``pattern``, ``config``, a method of your own...): that is
      an error when the class is defined.
    * ``renamed_params`` -- ``{old name: new name}`` for parameters renamed since models were saved: an old name
      is accepted (and logged) wherever parameters are given, so saved configs keep loading.
    * ``supports_dropout`` -- if False, attention dropout > 0 in training raises a clear error.
    * ``trains_every_parameter`` -- False if the kernel leaves some of the model's attention parameters without a
      gradient by design (``reformer``'s shared-QK leaves the key projection unused); distributed training then
      looks for unused parameters each step (DDP's ``find_unused_parameters``), which it skips otherwise.
    * ``grouped_kv`` -- True if ``attend`` takes grouped-query keys unexpanded (k/v with H_kv heads, query head i
      reading key/value head i // (H / H_kv)); False (the default): the plug repeats them to one per query head.
    * ``error_bound`` -- approximate variants: the max relative error (Frobenius norm of the
      difference over the norm of the reference) at default parameters on the contract suite's inputs.
      The reference is softmax attention restricted to ``pattern``, unless the variant defines an optional
      ``reference(q, k, v, call)`` method: the O(n²) readable definition of an attention that is not
      softmax (e.g. ``linear``), used by the tests only.
    * ``padding_amount_invariant`` -- True (the default) when a row's outputs at its real tokens do not depend on
      how much padding its batch adds (what the pattern depends on counts from each row's first real token and
      its own length); a variant for which that cannot hold sets False and says why in
      ``padding_amount_reason`` (the contract suite then skips the check, docs/guides/supported-models.md lists it).
    """

    name: ClassVar[str] = ""
    exact: ClassVar[bool] = True
    supports_causal: ClassVar[bool] = True
    supports_bidirectional: ClassVar[bool] = True
    supports_dropout: ClassVar[bool] = True
    trains_every_parameter: ClassVar[bool] = True
    grouped_kv: ClassVar[bool] = False
    time_complexity: ClassVar[str] = "O(n²)"
    memory_complexity: ClassVar[str] = "O(n²)"
    params: ClassVar[dict[str, Param]] = {}
    error_bound: ClassVar[float | None] = None
    # Parameters the contract suite uses so its small inputs exercise the pattern (e.g. a window of
    # 8 at n=64 instead of 512). Plugin authors set these for their own variant.
    test_params: ClassVar[dict[str, Any]] = {}
    renamed_params: ClassVar[dict[str, str]] = {}
    padding_amount_invariant: ClassVar[bool] = True
    padding_amount_reason: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for pname in cls.params:
            owner = next((c for c in reversed(cls.__mro__) if pname in vars(c)), None)  # the first to define it
            if owner is not None or pname in _INSTANCE_MEMBERS:
                member = f"{(owner or Variant).__name__}.{pname}"
                raise TypeError(
                    f"attention-zoo variant class {cls.__name__}: parameter {pname!r} has the name of the member "
                    f"{member}, so `self.{pname}` would not return the parameter. Rename the parameter (e.g. "
                    f"{pname + '_value'!r}); if models were saved with the old name, also declare "
                    f"renamed_params = {{{pname!r}: <new name>}} so they keep loading."
                )
        if "pattern" in vars(cls):
            cls.pattern = _returning_a_pattern(cls, vars(cls)["pattern"])
        for old, new in cls.renamed_params.items():
            if old in cls.params or new not in cls.params:
                raise TypeError(
                    f"attention-zoo variant class {cls.__name__}: renamed_params {{{old!r}: {new!r}}} must map an old "
                    f"name that is no longer a parameter to a current one (parameters: {', '.join(cls.params)})."
                )

    @classmethod
    def _with_current_names(cls, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` with old names (``renamed_params``) replaced by the current ones, one log line each."""
        params = dict(params)
        for old, new in cls.renamed_params.items():
            if old not in params:
                continue
            if new in params:
                raise VariantParameterError(
                    f"attention-zoo variant {cls.name!r}: got both {old!r} and {new!r}, which is its new name; "
                    f"pass only {new!r}."
                )
            params[new] = params.pop(old)
            logger.warning(
                "attention-zoo variant %r: parameter %r is now called %r; using %s=%r (pass %r to drop this message).",
                cls.name, old, new, new, params[new], new,
            )
        return params

    def __init__(self, **params: Any) -> None:
        params = self._with_current_names(params)
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            known = ", ".join(sorted(self.params)) or "none"
            raise VariantParameterError(
                f"attention-zoo variant {self.name!r} has no parameter {unknown[0]!r}; its parameters: {known}."
            )
        self.config: dict[str, Any] = {}
        for pname, spec in self.params.items():
            value = params.get(pname, spec.default)
            self.config[pname] = spec.validate(self.name, pname, value)
        self.check_config()

    def check_config(self) -> None:
        """Cross-parameter validation hook (raise `VariantParameterError`)."""

    @classmethod
    def check_state(cls, state: Mapping[str, Any]) -> None:
        """Validation hook for the ``state`` the variant persists in config.json (``call.state``), run when a model
        is loaded: raise ``ValueError`` naming the key when a value is not what ``attend`` reads. Default: any."""

    def __getattr__(self, item: str) -> Any:
        config = self.__dict__.get("config")
        if config is not None and item in config:
            return config[item]
        raise AttributeError(item)

    def per_layer(self, name: str, layer_idx: int) -> Any:
        """Value of a ``per_layer`` parameter for one layer (lists cycle if shorter than the model)."""
        value = self.config[name]
        if isinstance(value, list):
            return value[layer_idx % len(value)]
        return value

    def flops(self, n: int, heads: int, head_dim: int, causal: bool = False) -> float:
        """Forward FLOPs of the attention core (QK^T and PV) at length n; the benchmark's GFLOP/s uses it.

        The default: a variant that runs on the shared pattern kernel (no ``attend`` of its own) counts what its
        pattern's block hints make that kernel compute (`zoo.ops.patterned.pattern_flops`); any other counts
        dense attention. Variants with kernels of their own override it with their kernel's cost.

        Args:
            n: the sequence length.
            heads: attention heads.
            head_dim: the size of each head.
            causal: count causal attention.

        Returns:
            Forward FLOPs of one call (batch 1).
        """
        if not self.overrides("attend"):
            pattern = self.pattern(AttentionCall(causal=causal, scaling=1.0), n, n)
            if pattern is not None and pattern.key_blocks is not None:
                return pattern_flops(pattern, n, heads, head_dim)
        return 4.0 * n * n * heads * head_dim * (0.5 if causal else 1.0)

    def make_module(self, layer_idx: int, config: Any, head_dim: int, num_heads: int) -> torch.nn.Module | None:
        """This layer's learned weights, or None (the default: a stateless kernel).

        Called once per attention module when the model is built (``from_config``, ``from_pretrained``) or
        configured (``zoo.configure(model, ...)``); the module is attached as ``<attention module>.attention_zoo``,
        so it trains, saves and loads with the model, and reaches the kernel as ``call.weights``. Initialise it in
        its constructor (PyTorch's default init, or your own): the zoo seeds the random generator per layer, so the
        values are deterministic -- a checkpoint without them gets the same ones. ``config`` is the model's
        transformers config (e.g. ``config.max_position_embeddings``, ``config.hidden_size``). A
        `LayerWeights` subclass declares the optional hooks: ``needs_hidden_states = True`` finds the attention
        module's input in ``.hidden_states`` during the call; ``initialize_from(attention_module)`` derives its values
        from the layer's own weights (called once they are final, also for a checkpoint that lacks the variant's).

        Args:
            layer_idx: the index of the attention layer.
            config: the model's transformers config.
            head_dim: the size of each attention head.
            num_heads: the query heads of the layer.

        Returns:
            An ``nn.Module`` (a `LayerWeights` to declare its hooks), or None.
        """
        return None

    def transfer_stage(self) -> TransferStage | None:
        """Optional hook for a retrofit's attention transfer (`zoo.retrofit`). None, the default: the layer's weights
        train to reproduce the original layer's output, as configured. A `TransferStage`: they train by their own
        auxiliary loss with other parameters (DSA's dense warm-up). Raise `VariantParameterError` for parameters a
        retrofit cannot start from."""
        return None

    def layer_weights(self, call: AttentionCall) -> torch.nn.Module:
        """``call.weights``, or a clear error when the attention module was built without them."""
        if call.weights is None:
            raise ValueError(
                f"attention-zoo variant {self.name!r} has learned per-layer weights, but this attention module has "
                "none (no `attention_zoo` submodule). Build the model from a config passed through zoo.configure "
                "(from_config / from_pretrained with `import zoo` done first), or call zoo.configure(model, ...) "
                "on the built model."
            )
        return call.weights

    supports_cross_attention: ClassVar[bool] = False

    def pattern(self, call: AttentionCall, q_len: int, kv_len: int) -> Pattern | None:
        """The keys each query may see, before causality and padding; the plug adds both.

        The one definition the reference, the decoding masks, the default cache and (for pattern-only plugins)
        the chunked kernel read. It may read ``call.row_start``, ``call.layer_idx`` and ``call.extra``, never the
        per-step positions (they reach the predicate as its arguments).

        Args:
            call: the call (causal, padding, row starts, layer).
            q_len: the number of queries.
            kv_len: the number of keys.

        Returns:
            A `zoo.pattern.Pattern`, or None when every key is allowed.
        """
        return None

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """Optional hook: the O(n²) readable definition of an attention that is not softmax restricted to
        ``pattern`` (e.g. ``linear``); tests only. A variant declares it by overriding it (`overrides`)."""
        raise NotImplementedError

    def attention_weights(self, q: torch.Tensor, k: torch.Tensor, call: AttentionCall) -> torch.Tensor | None:
        """Optional hook: the dense (batch, heads, q_len, kv_len) distribution of each query over the keys it may
        see (rows sum to 1; q and k as ``attend`` gets them), for training losses on short sequences (a retrofit's
        ``transfer.loss: attention``). O(n²): training and tests only. None, the default: the variant offers none."""
        return None

    def check_call(self, call: AttentionCall, where: str = "") -> None:
        """Refuse a call this variant does not support (causal / bidirectional mode, attention dropout), naming the
        variant, ``where`` it runs (e.g. a layer of a hybrid) and the fix."""
        if (self.supports_causal if call.causal else self.supports_bidirectional) and (
                call.dropout == 0 or not call.training or self.supports_dropout):
            return  # the common case, checked without building the message (every attention call)
        label = f"attention-zoo variant {self.name!r}" + (f" ({where})" if where else "")
        if call.causal and not self.supports_causal:
            raise ValueError(f"{label} does not support causal attention.")
        if not call.causal and not self.supports_bidirectional:
            raise ValueError(f"{label} supports causal attention only.")
        if call.effective_dropout > 0 and not self.supports_dropout:
            raise ValueError(
                f"{label} does not support attention dropout (got p={call.dropout}). Set the model's attention "
                "dropout to 0 (e.g. config.attention_probs_dropout_prob=0.0 for BERT, attention_dropout=0.0 for "
                "Llama/ModernBERT)" + (", or use another variant there." if where else ".")
            )

    @classmethod
    def overrides(cls, hook: str) -> bool:
        """True when this class overrides the optional hook ``hook`` of `Variant` (e.g. ``"reference"``)."""
        return getattr(cls, hook) is not getattr(Variant, hook)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """The kernel: attention of the queries over the keys, as ``call`` describes it.

        The default runs the variant's pattern on the shared chunked kernels (`zoo.ops.patterned.pattern_attention`)
        when it carries block hints (``block_size``, ``key_blocks``). The plug has already checked causal, dropout and
        cross-attention support (`check_call`) and zeroes padded query rows afterwards.

        Args:
            q: (batch, heads, q_len, head_dim) queries.
            k: (batch, heads, kv_len, head_dim) keys, grouped-query heads already expanded (unless ``grouped_kv``).
            v: (batch, heads, kv_len, head_dim) values.
            call: everything else about the call (`zoo.call.AttentionCall`).

        Returns:
            (batch, heads, q_len, head_dim), the dtype of ``q``.
        """
        pattern = self.pattern(call, q.shape[-2], k.shape[-2])
        if pattern is None or pattern.key_blocks is None:
            raise NotImplementedError(
                f"attention-zoo variant {self.name!r} has no kernel: implement attend(), or return from pattern() a "
                "zoo.pattern.Pattern with block_size and key_blocks (e.g. zoo.pattern.band_key_blocks) to run it on "
                "the shared chunked kernels."
            )
        return pattern_attention(q, k, v, call, pattern)

    def cache_layer(self, layer_idx: int, config: Any) -> CacheLayerMixin:
        """The decoding cache layer of one decoder layer (``config``: the model's text config).

        The default follows the variant's causal pattern (`zoo.cache.pattern_cache_layer`): a finite
        ``reach`` keeps the sinks and the last ``reach`` keys (a `zoo.cache.WindowedLayer`); otherwise every
        key (transformers' ``DynamicLayer``). Variants that need something else (a recurrent state) return a layer
        of `zoo.cache` and read it back in ``attend`` through ``call.cache``.

        Args:
            layer_idx: the index of the decoder layer.
            config: the model's text config.

        Returns:
            A transformers cache layer (``CacheLayerMixin``); raise ``ValueError`` to refuse decoding with a cache.
        """
        return pattern_cache_layer(self, layer_idx)

    @classmethod
    def describe(cls) -> dict[str, Any]:
        modes = [m for m, ok in (("causal", cls.supports_causal), ("bidirectional", cls.supports_bidirectional)) if ok]
        return {
            "name": cls.name,
            "kind": "exact" if cls.exact else "approximate",
            "modes": "/".join(modes),
            "time": cls.time_complexity,
            "memory": cls.memory_complexity,
            "params": {k: p.default for k, p in cls.params.items()},
        }



def reference(variant: Variant, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
    """What the kernel must equal (exact) or approximate: the variant's own ``reference`` if it defines
    one, else softmax attention restricted to its pattern, causality and padding (O(n²), tests only).
    Padded query rows are zero, as `zoo.plug.dispatch.run_variant` makes them."""
    if variant.overrides("reference"):
        out = variant.reference(q, k, v, call)
    else:
        pattern = variant.pattern(call, q.shape[-2], k.shape[-2])
        allowed = allowed_mask(call, pattern, q.shape[0], q.shape[1], q.shape[-2], k.shape[-2], q.device)
        out = softmax_attention(q, k, v, allowed, call.scaling)
    if call.padding_mask is not None and not call.cross_attention:
        out = out.masked_fill(~call.padding_mask[:, None, -out.shape[-2] :, None], 0.0)
    return out


# ------------------------------------------------------------------------------------------------------
# plugins written for an older plugin API


def plugin_label(cls: type) -> str:
    """``class Module.Name from distribution D`` (the distribution that installed the class's top-level package)."""
    top = cls.__module__.split(".")[0]
    names = importlib.metadata.packages_distributions().get(top) or ["(not installed as a distribution)"]
    return f"class {cls.__module__}.{cls.__qualname__} from distribution {', '.join(sorted(set(names)))}"


def _returning_a_pattern(cls: type, pattern_fn: Callable) -> Callable:
    """``pattern_fn`` checked: a `Pattern` or None passes; a bare predicate (plugin API 1) is wrapped as a
    `zoo.pattern.PredicateOnly` with one DeprecationWarning; anything else is a TypeError naming the fix."""
    if getattr(pattern_fn, "returns_a_pattern", False):
        return pattern_fn

    @functools.wraps(pattern_fn)
    def pattern(self, call, q_len, kv_len):
        result = pattern_fn(self, call, q_len, kv_len)
        if result is None or isinstance(result, Pattern):
            return result
        if callable(result):
            _warn_bare_predicate(cls)
            return PredicateOnly(result)
        raise TypeError(
            f"attention-zoo variant {cls.name!r} ({plugin_label(cls)}): pattern() returned a "
            f"{type(result).__name__}; it must return a zoo.pattern.Pattern (or None when every key is seen). "
            "Wrap the predicate: return zoo.pattern.Pattern(mask_mod, reach=..., block_size=..., key_blocks=...)."
        )

    pattern.returns_a_pattern = True
    return pattern


@functools.cache
def _warn_bare_predicate(cls: type) -> None:
    warnings.warn(
        f"attention-zoo variant {cls.name!r} ({plugin_label(cls)}) returns a bare predicate from pattern(), as "
        f"plugin API 1 (attention-zoo 0.1.0) did. It runs as a pattern without hints: the dense reference, a cache "
        f"that keeps every key, never FlexAttention. Fix: return zoo.pattern.Pattern(predicate, reach=..., "
        f"block_size=..., key_blocks=...) (see CHANGELOG.md, plugin API {PLUGIN_API_VERSION}).",
        DeprecationWarning,
        stacklevel=3,
    )
