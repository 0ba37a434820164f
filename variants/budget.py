"""``budget``: bounded decoding memory for a model trained with full attention, no retraining. Forwards without a
cache (training, scoring, ``use_cache=False``) run the ``inner`` variant unchanged; decoding keeps, per batch row and
KV head, the first ``sinks`` real tokens, the last ``recent`` ones and the best-scoring others up to ``tokens`` keys
in all (:class:`zoo.cache.BudgetedLayer`), evicting after a call once it holds more than ``tokens + slack``
(default ``slack``: ``tokens // 16``, so a decoding step scores and moves keys once per ``tokens // 16 + 1`` tokens;
``slack=0``: after every call), also between the chunks of ``generate(prefill_chunk_size=...)``. Scores come from
this kernel's own call (the queries, the kept keys, each query's softmax; :mod:`zoo.ops.kept`), never from an n x n
matrix. A decoding step writes its key into buffers with a row of room and evicts in place (``tokens + slack + 1``
rows held, all counted by ``zoo.cache_nbytes``).

``zoo.configure(model, "budget", inner="sdpa", tokens=512, sinks=4, recent=64, policy="snapkv")``; ``tokens`` may be
a list (one value per layer), or use ``hybrid`` to mix full, window and budgeted layers. ``policy`` is a KV policy
(:mod:`zoo.cache.policies`), built in or from a plugin (entry point group ``attention_zoo.kv_policies``): its name,
a dict of its name and fields (``{"name": "snapkv", "window": 64, "pool": 5}``, what config.json keeps) or a
``zoo.cache.Policy`` object (kept as its dict), built once here; the cache and this kernel ask it what to record
and how to score. The old ``window`` parameter is deprecated: it sets the window of ``snapkv`` and
``expected_attention`` as it did, with a DeprecationWarning. While nothing was evicted the
inner variant runs the call (so with ``tokens`` >= the context it is ``inner`` exactly); after that each KV head's
own keys (:func:`zoo.ops.kept.kept_attention`; H2O always, it needs every query's attention mass).
"""

from __future__ import annotations

from typing import Any

import torch

from zoo.cache import POLICIES, BudgetedLayer, Policy
from zoo.cache.policies import DEFAULT_POLICY, PolicyParameterError, PolicySpec, as_policy, with_old_window
from zoo.ops.kept import kept_attention
from zoo.registry import UnknownPolicyError, get_policy_class, get_variant_class, list_policies
from zoo.variant import AttentionCall, Param, Variant, VariantParameterError

SLACK_SHARE = 16  # the default slack is tokens // 16: a policy scores every kept key once per tokens // 16 + 1 tokens


class BudgetAttention(Variant):
    name = "budget"
    exact = True  # without a cache: the inner variant's attention; what eviction changes is decoding (README)
    time_complexity = "O(n²) prefill (the inner variant's); O(tokens) per decoded token"
    memory_complexity = "O(n)"
    params = {
        "inner": Param("sdpa", str, "the exact full-attention variant that runs forwards without eviction"),
        "tokens": Param(512, int, "keys kept per row and KV head, sinks and recent included", min=1, per_layer=True),
        "sinks": Param(4, int, "first real tokens of each row never evicted", min=0),
        "recent": Param(64, int, "most recent tokens never evicted", min=0),
        "policy": Param(DEFAULT_POLICY, (str, dict, Policy), "how the other kept keys are chosen: a KV policy's "
                        f"name ({', '.join(POLICIES)} or a plugin's), a dict of its name and fields "
                        "({'name': 'snapkv', 'window': 64}) or a zoo.cache.Policy"),
        "slack": Param(None, int, "evict once more than tokens + slack keys are held (0: after every call; None: "
                       f"tokens // {SLACK_SHARE}, so scoring and moving keys cost O(1) per decoded token amortised)",
                       min=0, optional=True),
        "window": Param(None, int, "deprecated: the policy's own field now, e.g. policy={'name': 'snapkv', 'window': "
                        "32}", min=1, optional=True),
    }
    test_params = {"tokens": 48, "sinks": 2, "recent": 8, "policy": "h2o"}

    def check_config(self) -> None:
        if self.inner in ("budget", "hybrid"):
            raise VariantParameterError(f"attention-zoo variant 'budget': parameter 'inner' = {self.inner!r} is "
                                        "invalid; use an exact full-attention variant such as 'sdpa' or 'dense'.")
        try:
            inner = get_variant_class(self.inner)()
        except Exception as exc:
            message = f"attention-zoo variant 'budget': parameter 'inner' = {self.inner!r}: {exc}"
            raise VariantParameterError(message) from exc
        if not inner.exact or inner.pattern(AttentionCall(causal=True, scaling=1.0), 1, 1) is not None:
            raise VariantParameterError(
                f"attention-zoo variant 'budget': parameter 'inner' = {self.inner!r} is not an exact full-attention "
                "variant (sdpa, dense): eviction scores assume every earlier key was visible. For windows per layer "
                "combine 'budget' and 'longformer' in a 'hybrid'."
            )
        self.inner_variant = inner
        self.kv_policy = self._built_policy()
        for tokens in self.tokens if isinstance(self.tokens, list) else [self.tokens]:
            if tokens < self.sinks + self.recent:
                raise VariantParameterError(
                    f"attention-zoo variant 'budget': parameter 'tokens' = {tokens} is invalid; it counts the sinks "
                    f"and the recent keys, so it must be >= sinks + recent = {self.sinks + self.recent}."
                )

    def _built_policy(self) -> Policy:
        """The policy object. ``config['policy']`` keeps a name as given, else becomes the policy's JSON form (a
        dict); the deprecated ``window`` moves into the policy (and becomes None)."""
        given = policy = _policy(self.policy)
        if self.window is not None:
            if not isinstance(self.policy, str):
                raise VariantParameterError(
                    "attention-zoo variant 'budget': parameter 'window' is deprecated and the policy is given with "
                    f"its fields ({self.policy!r}); set the window there, e.g. policy={{'name': {given.name!r}, "
                    f"'window': {self.window}}}, and drop 'window'."
                )
            policy = with_old_window(given, self.window, "variant 'budget'")
            self.config["window"] = None
        named = isinstance(self.policy, str) and policy == given
        self.config["policy"] = self.policy if named else policy.to_dict()
        return policy

    def cache_layer(self, layer_idx: int, config: Any) -> BudgetedLayer:
        return self.layer_of(self.per_layer("tokens", layer_idx), getattr(config, "max_position_embeddings", None))

    def layer_of(self, tokens: int, max_positions: int | None = None) -> BudgetedLayer:
        """The cache layer that keeps ``tokens`` keys under this variant's policy, sinks, recent keys and slack."""
        slack = tokens // SLACK_SHARE if self.slack is None else self.slack
        return BudgetedLayer(tokens, self.sinks, self.recent, self.kv_policy, slack, max_positions=max_positions)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        layer = call.cache
        if not isinstance(layer, BudgetedLayer):  # no cache, or one that keeps every key
            return self.inner_variant.attend(q, k, v, call)
        mass = None
        if layer.evicted or layer.accumulates:
            real = layer.real[:, 0, -q.shape[-2] :]
            query_pos = torch.arange(layer.seen - q.shape[-2], layer.seen, device=q.device)
            out, mass = kept_attention(q, layer.keys, layer.values, layer.pos, layer.real, query_pos, call.scaling,
                                       query_real=real, want_mass=layer.accumulates)
        else:
            out = self.inner_variant.attend(q, k, v, call)
        layer.observe(q, mass, call.scaling, call.row_start)
        return out

    def flops(self, n: int, heads: int, head_dim: int, causal: bool = False) -> float:
        return self.inner_variant.flops(n, heads, head_dim, causal)


def _policy(spec: PolicySpec) -> Policy:
    """The KV policy ``spec`` gives (names through :func:`zoo.registry.get_policy_class`), or the parameter error
    saying why not."""
    try:
        return as_policy(spec, get_policy_class)
    except UnknownPolicyError as exc:
        allowed = ", ".join(repr(policy) for policy in list_policies())
        raise VariantParameterError(f"attention-zoo variant 'budget': parameter 'policy' = {spec!r} is invalid; "
                                    f"allowed: one of {allowed}.") from exc
    except PolicyParameterError as exc:
        raise VariantParameterError(f"attention-zoo variant 'budget': parameter 'policy' = {spec!r}: {exc}") from exc
    except Exception as exc:  # a plugin's policy that failed to import or is claimed twice
        raise VariantParameterError(f"attention-zoo variant 'budget': parameter 'policy' = {spec!r}: {exc}") from exc
