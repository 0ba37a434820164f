"""Variant registry: entry points (group ``attention_zoo.variants``) plus in-process registration.

The registry never imports a variant module itself; entry points (or the caller of
`register_variant`) do. A plugin that fails to import is reported with a warning and recorded,
so every other variant keeps working and asking for the broken one re-raises its cause.
"""

from __future__ import annotations

import difflib
import warnings
from dataclasses import dataclass
from importlib.metadata import entry_points

from zoo.call import AttentionCall
from zoo.variant import Param, Variant

ENTRY_POINT_GROUP = "attention_zoo.variants"
IN_PROCESS = "<in-process>"


class UnknownVariantError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


class VariantConflictError(RuntimeError):
    """Two sources claim the same variant name."""


class BrokenVariantError(ImportError):
    """The plugin providing a variant failed to import."""


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
    cls: type[Variant] | None
    source: Source
    error: BaseException | None = None
    conflict: Source | None = None


_entries: dict[str, _Entry] = {}
_discovered = False


def _add(name: str, entry: _Entry) -> None:
    previous = _entries.get(name)
    if previous is not None and previous.source != entry.source:
        if previous.cls is entry.cls and entry.cls is not None:
            return  # the same class reached twice (entry point + decorator): harmless
        warnings.warn(
            f"attention-zoo: variant {name!r} is claimed by two sources: {previous.source} and {entry.source}. "
            f"Uninstall one of them; asking for {name!r} raises until then.",
            stacklevel=3,
        )
        previous.conflict = entry.source
        return
    _entries[name] = entry


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    _discovered = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else "unknown"
        version = ep.dist.version if ep.dist is not None else "unknown"
        source = Source(dist, version, f"{ep.name} = {ep.value}")
        try:
            cls = ep.load()
            _check_variant_class(cls, ep.name)
        except Exception as exc:  # a broken plugin must not break the zoo
            warnings.warn(
                f"attention-zoo: plugin entry point {ep.name!r} ({ep.value}) from distribution {dist} {version} "
                f"failed to load: {exc!r}. Other variants still work.",
                stacklevel=2,
            )
            _add(ep.name, _Entry(None, source, error=exc))
            continue
        _add(cls.name, _Entry(cls, source))


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
    entry = _entries.get(name)
    if entry is None:
        close = difflib.get_close_matches(name, list(_entries), n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise UnknownVariantError(
            f"attention-zoo has no variant {name!r}.{hint} Available: {', '.join(list_variants())}. "
            f"A plugin variant must be installed (pip install ...) and declare an entry point in the "
            f"{ENTRY_POINT_GROUP!r} group."
        )
    if entry.conflict is not None:
        raise VariantConflictError(
            f"attention-zoo variant {name!r} is provided twice: by {entry.source} and by {entry.conflict}. "
            "Uninstall one of the two packages."
        )
    if entry.cls is None:
        raise BrokenVariantError(
            f"attention-zoo variant {name!r} ({entry.source}) failed to import: {entry.error!r}"
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
