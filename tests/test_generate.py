"""Decoding with the variant's own cache (zoo/cache/): ``generate`` equals ``use_cache=False`` decoding for every
causal variant and family, the cache stays bounded where the variant says so, and every cache that would decode
different tokens is refused."""

import json

import pytest
import torch
import transformers
from transformers.cache_utils import DynamicCache, DynamicLayer, StaticCache
from zoo.variants.dsa import DSALayer
from zoo.variants.moba import MoBALayer
from zoo.variants.nsa import NSALayer

import zoo
from zoo.cache import (
    CacheRollbackError,
    GrowingLayer,
    RecurrentLayer,
    WindowedLayer,
    ZooCache,
    ZooCacheLayer,
    cache_nbytes,
    hand_to_kernel,
)

SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SMALL, num_key_value_heads=2),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=1,
                                            eos_token_id=2),
    "mistral": lambda: transformers.MistralConfig(**SMALL, num_key_value_heads=1, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, num_key_value_heads=2),
}
# Small windows, strides and blocks: the 20-token prompts are longer than every window.
VARIANTS = {
    "sdpa": ("sdpa", {}, DynamicLayer),
    "dense": ("dense", {}, DynamicLayer),
    "longformer": ("longformer", {"window": 8}, WindowedLayer),
    "longformer-sinks": ("longformer", {"window": 8, "global_tokens": [0, 1, 2, 3]}, WindowedLayer),
    "longformer-dilated": ("longformer", {"window": 6, "dilation": 2}, WindowedLayer),
    "xformers-window": ("xformers", {"window": 6}, WindowedLayer),
    "xformers": ("xformers", {}, DynamicLayer),
    "linear": ("linear", {"chunk_size": 8}, RecurrentLayer),
    "performer": ("performer", {"nb_features": 32}, RecurrentLayer),
    "sparse-strided": ("sparse_transformer", {"stride": 4, "num_summary": 1}, GrowingLayer),
    "sparse-fixed": ("sparse_transformer", {"layout": "fixed", "stride": 4, "num_summary": 2}, WindowedLayer),
    "bigbird": ("bigbird", {"block_size": 4, "num_random_blocks": 1}, GrowingLayer),
    "moba": ("moba", {"block_size": 4, "top_k": 1}, MoBALayer),
    "dsa": ("dsa", {"index_heads": 2, "index_dim": 8, "top_k": 6}, DSALayer),
    "nsa": ("nsa", {"compress_block": 4, "compress_stride": 2, "select_block": 4, "top_n": 4, "window": 6}, NSALayer),
}
NEW_TOKENS = 10


def _model(family: str, variant: str, **overrides):
    name, params, _ = VARIANTS[variant]
    config = FAMILIES[family]()
    zoo.configure(config, name, **{**params, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    # Untrained tiny models tie logits easily; a larger output scale separates the greedy choices.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    return model


def _prompts(length=20, batch=2, left_pad=5):
    ids = torch.randint(3, 64, (batch, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :left_pad] = 0
    return ids, mask


def _generate(model, ids, mask, **kwargs):
    kwargs = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0, **kwargs}
    return model.generate(ids, attention_mask=mask, **kwargs)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_generate_with_the_variant_cache_equals_decoding_without_cache(family, variant):
    """Left-padded batch, prompt longer than every window: same tokens, and the cache is the variant's own."""
    model = _model(family, variant)
    ids, mask = _prompts()
    out = _generate(model, ids, mask, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, ZooCache)
    assert all(type(layer) is VARIANTS[variant][2] for layer in out.past_key_values.layers)
    torch.testing.assert_close(out.sequences, _generate(model, ids, mask, use_cache=False), rtol=0, atol=0)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_beam_search_reorders_the_cache(variant):
    model = _model("llama", variant)
    ids, mask = _prompts()
    beams = dict(num_beams=3, num_return_sequences=2)
    torch.testing.assert_close(_generate(model, ids, mask, **beams),
                               _generate(model, ids, mask, use_cache=False, **beams), rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["longformer", "longformer-sinks", "xformers-window", "longformer-dilated"])
def test_unpadded_window_steps_build_no_mask(variant, monkeypatch):
    """One unpadded query over a plain window's cache selection (pattern.plain_window) is exactly its keys: the step
    builds no mask, and decodes the tokens of the full forward. A dilated window has holes: it keeps its mask."""
    from zoo.ops import decode_selected as selected

    model = _model("llama", variant)
    ids = _prompts(length=24, batch=1)[0]
    masks, rows_attention = [], selected.rows_attention

    def recording(q, k, v, mask, call):
        masks.append(mask)
        return rows_attention(q, k, v, mask, call)

    monkeypatch.setattr(selected, "rows_attention", recording)
    decoded = _generate(model, ids, torch.ones_like(ids), min_new_tokens=NEW_TOKENS)
    monkeypatch.undo()
    steps = masks[-2 * (NEW_TOKENS - 1):]  # 2 layers x the steps after the prefill
    assert len(masks) >= 2 * (NEW_TOKENS - 1)
    if variant in ("longformer", "longformer-sinks"):
        assert all(m is None for m in steps)
    elif variant == "longformer-dilated":
        assert all(m is not None for m in steps)
    torch.testing.assert_close(decoded, _generate(model, ids, torch.ones_like(ids), use_cache=False,
                                                  min_new_tokens=NEW_TOKENS), rtol=0, atol=0)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_prompt_global_tokens_stay_global_while_decoding(padded):
    """A decoding loop passes the prompt's global_attention_mask at every step (generate() itself refuses model
    kwargs it does not know): the prompt's global tokens stay global, and kept, at constant memory. Unpadded, the
    rows' different global tokens keep the step's mask (the cache holds the union of their sinks)."""
    model = _model("llama", "longformer")
    ids, mask = _prompts()
    if not padded:
        mask = torch.ones_like(ids)
    global_mask = torch.zeros_like(ids)
    global_mask[0, 7] = global_mask[1, [2, 11]] = 1

    def greedy(cache, global_attention_mask):
        tokens, attention = ids, mask
        step = tokens if cache is not None else None
        for _ in range(NEW_TOKENS):
            inputs = step if cache is not None else tokens
            logits = model(inputs, attention_mask=attention, cache=cache, use_cache=cache is not None,
                           global_attention_mask=global_attention_mask).logits[:, -1]
            step = logits.argmax(-1, keepdim=True)
            tokens, attention = torch.cat([tokens, step], -1), torch.cat([attention, torch.ones_like(step)], -1)
        return tokens

    cache = zoo.make_cache(model)
    with torch.no_grad():
        decoded = greedy(cache, global_mask)
        torch.testing.assert_close(decoded, greedy(None, global_mask), rtol=0, atol=0)
        assert not torch.equal(decoded, greedy(None, None))  # the globals changed the answer
    layer = cache.layers[0]
    assert {2, 7, 11} <= set(layer.positions.tolist())
    assert len(layer.positions) == 3 + layer.reach


@pytest.mark.parametrize("variant", ["longformer-sinks", "xformers-window", "linear", "performer"])
def test_cache_bytes_do_not_grow_with_the_context(variant):
    """Windowed layers keep window + sinks, recurrent ones a state: the same bytes at two prompt lengths."""
    sizes = {}
    for length in (24, 48):
        model = _model("llama", variant)
        ids, mask = _prompts(length)
        out = _generate(model, ids, mask, return_dict_in_generate=True)
        sizes[length] = cache_nbytes(out.past_key_values)
    assert sizes[48] == sizes[24]
    if VARIANTS[variant][2] is WindowedLayer:
        dense = _generate(_model("llama", "sdpa"), *_prompts(48), return_dict_in_generate=True).past_key_values
        assert sizes[48] < cache_nbytes(dense) / 2


def test_fixed_sparse_pattern_keeps_the_summary_columns_and_the_block():
    model = _model("llama", "sparse-fixed")  # stride 4, 2 summary columns
    ids, mask = _prompts(30)
    layer = _generate(model, ids, mask, return_dict_in_generate=True).past_key_values.layers[1]
    seen = 30 + NEW_TOKENS - 1  # the last token was generated, not fed back
    starts = mask.long().argmax(-1).tolist()  # each row's blocks count from its first real token
    summaries = {p for p in range(seen) for start in starts if (p - start) % 4 >= 2}
    assert set(layer.positions.tolist()) == summaries | set(range(seen - 3, seen))


def test_a_windowed_decoding_step_writes_the_new_token_without_copying_the_window():
    """The layer's keys live in buffers with slack: a step writes its token and moves the few sinks, so the storage
    stays the same from step to step (a torch.cat per step copied the whole window; issue 29, item 5)."""
    model = _model("llama", "longformer-sinks")
    ids, mask = _prompts(30)
    cache = zoo.make_cache(model)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache, use_cache=True)
        storages = []
        for _ in range(4):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], -1)
            model(ids[:, -1:], attention_mask=mask, cache=cache, use_cache=True)
            layer = cache.layers[0]
            storages.append(layer.keys.untyped_storage().data_ptr())
            assert int((~layer.is_sink).sum()) == layer.reach  # the sinks (of both rows) and the window
    assert len(set(storages)) == 1


def test_windowed_layer_hands_the_kernel_only_the_window_and_sinks():
    model = _model("llama", "longformer-sinks")
    cache = zoo.make_cache(model)
    ids, _ = _prompts(40, batch=1)
    model(ids, cache=cache, use_cache=True)
    for token in range(5):
        model(ids[:, token : token + 1], cache=cache, use_cache=True)
        layer = cache.layers[1]
        assert layer.get_seq_length() == 41 + token
        positions = layer.key_positions.tolist()  # the sinks first (their order rotates as keys drop), then the window
        assert sorted(positions[:4]) == [0, 1, 2, 3]
        assert positions[4:] == list(range(41 + token - 1 - layer.reach, 41 + token))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_static_cache_is_refused_with_the_fix(family):
    model = _model(family, "longformer")
    ids, mask = _prompts()
    with pytest.raises(ValueError, match="cache_implementation='static'.*Leave cache_implementation unset"):
        _generate(model, ids, mask, cache_implementation="static")
    with pytest.raises(ValueError, match="StaticCache.*zoo.make_cache"):
        _generate(model, ids, mask, cache=StaticCache(config=model.config, max_cache_len=64))


def test_a_sliding_dynamic_cache_is_refused_and_a_full_one_works():
    config = transformers.MistralConfig(**SMALL, num_key_value_heads=1, sliding_window=4)
    zoo.configure(config, "sdpa")
    model = transformers.MistralForCausalLM(config).eval()
    ids, mask = _prompts()
    with pytest.raises(ValueError, match="DynamicSlidingWindowLayer"):
        _generate(model, ids, mask, cache=DynamicCache(config=config))
    expected = _generate(model, ids, mask, use_cache=False)
    torch.testing.assert_close(_generate(model, ids, mask), expected, rtol=0, atol=0)
    torch.testing.assert_close(_generate(model, ids, mask, cache=DynamicCache()), expected, rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["linear", "performer"])
def test_a_recurrent_state_refuses_rollbacks(variant):
    model = _model("llama", variant)
    cache = zoo.make_cache(model)
    model(_prompts(batch=1)[0], cache=cache, use_cache=True)
    with pytest.raises(CacheRollbackError, match="cannot be rolled back"):
        cache.crop(-1)
    cache.crop(0)  # nothing to forget: fine
    ids, mask = _prompts()
    with pytest.raises(CacheRollbackError, match="Assisted decoding.*cannot be rolled back"):
        _generate(model, ids, mask, assistant_model=_model("llama", "sdpa"))


def test_assisted_decoding_crops_the_windowed_cache():
    model = _model("llama", "longformer-sinks")
    ids, mask = _prompts(batch=1, left_pad=0)
    assistant = _model("llama", "xformers-window")
    torch.testing.assert_close(_generate(model, ids, mask, assistant_model=assistant),
                               _generate(model, ids, mask, use_cache=False), rtol=0, atol=0)


def test_a_windowed_cache_that_dropped_keys_refuses_to_roll_back():
    model = _model("llama", "xformers-window")
    cache = zoo.make_cache(model)
    model(_prompts(batch=1)[0], cache=cache, use_cache=True)
    with pytest.raises(CacheRollbackError, match="activate_past_recording"):
        cache.crop(-2)


def test_two_generations_at_once_do_not_interfere():
    """The state lives in the cache: two loops stepped alternately give what each gives alone."""
    model = _model("llama", "performer")
    prompts = [_prompts(20, batch=1)[0], _prompts(27, batch=1)[0][:, 3:]]

    def steps(cache, ids):
        logits = model(ids, cache=cache, use_cache=True).logits[:, -1]
        while True:
            token = logits.argmax(-1, keepdim=True)
            yield token
            logits = model(token, cache=cache, use_cache=True).logits[:, -1]

    alone = [[next(gen) for _ in range(6)] for gen in (steps(zoo.make_cache(model), p) for p in prompts)]
    together = [steps(zoo.make_cache(model), p) for p in prompts]
    interleaved = [[], []]
    for _ in range(6):
        for i, gen in enumerate(together):
            interleaved[i].append(next(gen))
    assert interleaved == alone


def test_models_without_the_zoo_keep_transformers_cache():
    config = FAMILIES["llama"]()
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config).eval()
    ids, mask = _prompts()
    out = _generate(model, ids, mask, return_dict_in_generate=True)
    assert type(out.past_key_values) is DynamicCache
    with pytest.raises(ValueError, match="not configured with an attention-zoo variant"):
        zoo.make_cache(model)


def test_a_cache_of_another_variant_is_refused():
    model = _model("llama", "longformer")
    ids, mask = _prompts()
    with pytest.raises(ValueError, match="made for attention-zoo variant 'linear'"):
        _generate(model, ids, mask, cache=zoo.make_cache(_model("llama", "linear")))


@pytest.mark.parametrize("entry, problem", [
    ("longformer", "must be a mapping"),
    ({"variant": "longformer", "params": [8]}, "'params'.*must be a mapping"),
    ({"params": {}}, "must be a mapping"),
])
def test_a_malformed_config_entry_names_the_entry_and_the_file(tmp_path, entry, problem):
    config = FAMILIES["llama"]()
    zoo.configure(config, "longformer", window=8)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["attention_zoo"] = entry
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=problem) as error:
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert f"'attention_zoo' entry of config.json in '{tmp_path}'" in str(error.value)


@pytest.mark.parametrize("variant", ["longformer-sinks", "xformers-window", "sparse-fixed", "linear", "performer",
                                     "bigbird", "sparse-strided", "moba", "dsa", "nsa"])
def test_chunked_prefill_continues_from_the_cache(variant):
    """generate(prefill_chunk_size=...) feeds the prompt in pieces: every piece after the first decodes several
    tokens against the cache (windowed selection over many queries, a recurrent state advanced by a chunk)."""
    model = _model("llama", variant)
    ids, mask = _prompts(23, batch=1, left_pad=0)
    torch.testing.assert_close(_generate(model, ids, mask, prefill_chunk_size=7),
                               _generate(model, ids, mask, use_cache=False), rtol=0, atol=0)


def test_growing_layer_appends_in_place_and_holds_what_a_dynamic_cache_holds():
    model = _model("llama", "bigbird")
    cache, reference = zoo.make_cache(model), DynamicCache()
    ids, _ = _prompts(40, batch=1)
    with torch.no_grad():  # with gradients, it concatenates like DynamicLayer (in-place writes would break autograd)
        model(ids, cache=cache, use_cache=True)
        model(ids, cache=reference, use_cache=True)
        buffer = cache.layers[0].buffers[0].data_ptr()
        for token in range(5):
            for c in (cache, reference):
                model(ids[:, token : token + 1], cache=c, use_cache=True)
    assert cache.layers[0].buffers[0].data_ptr() == buffer  # appended into the same buffer, no copy of the cache
    for mine, theirs in zip(cache.layers, reference.layers, strict=True):
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=0, atol=0)
        torch.testing.assert_close(mine.values, theirs.values, rtol=0, atol=0)


class _Window(zoo.Variant):
    """A pattern-only window (no kernel): the zoo's chunked kernels run it and its cache follows its reach."""

    name = "test_pattern_window"
    time_complexity = memory_complexity = "O(n·w)"

    def pattern(self, call, q_len, kv_len):
        from zoo.pattern import Pattern, band, band_key_blocks

        return Pattern(band(4), reach=4, block_size=8, key_blocks=band_key_blocks(4, 8))


class _ShortCache(_Window):
    """The same pattern, with a cache that drops one key the pattern still reaches."""

    name = "test_pattern_window_short_cache"

    def cache_layer(self, layer_idx, config):
        return WindowedLayer(3)


@pytest.mark.parametrize("cls, fails", [(_Window, False), (_ShortCache, True)])
def test_the_decoding_contract_catches_a_cache_that_drops_a_reachable_key(cls, fails):
    from zoo.testing import assert_decodes_like_the_full_forward

    zoo.register_variant(cls)
    try:
        config = zoo.configure(transformers.LlamaConfig(**SMALL), cls.name)
        assert type(zoo.make_cache(config).layers[0]) is WindowedLayer  # derived from the reach, or the override
        if fails:
            with pytest.raises(AssertionError, match="differs from the full forward"):
                assert_decodes_like_the_full_forward(cls.name)
        else:
            assert_decodes_like_the_full_forward(cls.name)
    finally:
        zoo.unregister_variant(cls.name)


class _RecordingLayer(ZooCacheLayer, DynamicLayer):
    """A plugin's own cache layer: every key, recording what the plug tells it through the cache-layer protocol."""

    def __init__(self) -> None:
        super().__init__()
        self.seen, self.heard = 0, []

    def update(self, key_states, value_states, *args, **kwargs):
        hand_to_kernel(self, kwargs)
        keys, values = DynamicLayer.update(self, key_states, value_states)
        self.seen, self.new_tokens = keys.shape[-2], key_states.shape[-2]
        self.key_positions = torch.arange(self.seen)
        return keys, values

    def set_row_start(self, row_start):
        self.heard.append(("row_start", None if row_start is None else row_start.tolist()))
        self.row_start, self.rows_known = row_start, True

    def kept_keys_padding(self, attention_mask):
        self.heard.append(("kept_keys_padding", self.seen))
        return super().kept_keys_padding(attention_mask)

    def after_call(self):
        self.heard.append(("after_call", self.seen))


class _RecordingCache(zoo.Variant):
    name = "test_recording_cache"
    exact = True
    time_complexity = memory_complexity = "O(n²)"

    def attend(self, q, k, v, call):
        return zoo.get_variant_class("sdpa")().attend(q, k, v, call)

    def cache_layer(self, layer_idx, config):
        return _RecordingLayer()


def test_a_plugins_own_cache_layer_hears_the_plug_through_the_protocol():
    """The plug names no cache class: any ZooCacheLayer is told the row starts once, gives the kept keys' padding
    after that and hears the end of every call; decoding with it equals decoding without a cache."""
    zoo.register_variant(_RecordingCache)
    try:
        config = zoo.configure(transformers.LlamaConfig(**SMALL, num_key_value_heads=2), _RecordingCache.name)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        ids, mask = _prompts()
        out = _generate(model, ids, mask, max_new_tokens=3, min_new_tokens=3, return_dict_in_generate=True)
        torch.testing.assert_close(out.sequences, _generate(model, ids, mask, use_cache=False, max_new_tokens=3,
                                                            min_new_tokens=3), rtol=0, atol=0)
        for layer in out.past_key_values.layers:
            assert layer.heard == [("row_start", [5, 0]), ("after_call", 20), ("kept_keys_padding", 21),
                                   ("after_call", 21), ("kept_keys_padding", 22), ("after_call", 22)]
    finally:
        zoo.unregister_variant(_RecordingCache.name)
    with pytest.raises(TypeError, match="subclass it"):
        hand_to_kernel(DynamicLayer(), {"kwargs": {}})


def test_decoding_steps_reuse_the_pattern_instead_of_rebuilding_it(monkeypatch):
    """A windowed layer's pattern (the sinks it keeps, the kernel's window) is built once per layer and reused while
    the call's kwargs but the per-step ones stay the same: rebuilding it cost more than the step's attention
    (issue 29, item 5). The count of builds does not grow with the number of generated tokens."""
    from zoo.variants.longformer import LongformerAttention

    model = _model("llama", "longformer-sinks")
    ids = _prompts(length=24, batch=1)[0]
    builds, pattern = [], LongformerAttention.pattern

    def counting(self, call, q_len, kv_len):
        builds.append(call.decoding)
        return pattern(self, call, q_len, kv_len)

    monkeypatch.setattr(LongformerAttention, "pattern", counting)
    counts = []
    for new_tokens in (3, 12):
        builds.clear()
        decoded = _generate(model, ids, torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        counts.append(builds.count(True))
    assert counts[0] == counts[1] <= 2 * 2  # at most twice per layer (the cache's sinks, the kernel's call)
    monkeypatch.undo()
    torch.testing.assert_close(decoded, _generate(model, ids, torch.ones_like(ids), use_cache=False,
                                                  max_new_tokens=12, min_new_tokens=12), rtol=0, atol=0)


def test_the_reused_decoding_pattern_follows_new_kwargs_and_row_starts():
    """The memo compares everything but the per-step kwargs (positions): another global_attention_mask or another
    row start builds the pattern again; a new position_ids tensor does not."""
    from zoo.cache import pattern_cache_layer

    variant = zoo.get_variant_class("longformer")(window=8)
    layer = pattern_cache_layer(variant, 0)
    marks = torch.tensor([[0, 1, 0]])
    first = layer.decoding_pattern(variant, 0, {"global_attention_mask": marks, "position_ids": torch.tensor([[5]])},
                                   None)
    again = layer.decoding_pattern(variant, 0, {"global_attention_mask": marks, "position_ids": torch.tensor([[6]])},
                                   None)
    assert again is first
    other_marks = layer.decoding_pattern(variant, 0, {"global_attention_mask": marks.clone()}, None)
    assert other_marks is not first
    other_rows = layer.decoding_pattern(variant, 0, {"global_attention_mask": marks}, torch.tensor([1]))
    assert other_rows is not other_marks
    assert other_rows.sinks.row_start is not None and first.sinks.row_start is None
    other_layer = layer.decoding_pattern(variant, 1, {"global_attention_mask": marks}, torch.tensor([1]))
    assert other_layer is not other_rows


@pytest.mark.parametrize("variant", ["longformer-sinks", "xformers-window"])
def test_a_windowed_decoding_step_over_real_keys_builds_no_mask_and_reads_no_whole_mask(monkeypatch, variant):
    """A left-padded batch: generate passes a padding mask over every token seen. Once each row's start is known, a
    step reads only the kept keys' columns of it (no row_starts over the whole context) and, once the padding has left
    the window, runs the plain window without a mask; with padding among the kept keys it masks. Tokens equal
    use_cache=False decoding both ways (issue 29, item 5)."""
    import zoo.ops.decode_selected as selected
    import zoo.plug.dispatch as dispatch

    model = _model("llama", variant)
    masks, whole_mask_reads = [], []
    real_rows_attention, real_row_starts = selected.rows_attention, dispatch.row_starts

    def recording(q_rows, k, v, allowed, call):
        masks.append(allowed)
        return real_rows_attention(q_rows, k, v, allowed, call)

    def counting(padding_mask):
        whole_mask_reads.append(padding_mask.shape[-1])
        return real_row_starts(padding_mask)

    monkeypatch.setattr(selected, "rows_attention", recording)
    monkeypatch.setattr(dispatch, "row_starts", counting)
    runs = {}
    for left_pad, length in ((5, 24), (6, 8)):  # the padding leaves the window at the prefill / stays in it
        ids, mask = _prompts(length=length, batch=2, left_pad=left_pad)
        mask[1, :left_pad] = 0  # both rows padded alike: the sinks (counted from the first real token) agree
        masks.clear()
        whole_mask_reads.clear()
        runs[left_pad] = (ids, mask, _generate(model, ids, mask, max_new_tokens=8, min_new_tokens=8), list(masks))
        assert whole_mask_reads == [length, length]  # the prefill call of each layer only
    assert len(runs[5][3]) == 2 * 7 and all(allowed is None for allowed in runs[5][3])  # 2 layers x 7 steps
    assert runs[6][3] and all(allowed is not None for allowed in runs[6][3][:2])  # the first step sees padding
    monkeypatch.undo()
    for ids, mask, tokens, _ in runs.values():
        torch.testing.assert_close(tokens, _generate(model, ids, mask, use_cache=False, max_new_tokens=8,
                                                     min_new_tokens=8), rtol=0, atol=0)
