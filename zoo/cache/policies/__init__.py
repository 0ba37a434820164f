"""KV policies: how a :class:`~zoo.cache.BudgetedLayer` chooses the keys it keeps beyond the sinks and the recent ones.

One frozen dataclass per policy and file over :class:`Policy` (:mod:`zoo.cache.policies.base`, which owns the choice),
its parameters as fields; the scores are in :mod:`zoo.ops.kept`. A policy is given by name (``"snapkv"``), as a dict
of its name and fields (``{"name": "snapkv", "window": 64, "pool": 5}``, what config.json stores) or as an instance
(``SnapKV(window=64)``): :func:`as_policy` reads all three. :data:`DEFAULT_POLICY` is the default of the cache, the
``budget`` variant and ``zoo eval``. A third party adds a policy through the entry point group
``attention_zoo.kv_policies`` (name = a :class:`Policy` subclass whose ``name`` is that name;
:func:`zoo.registry.get_policy_class` finds it); its fields come through the dict form.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from zoo.cache.policies.base import (
    DEFAULT_QUERY_WINDOW,
    KeptKeys,
    Policy,
    PolicyParameterError,
    recorded_query_positions,
)
from zoo.cache.policies.expected_attention import ExpectedAttention
from zoo.cache.policies.h2o import H2O
from zoo.cache.policies.knorm import KNorm
from zoo.cache.policies.sinks_recent import SinksRecent
from zoo.cache.policies.snapkv import SnapKV
from zoo.cache.policies.tova import TOVA

BUILT_IN_POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (SinksRecent, KNorm, TOVA, H2O, SnapKV, ExpectedAttention)
}
POLICIES = tuple(BUILT_IN_POLICIES)  # the built-in policies' names
DEFAULT_POLICY = SnapKV.name  # the most robust policy in `zoo eval` (docs/guides/long-context-eval.md)
OLD_WINDOW_POLICIES = ("snapkv", "expected_attention")  # the policies the budget variant's `window` used to set

PolicySpec = str | Mapping[str, Any] | Policy  # what as_policy reads


def _built_in(name: str) -> type[Policy]:
    cls = BUILT_IN_POLICIES.get(name)
    if cls is None:
        raise PolicyParameterError(
            f"unknown policy {name!r}; use one of {', '.join(POLICIES)}, or pass a Policy object (a plugin's: "
            "zoo.registry.get_policy_class(name)(...))."
        )
    return cls


def as_policy(spec: PolicySpec, lookup: Callable[[str], type[Policy]] | None = None) -> Policy:
    """The policy ``spec`` gives: a :class:`Policy` itself, a name, or a dict of the name and fields.

    Args:
        spec: ``"snapkv"``, ``{"name": "snapkv", "window": 64}`` or ``SnapKV(window=64)``.
        lookup: finds a policy class by name; default the built-in ones (the ``budget`` variant passes
            :func:`zoo.registry.get_policy_class`, which also knows plugins').

    Raises:
        PolicyParameterError: an unknown name or field, a value of the wrong type or out of range.
    """
    if isinstance(spec, Policy):
        return spec
    if isinstance(spec, str):
        name, values = spec, {}
    elif isinstance(spec, Mapping):
        values = dict(spec)
        name = values.pop("name", None)
        if not isinstance(name, str):
            raise PolicyParameterError(f"KV policy {dict(spec)!r}: a policy given as a dict needs its name, e.g. "
                                       "{'name': 'snapkv', 'window': 64}.")
    else:
        raise PolicyParameterError(f"KV policy {spec!r}: give a name ('snapkv'), a dict of its name and fields "
                                   "({'name': 'snapkv', 'window': 64}) or a zoo.cache.Policy object.")
    return (lookup or _built_in)(name).from_fields(values)


def policy_label(spec: PolicySpec) -> str:
    """A short label: the name alone, or with the fields a dict gives (``snapkv(window=64,pool=5)``, no spaces)."""
    if isinstance(spec, str):
        return spec
    values = spec.to_dict() if isinstance(spec, Policy) else dict(spec)
    name = values.pop("name", "?")
    return f"{name}({','.join(f'{k}={v}' for k, v in values.items())})" if values else str(name)


def with_old_window(policy: Policy, window: int, where: str) -> Policy:
    """``policy`` as the deprecated ``window`` parameter (of ``where``: the ``budget`` variant, the cache) set it,
    with a DeprecationWarning: the window of ``snapkv`` and ``expected_attention``; the others kept their own (TOVA:
    the current query) or recorded no queries."""
    mapped = policy.name in OLD_WINDOW_POLICIES and hasattr(policy, "window")
    warnings.warn(
        f"attention-zoo {where}: parameter 'window' is deprecated, a KV policy owns its window now; "
        + (f"pass policy={{'name': {policy.name!r}, 'window': {window}}} instead." if mapped else
           f"policy {policy.name!r} never read it: drop it."),
        DeprecationWarning, stacklevel=3,
    )
    return dataclasses.replace(policy, window=int(window)) if mapped else policy


__all__ = [
    "BUILT_IN_POLICIES", "DEFAULT_POLICY", "DEFAULT_QUERY_WINDOW", "H2O", "OLD_WINDOW_POLICIES", "POLICIES", "TOVA",
    "ExpectedAttention", "KNorm", "KeptKeys", "Policy", "PolicyParameterError", "PolicySpec", "SinksRecent",
    "SnapKV", "as_policy", "policy_label", "recorded_query_positions", "with_old_window",
]
