"""A cache of every key that also keeps a summary of each complete block of keys, per row (:class:`BlockSummaryLayer`):
``moba``'s block means and ``nsa``'s compressed keys and values, each block summarized once, when the kernel first
asks after it completes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from zoo.cache.kernel_state import KernelStateLayer, complete_blocks

# (block numbers (J,), each row's first real token (B,)) -> (summaries, each (B, H_kv, J, D), holds a real key (B, J))
Summarize = Callable[[torch.Tensor, torch.Tensor], tuple[tuple[torch.Tensor, ...], torch.Tensor]]


class BlockSummaryLayer(KernelStateLayer):
    """Every key and, per row and KV head, the summaries (``summary_names``, each (B, H_kv, J, D)) of each complete
    block of ``size`` tokens every ``stride`` tokens counted from the row's first real token; ``filled`` (B, J): the
    block is complete and holds a real key; ``summarized`` (B,): blocks done; ``row_start`` (B,). Subclasses name
    their summaries and say what an empty one is (:meth:`empty_summaries`)."""

    summary_names: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.state_names = (*cls.summary_names, "filled", "summarized", "row_start")

    def __init__(self, size: int, stride: int) -> None:
        super().__init__()
        self.size, self.stride = size, stride

    def empty_summaries(self) -> tuple[torch.Tensor, ...]:
        """One (B, H_kv, 0, D) tensor per summary, of the dtype the summaries have."""
        raise NotImplementedError

    def summaries(self, starts: torch.Tensor, summarize: Summarize) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """(summaries, filled (B, J)) of the complete blocks of each row from ``starts`` (B,), brought up to date with
        ``summarize`` on the blocks completed since the last call: O(new tokens · d) amortized."""
        complete = complete_blocks(self.seen, starts, self.size, self.stride)
        if self.summarized is None:
            self._set(self.empty_summaries())
            self.filled = torch.zeros(self.keys.shape[0], 0, dtype=torch.bool, device=self.keys.device)
            self.summarized = torch.zeros_like(complete)
        self.row_start = starts
        first, total = int(self.summarized.min()), int(complete.max())
        if total > first:
            numbers = torch.arange(first, total, device=self.keys.device)
            new, real = summarize(numbers, starts)
            self._set(tuple(torch.cat([old[:, :, :first], x], 2) for old, x in zip(self._get(), new, strict=True)))
            self.filled = torch.cat([self.filled[:, :first], real & (numbers < complete[:, None])], 1)
            self.summarized = complete
        return self._get(), self.filled

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens, and the summaries of the blocks they completed."""
        super().crop(tokens_to_remove)
        if self.summarized is not None and self.is_initialized:
            complete = complete_blocks(self.seen, self.row_start, self.size, self.stride)
            self.summarized = torch.minimum(self.summarized, complete)
            kept = int(self.summarized.max())
            numbers = torch.arange(kept, device=self.filled.device)
            self._set(tuple(x[:, :, :kept] for x in self._get()))
            self.filled = self.filled[:, :kept] & (numbers < self.summarized[:, None])

    def _get(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in self.summary_names)

    def _set(self, values: tuple[torch.Tensor, ...]) -> None:
        for name, value in zip(self.summary_names, values, strict=True):
            setattr(self, name, value)
