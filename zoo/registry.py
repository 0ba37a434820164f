"""Variant and KV policy registry: entry points (groups ``attention_zoo.variants`` and ``attention_zoo.kv_policies``)
plus in-process registration.

The registry never imports a variant module itself; entry points (or the caller of
`register_variant`) do. A plugin that fails to import is reported with a warning and recorded,
so every other variant keeps working and asking for the broken one re-raises its cause. KV policies
(`zoo.cache.Policy` subclasses, for the `budget` variant's cache) are found the same way, beside the
built-in ones.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points

from zoo.cache.policies import BUILT_IN_POLICIES, Policy
from zoo.call import AttentionCall
from zoo.variant import Param, Variant

ENTRY_POINT_GROUP = "attention_zoo.variants"
POLICY_ENTRY_POINT_GROUP = "attention_zoo.kv_policies"
IN_PROCESS = "<in-process>"


class UnknownVariantError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


class UnknownPolicyError(UnknownVariantError):
    """No KV policy of that name (built in, or from an installed plugin)."""


class VariantConflictError(RuntimeError):
    """Two sources claim the same variant (or KV policy) name."""


class BrokenVariantError(ImportError):
    """The plugin providing a variant (or KV policy) failed to import."""


@dataclass(frozen=True)
class Source:
    distribution: str
    version: str
    entry_point: str

    def __str__(self) -> str:
        if self.distribution == IN_PROCESS:
            return f"{self.entry_point} (registered in-process)"
        return f"{self.entry_point} from distribution {self.distribution} {self.version}"


@dataclass
class _Entry:
    cls: type | None  # a Variant or a Policy subclass
    source: Source
    error: BaseException | None = None
    conflict: Source | None = None


_entries: dict[str, _Entry] = {}  # variants
_discovered = False
_policy_entries: dict[str, _Entry] = {}  # KV policies
_policies_discovered = False


def _add_to(entries: dict[str, _Entry], kind: str, name: str, entry: _Entry) -> None:
    previous = entries.get(name)
    if previous is not None and previous.source != entry.source:
        if previous.cls is entry.cls and entry.cls is not None:
            return  # the same class reached twice (entry point + decorator): harmless
        warnings.warn(
            f"attention-zoo: {kind} {name!r} is claimed by two sources: {previous.source} and {entry.source}. "
            f"Uninstall one of them; asking for {name!r} raises until then.",
            stacklevel=4,
        )
        previous.conflict = entry.source
        return
    entries[name] = entry


def _add(name: str, entry: _Entry) -> None:
    _add_to(_entries, "variant", name, entry)


def _load_entry_points(group: str, kind: str, check: Callable[[object, str], None],
                       entries: dict[str, _Entry]) -> None:
    """Load every entry point of ``group`` into ``entries`` (a :class:`_Entry` per name): ``check(obj, name)`` raises
    for what the zoo cannot use; a broken plugin is recorded with its error and a warning, and breaks nothing else."""
    for ep in entry_points(group=group):
        dist = ep.dist.name if ep.dist is not None else "unknown"
        version = ep.dist.version if ep.dist is not None else "unknown"
        source = Source(dist, version, f"{ep.name} = {ep.value}")
        try:
            cls = ep.load()
            check(cls, ep.name)
        except Exception as exc:  # a broken plugin must not break the zoo
            warnings.warn(
                f"attention-zoo: plugin entry point {ep.name!r} ({ep.value}) from distribution {dist} {version} "
                f"failed to load: {exc!r}. Other {kind}s still work.",
                stacklevel=3,
            )
            _add_to(entries, kind, ep.name, _Entry(None, source, error=exc))
            continue
        _add_to(entries, kind, cls.name, _Entry(cls, source))


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    _discovered = True
    _load_entry_points(ENTRY_POINT_GROUP, "variant", _check_variant_class, _entries)


def _check_variant_class(cls: object, ep_name: str) -> None:
    """What the zoo needs of a variant class before anything uses it; the error says what to change."""
    if not (isinstance(cls, type) and issubclass(cls, Variant)):
        raise TypeError(f"entry point {ep_name!r} must point to a zoo.Variant subclass, got {cls!r}")
    if cls.name != ep_name:
        raise TypeError(f"entry point name {ep_name!r} differs from the variant's name {cls.name!r}")
    if not isinstance(cls.params, dict) or not all(isinstance(p, Param) for p in cls.params.values()):
        raise TypeError(
            f"variant {ep_name!r}: `params` must map each parameter name to a zoo.Param (e.g. params = "
            f"{{'window': Param(256, int, min=1)}}), got {cls.params!r}."
        )
    unknown = sorted(set(cls.test_params) - set(cls.params))
    if unknown:
        raise TypeError(f"variant {ep_name!r}: `test_params` names {unknown[0]!r}, which is not in `params`.")
    if not (cls.supports_causal or cls.supports_bidirectional):
        raise TypeError(f"variant {ep_name!r}: set supports_causal or supports_bidirectional (or both) to True.")


def register_variant(cls: type[Variant]) -> type[Variant]:
    """Register a variant class in this process, beside the entry-point plugins (usable as a decorator).

    Args:
        cls: a `zoo.Variant` subclass; its ``name`` is the name `zoo.configure` takes.

    Returns:
        ``cls`` unchanged.

    Raises:
        TypeError: the class cannot be used (``params`` not `zoo.Param`s, ``test_params`` naming no parameter, neither
            causal nor bidirectional).
    """
    _check_variant_class(cls, cls.name)
    _discover()
    _add(cls.name, _Entry(cls, Source(IN_PROCESS, "", f"{cls.__module__}.{cls.__qualname__}")))
    return cls


def unregister_variant(name: str) -> None:
    """Remove an in-process registration (tests, notebooks); entry-point plugins stay.

    Args:
        name: the registered variant's name.
    """
    entry = _entries.get(name)
    if entry is not None and entry.source.distribution == IN_PROCESS:
        del _entries[name]


def list_variants() -> list[str]:
    """Names of every available variant: built-in, plugins and in-process registrations.

    Returns:
        The sorted names; a plugin that fails to import or whose name two packages claim is left out (``zoo list``
        shows it with its problem).
    """
    _discover()
    return sorted(n for n, e in _entries.items() if e.cls is not None and e.conflict is None)


def get_variant_class(name: str) -> type[Variant]:
    """The class registered under ``name``.

    Args:
        name: a variant name (`list_variants`).

    Returns:
        The `zoo.Variant` subclass.

    Raises:
        UnknownVariantError: no such variant (the error suggests close names and lists the available ones).
        VariantConflictError: two installed packages claim the name.
        BrokenVariantError: its plugin failed to import.
    """
    _discover()
    return _usable(_entries, "variant", name, ENTRY_POINT_GROUP, list_variants(), UnknownVariantError)


def _usable(entries: dict[str, _Entry], kind: str, name: str, group: str, available: list[str],
            unknown: type[UnknownVariantError]) -> type:
    """The class registered as ``name``, or the error that says why there is none (unknown, claimed twice, broken)."""
    entry = entries.get(name)
    if entry is None:
        close = difflib.get_close_matches(name, list(entries), n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise unknown(
            f"attention-zoo has no {kind} {name!r}.{hint} Available: {', '.join(available)}. "
            f"A plugin {kind} must be installed (pip install ...) and declare an entry point in the {group!r} group."
        )
    if entry.conflict is not None:
        raise VariantConflictError(
            f"attention-zoo {kind} {name!r} is provided twice: by {entry.source} and by {entry.conflict}. "
            "Uninstall one of the two packages."
        )
    if entry.cls is None:
        raise BrokenVariantError(
            f"attention-zoo {kind} {name!r} ({entry.source}) failed to import: {entry.error!r}"
        ) from entry.error
    return entry.cls


def variant_source(name: str) -> Source:
    """Where the working variant ``name`` comes from (raises as `get_variant_class` does)."""
    get_variant_class(name)
    return _entries[name].source


def source_of(name: str) -> Source:
    """Where an announced name comes from, broken or not (`variant_source` raises for a broken one)."""
    _discover()
    return _entries[name].source


def problem(name: str) -> str | None:
    """Why variant ``name`` cannot run, or None: it failed to import or is claimed twice, or it raises when built with
    its default parameters, asked for its pattern (in each mode it supports) or for its decoding cache (there, a
    ValueError or NotImplementedError is a refusal to decode with a cache, by design). ``zoo list`` shows it; the
    contract suite turns the same errors into that variant's failures."""
    try:
        cls = get_variant_class(name)
        variant = cls()
        for causal in [m for m, ok in ((True, cls.supports_causal), (False, cls.supports_bidirectional)) if ok]:
            variant.pattern(AttentionCall(causal=causal, scaling=1.0), 64, 64)
        if cls.supports_causal:
            try:
                variant.cache_layer(0, None)
            except (ValueError, NotImplementedError):
                pass  # a documented refusal to decode with a cache (reformer's), not a breakage
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def names_with_sources() -> list[str]:
    """Every name a plugin announced, broken ones included (``zoo list``)."""
    _discover()
    return sorted(_entries)


# ------------------------------------------------------------------------------------------------------
# KV policies (zoo.cache.policies): the built-in ones, then entry points of the group POLICY_ENTRY_POINT_GROUP


def _discover_policies() -> None:
    global _policies_discovered
    if _policies_discovered:
        return
    _policies_discovered = True
    for name, cls in BUILT_IN_POLICIES.items():
        source = Source("attention-zoo", "(built in)", f"{name} = {cls.__module__}:{cls.__qualname__}")
        _add_to(_policy_entries, "KV policy", name, _Entry(cls, source))
    _load_entry_points(POLICY_ENTRY_POINT_GROUP, "KV policy", _check_policy_class, _policy_entries)


def _check_policy_class(cls: object, ep_name: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise TypeError(f"entry point {ep_name!r} must point to a zoo.cache.Policy subclass, got {cls!r}")
    if cls.name != ep_name:
        raise TypeError(f"entry point name {ep_name!r} differs from the KV policy's name {cls.name!r}")
    if cls.score is Policy.score:
        raise TypeError(f"KV policy {ep_name!r}: override score(layer) (the (B, Hk, K) score of every held key).")


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Register a KV policy class in this process (usable as a decorator)."""
    _check_policy_class(cls, cls.name)
    _discover_policies()
    _add_to(_policy_entries, "KV policy", cls.name, _Entry(cls, Source(IN_PROCESS, "", f"{cls.__module__}."
                                                                                         f"{cls.__qualname__}")))
    return cls


def list_policies() -> list[str]:
    """Names of every available KV policy, built-in and from plugins (broken plugins excluded)."""
    _discover_policies()
    return sorted(n for n, e in _policy_entries.items() if e.cls is not None and e.conflict is None)


def get_policy_class(name: str) -> type[Policy]:
    """The KV policy class named ``name`` (built in or from a plugin's ``attention_zoo.kv_policies`` entry point)."""
    _discover_policies()
    return _usable(_policy_entries, "KV policy", name, POLICY_ENTRY_POINT_GROUP, list_policies(), UnknownPolicyError)


def policy_source(name: str) -> Source:
    get_policy_class(name)
    return _policy_entries[name].source
