"""The base of every KV policy (:class:`Policy`): the choice of the keys a :class:`~zoo.cache.BudgetedLayer` keeps
(protected keys first, then the top scores, padding last; the layer gathers), what the layer must record for it, and
its parameters as dataclass fields, checked when it is built (:class:`PolicyParameterError`). A policy overrides
:meth:`Policy.score` only; :class:`KeptKeys` is what it reads of the layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, Protocol

import torch

DEFAULT_QUERY_WINDOW = 32  # queries recorded for a policy that records them and states no count of its own


class PolicyParameterError(ValueError):
    """A KV policy built with an unknown field, a value of the wrong type or out of range; the message names the
    field and what it allows."""


class KeptKeys(Protocol):
    """What a policy reads of the layer it scores for (a :class:`~zoo.cache.BudgetedLayer`), per batch row and KV
    head: ``keys`` / ``values`` (B, Hk, K, d), ``pos`` (B, Hk, K) their positions, ``real`` (B, Hk, K) not padding,
    ``mass`` (B, Hk, K) the attention mass summed so far (policies that accumulate), ``queries`` (B, H, W, d) and
    ``query_real`` (B, W) the last recorded queries (policies that record them), ``scaling`` the softmax scale,
    ``seen`` the tokens seen, ``tokens`` the keys kept."""

    keys: torch.Tensor
    values: torch.Tensor
    pos: torch.Tensor
    real: torch.Tensor
    mass: torch.Tensor
    queries: torch.Tensor | None
    query_real: torch.Tensor | None
    scaling: float
    seen: int
    tokens: int
    device: torch.device

    def protected(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class Policy:
    """A KV policy. Subclasses set ``name``, declare their parameters as dataclass fields (with defaults: a value of
    another type is refused; a ``window`` of recorded queries below 1 too) and override :meth:`score`; :meth:`check`
    may refuse other values out of range. Flags say what the cache records for it: ``records_queries`` (the layer
    keeps the last :attr:`recorded_window` queries, ``layer.queries``: a ``window`` field, else ``query_window``, else
    :data:`DEFAULT_QUERY_WINDOW`), ``accumulates`` (the kernel adds every query's attention to ``layer.mass`` at every
    call)."""

    name: ClassVar[str] = ""
    records_queries: ClassVar[bool] = False
    accumulates: ClassVar[bool] = False
    query_window: ClassVar[int | None] = None  # a fixed count of recorded queries, for a policy with no window field

    def __post_init__(self) -> None:
        for spec in fields(self):
            default = spec.default
            if default is MISSING or default is None:
                continue
            value, expected = getattr(self, spec.name), type(default)
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, spec.name, float(value))
            elif not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
                raise self.invalid(spec.name, f"a value of type {expected.__name__}")
        if self.records_queries and "window" in {spec.name for spec in fields(self)}:
            self.at_least("window", 1)  # the count of recorded queries
        self.check()

    def check(self) -> None:
        """Refuse field values out of range (raise :meth:`invalid`); the default accepts any."""

    def invalid(self, field: str, allowed: str) -> PolicyParameterError:
        """The error for field ``field``, saying what it allows."""
        return PolicyParameterError(
            f"KV policy {self.name!r}: field {field!r} = {getattr(self, field)!r} is invalid; allowed: {allowed} "
            f"(e.g. policy={{'name': {self.name!r}, {field!r}: {getattr(type(self), field, '...')!r}}})."
        )

    def at_least(self, field: str, least: int) -> None:
        """Refuse field ``field`` below ``least``."""
        if getattr(self, field) < least:
            raise self.invalid(field, f"an int >= {least}")

    @classmethod
    def from_fields(cls, values: Mapping[str, Any]) -> Policy:
        """The policy with these field values (the rest at their defaults); an unknown field is refused."""
        known = [spec.name for spec in fields(cls) if spec.init]
        unknown = sorted(set(values) - set(known))
        if unknown:
            has = ", ".join(known) or "none"
            raise PolicyParameterError(f"KV policy {cls.name!r} has no field {unknown[0]!r}; its fields: {has}.")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """``{"name": ..., field: value, ...}``: the JSON form config.json stores (:func:`zoo.cache.as_policy`
        reads it back)."""
        return {"name": self.name, **{spec.name: getattr(self, spec.name) for spec in fields(self)}}

    @property
    def recorded_window(self) -> int:
        """The count of recent queries the cache records for this policy (0: it records none)."""
        if not self.records_queries:
            return 0
        window = getattr(self, "window", None)
        if isinstance(window, int) and not isinstance(window, bool):
            return window
        return self.query_window if self.query_window is not None else DEFAULT_QUERY_WINDOW

    def score(self, layer: KeptKeys) -> torch.Tensor:
        """(B, Hk, K) float32, higher = keep: the score of every held key."""
        raise NotImplementedError

    def keep(self, layer: KeptKeys) -> torch.Tensor:
        """(B, Hk, min(tokens, K)) indices of the held keys to keep, ascending: the protected ones (sinks, recent),
        then the highest scores; padding keys last."""
        priority = self.score(layer).masked_fill(layer.protected(), float("inf")).masked_fill(~layer.real,
                                                                                             float("-inf"))
        return priority.topk(min(layer.tokens, priority.shape[-1]), dim=-1, sorted=False).indices.sort(dim=-1).values


def recorded_query_positions(layer: KeptKeys) -> torch.Tensor:
    """(W,) positions of the recorded queries (the last W tokens seen)."""
    window = layer.queries.shape[-2]
    return torch.arange(layer.seen - window, layer.seen, device=layer.device)
