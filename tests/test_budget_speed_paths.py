"""The budgeted cache's decoding fast paths (zoo/cache/budgeted.py, zoo/ops/kept.py): keys written in place into
buffers with one row of room, eviction in place moving only the rows from the first evicted one on, the same kept
state as a gather of every row, the bytes of the buffers counted, and attention without a mask when a decoding query
sees every kept key."""

from dataclasses import dataclass

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import zoo
from zoo.cache import BudgetedLayer, Policy
from zoo.cache.budgeted import HELD, ROOM
from zoo.ops import softmax_attention
from zoo.ops.kept import kept_attention

BATCH, KV_HEADS, HEADS, DIM = 2, 2, 4, 8


@dataclass(frozen=True)
class NewestFirst(Policy):
    """Evicts the newest unprotected key: the evicted row is the one before the recent keys."""

    name = "newest_first_test"

    def score(self, layer):
        return -layer.pos.to(torch.float32)


def step(layer: BudgetedLayer, count: int, gen: torch.Generator, mass: bool = False) -> None:
    """One call of ``count`` tokens: update, then what the kernel reports (queries, mass)."""
    keys, values = (torch.randn(BATCH, KV_HEADS, count, DIM, generator=gen) for _ in range(2))
    layer.update(keys, values, kwargs={})
    held = layer.keys.shape[-2]
    reported = torch.rand(BATCH, KV_HEADS, held, generator=gen) if mass else None
    layer.observe(torch.randn(BATCH, HEADS, count, DIM, generator=gen), reported, 0.35, None)


class _Spy:
    """Records the held state and the kept indices at every eviction (Policy.keep)."""

    def __init__(self, monkeypatch):
        self.seen: list[tuple[dict, torch.Tensor]] = []
        original = Policy.keep

        def keep(policy, layer):
            chosen = original(policy, layer)
            self.seen.append(({name: getattr(layer, name).clone() for name in HELD}, chosen))
            return chosen

        monkeypatch.setattr(Policy, "keep", keep)


@pytest.mark.parametrize("policy", ["knorm", "snapkv", "h2o", "sinks_recent", "tova"])
def test_in_place_eviction_keeps_what_a_gather_of_every_row_keeps(policy, monkeypatch):
    spy = _Spy(monkeypatch)
    layer, gen = BudgetedLayer(24, sinks=2, recent=5, policy=policy), torch.Generator().manual_seed(0)
    step(layer, 40, gen, mass=policy == "h2o")  # a prefill: evicts into new buffers of tokens + slack + ROOM rows
    buffers = [buffer.data_ptr() for buffer in layer.store]
    for _ in range(12):
        before = len(spy.seen)
        step(layer, 1, gen, mass=policy == "h2o")
        assert len(spy.seen) == before + 1, "slack 0: one eviction per decoding step"
        state, keep = spy.seen[-1]
        for name in HELD:
            expected = state[name].gather(2, keep[..., None].expand(*keep.shape, DIM) if name in ("keys", "values")
                                          else keep)
            assert torch.equal(getattr(layer, name), expected), name
        assert [buffer.data_ptr() for buffer in layer.store] == buffers, "decoding writes into the same buffers"
    assert layer.keys.shape[-2] == 24 and layer.store[0].shape[2] == 24 + ROOM


class _RowsTaken(TorchDispatchMode):
    """Rows read by index_select (the eviction's moves)."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.index_select.default:
            self.rows += args[2].numel()
        return func(*args, **(kwargs or {}))


def test_a_decoding_step_moves_only_the_rows_from_the_first_evicted_one_on():
    """The newest unprotected key goes: the rows before it stay, only the recent keys move up one (a gather moved
    all 30 rows of every held tensor, at every step)."""
    layer, gen = BudgetedLayer(30, sinks=2, recent=4, policy=NewestFirst()), torch.Generator().manual_seed(1)
    step(layer, 40, gen)
    with _RowsTaken() as taken:
        step(layer, 1, gen)
    assert taken.rows == len(HELD) * BATCH * KV_HEADS * 4
    assert layer.pos[0, 0].tolist() == [*range(26), 37, 38, 39, 40]  # 36 went, the newest unprotected key


@pytest.mark.parametrize("slack", [0, 3])
def test_bytes_are_the_buffers_with_their_room(slack):
    """Spare rows are held memory: nbytes counts tokens + slack + ROOM rows of keys, values, positions, real marks
    and masses, whatever the held count within them."""
    layer, gen = BudgetedLayer(20, sinks=2, recent=4, policy="knorm", slack=slack), torch.Generator().manual_seed(2)
    step(layer, 50, gen)
    per_row = BATCH * KV_HEADS * (2 * DIM * 4 + 8 + 1 + 4)
    for _ in range(slack + 2):
        assert layer.nbytes() == (20 + slack + ROOM) * per_row
        assert 20 <= layer.keys.shape[-2] <= 20 + slack
        step(layer, 1, gen)


def test_a_cache_growing_to_its_budget_copies_amortised():
    """Before the budget is reached the buffers grow by a quarter, not by one row per token (a copy per step)."""
    layer, gen = BudgetedLayer(400, sinks=2, recent=4, policy="knorm"), torch.Generator().manual_seed(3)
    step(layer, 40, gen)
    grown = 0
    for _ in range(200):
        pointer = layer.store[0].data_ptr()
        step(layer, 1, gen)
        grown += layer.store[0].data_ptr() != pointer
    assert layer.keys.shape[-2] == 240 and not layer.evicted
    assert 3 <= grown <= 12  # 40 -> 50 -> 62 -> ... -> 240: about log(6) / log(1.25) times
    assert layer.store[0].shape[2] <= 401


@pytest.mark.parametrize("padded", [False, True])
def test_a_decoding_query_over_earlier_keys_matches_the_dense_reference(padded):
    gen = torch.Generator().manual_seed(4)
    keys, values = (torch.randn(BATCH, KV_HEADS, 12, DIM, generator=gen) for _ in range(2))
    q = torch.randn(BATCH, HEADS, 1, DIM, generator=gen)
    pos = torch.arange(0, 24, 2).expand(BATCH, KV_HEADS, 12)
    real = torch.ones(BATCH, KV_HEADS, 12, dtype=torch.bool)
    if padded:
        real[0, 1, :3] = False
    for query_pos in (30, 13):  # every key earlier; then the last five keys lie past the query
        out, _ = kept_attention(q, keys, values, pos, real, torch.tensor([query_pos]), 0.3)
        for head in range(HEADS):
            kv = head // (HEADS // KV_HEADS)
            allowed = (real[:, kv] & (pos[:, kv] <= query_pos))[:, None, :]
            ref = softmax_attention(q[:, head], keys[:, kv], values[:, kv], allowed, 0.3)
            torch.testing.assert_close(out[:, head], ref, atol=1e-5, rtol=1e-4)


def test_the_default_slack_scores_once_per_tokens_over_16_plus_one_tokens(monkeypatch):
    """``slack`` left out: tokens // 16 (3 for 48 keys), so after the prefill's eviction a layer evicts once per 4
    decoded tokens (slack 0: at every one), holding at most tokens + slack keys and counting tokens + slack + 1
    rows of bytes."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256)
    torch.manual_seed(0)
    model = zoo.configure(transformers.LlamaForCausalLM(config).eval(), "budget", tokens=48, sinks=2, recent=4,
                          policy="knorm")
    spy, held = _Spy(monkeypatch), []
    original = BudgetedLayer.update

    def update(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        held.append(self.keys.shape[-2])
        return result

    monkeypatch.setattr(BudgetedLayer, "update", update)
    ids = torch.randint(3, 64, (1, 60), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=13, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    layers = out.past_key_values.layers
    assert [layer.slack for layer in layers] == [3, 3]
    assert len(spy.seen) == 2 * (1 + 12 // 4), "per layer: the prefill's eviction, then one per 4 decoded tokens"
    assert max(held[2:]) == 48 + 3 + 1  # a decoding call holds one more before its eviction
    per_row = 2 * (2 * 8 * 4 + 8 + 1 + 4)  # KV heads x (keys, values, position, real, mass)
    assert zoo.cache.cache_nbytes(out.past_key_values) == 2 * (48 + 3 + ROOM) * per_row


def test_eviction_timing_does_not_change_what_sinks_recent_keeps():
    """With slack the evictions come in batches, and each leaves what slack 0 holds at the same token."""
    every, batched = (BudgetedLayer(20, sinks=2, recent=18, policy="sinks_recent", slack=slack) for slack in (0, 4))
    gens = [torch.Generator().manual_seed(6) for _ in range(2)]
    step(every, 30, gens[0])
    step(batched, 30, gens[1])
    compared = 0
    for _ in range(15):
        step(every, 1, gens[0])
        step(batched, 1, gens[1])
        assert batched.keys.shape[-2] <= 24
        if batched.keys.shape[-2] == 20:
            compared += 1
            for name in HELD:
                assert torch.equal(getattr(batched, name), getattr(every, name)), name
    assert compared == 3
