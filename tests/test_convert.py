"""``longformer`` with ``global_projections=True`` and ``zoo.from_longformer``: a saved transformers Longformer
(every task head) converts to a RoBERTa model on the zoo's kernel with the same outputs, on lengths that are
multiples of the window and lengths that are not, with padding and per-batch global attention."""

import pytest
import torch
import transformers

import zoo
from zoo.convert.longformer import NotALongformerError, from_longformer, longformer_global_attention_mask
from zoo.plug.weights import WEIGHTS_NAME

VOCAB = 100
TINY = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=130, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0,
)
TASKS = [
    "LongformerModel", "LongformerForMaskedLM", "LongformerForSequenceClassification",
    "LongformerForTokenClassification", "LongformerForQuestionAnswering", "LongformerForMultipleChoice",
]


def saved_longformer(tmp_path, cls: str, attention_window=(8, 16), **config):
    torch.manual_seed(0)
    source = getattr(transformers, cls)(transformers.LongformerConfig(
        **TINY, attention_window=list(attention_window), num_labels=2, **config
    )).eval()
    source.save_pretrained(tmp_path)
    return source


def batch(n: int, seed: int = 0, batch_size: int = 2):
    """ids laid out as question </s></s> context </s> (separators at 6, 7 and n - 12), the last row right-padded
    by 9 tokens, and a global attention mask differing per row."""
    ids = torch.randint(3, VOCAB, (batch_size, n), generator=torch.Generator().manual_seed(seed))
    ids[:, [6, 7, n - 12]] = 2  # sep_token_id
    mask = torch.ones(batch_size, n, dtype=torch.long)
    mask[-1, n - 9 :] = 0
    ids[-1, n - 9 :] = 1  # pad_token_id
    global_mask = torch.zeros(batch_size, n, dtype=torch.long)
    global_mask[:, 0] = 1
    global_mask[0, [5, n // 2]] = 1
    return ids, mask, global_mask


def first_output(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") and output.logits is not None else output[0]


@pytest.mark.parametrize("cls", TASKS)
def test_every_task_head_converts_with_equal_outputs(tmp_path, cls):
    source = saved_longformer(tmp_path, cls)
    ours = from_longformer(tmp_path).eval()
    assert type(ours).__name__ == cls.replace("Longformer", "Roberta")
    assert ours.config.attention_zoo["params"]["window"] == [8, 16]
    assert ours.config.attention_zoo["params"]["global_projections"] is True
    for n in (48, 45):  # a multiple of the largest window (16), and not
        ids, mask, global_mask = batch(n)
        if cls == "LongformerForMultipleChoice":
            ids, mask, global_mask = (x[:, None].expand(-1, 3, -1).contiguous() for x in (ids, mask, global_mask))
        inputs = dict(input_ids=ids, attention_mask=mask, global_attention_mask=global_mask)
        want, got = first_output(source(**inputs)), first_output(ours(**inputs))
        if want.dim() == 3 and want.shape[1] == n:  # per-token outputs: compare real tokens
            want, got = want[mask.bool()], got[mask.bool()]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_global_projections_are_the_checkpoints_own_and_change_the_global_rows(tmp_path):
    source = saved_longformer(tmp_path, "LongformerModel")
    ours = from_longformer(source).eval()
    local = ours.encoder.layer[1].attention.self
    torch.testing.assert_close(
        local.attention_zoo.key_global.weight, source.encoder.layer[1].attention.self.key_global.weight
    )
    assert not torch.allclose(local.attention_zoo.key_global.weight, local.key.weight)
    ids, mask, global_mask = batch(40)
    inputs = dict(input_ids=ids, attention_mask=mask, global_attention_mask=global_mask)
    before = ours(**inputs).last_hidden_state
    with torch.no_grad():
        local.attention_zoo.value_global.weight.mul_(2)
    after = ours(**inputs).last_hidden_state
    changed = (after - before).abs().amax(-1) > 1e-6
    torch.testing.assert_close(changed, global_mask.bool(), msg="only global rows use the global projections")


def test_converted_model_saves_reloads_and_trains(tmp_path):
    saved_longformer(tmp_path / "longformer", "LongformerForMaskedLM", attention_window=(8, 8))
    ours = from_longformer(tmp_path / "longformer").eval()
    assert ours.config.attention_zoo["params"]["window"] == 8  # one window for every layer: an int
    ids, mask, global_mask = batch(37)
    inputs = dict(input_ids=ids, attention_mask=mask, global_attention_mask=global_mask)
    want = ours(**inputs).logits
    ours.save_pretrained(tmp_path / "zoo")
    reloaded = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "zoo").eval()
    assert any(f".{WEIGHTS_NAME}.query_global." in key for key in reloaded.state_dict())
    torch.testing.assert_close(reloaded(**inputs).logits, want, atol=0, rtol=0)
    reloaded.train()
    reloaded(**inputs, labels=ids).loss.backward()
    grad = reloaded.roberta.encoder.layer[0].attention.self.attention_zoo.query_global.weight.grad
    assert grad is not None and grad.abs().max() > 0


def test_default_global_tokens_of_the_task_heads(tmp_path):
    """Sequence classification: <s> is global when no mask is given (recorded in the config); question answering
    and multiple choice: the question tokens / the tokens after the separators, through
    longformer_global_attention_mask."""
    source = saved_longformer(tmp_path / "cls", "LongformerForSequenceClassification")
    ours = from_longformer(tmp_path / "cls").eval()
    ids, mask, _ = batch(45)
    torch.testing.assert_close(
        ours(input_ids=ids, attention_mask=mask).logits, source(input_ids=ids, attention_mask=mask).logits,
        atol=2e-5, rtol=1e-4,
    )
    source = saved_longformer(tmp_path / "qa", "LongformerForQuestionAnswering")
    ours = from_longformer(tmp_path / "qa").eval()
    global_mask = longformer_global_attention_mask(ours, ids)
    assert global_mask[:, :6].all() and not global_mask[:, 6:].any()
    want = source(input_ids=ids, attention_mask=mask)
    got = ours(input_ids=ids, attention_mask=mask, global_attention_mask=global_mask)
    real = mask.bool()
    torch.testing.assert_close(got.start_logits[real], want.start_logits[real], atol=2e-5, rtol=1e-4)
    source = saved_longformer(tmp_path / "mc", "LongformerForMultipleChoice")
    ours = from_longformer(tmp_path / "mc").eval()
    ids, mask = (x[:, None].expand(-1, 2, -1).contiguous() for x in (ids, mask))
    global_mask = longformer_global_attention_mask(ours, ids)
    assert global_mask.shape == ids.shape and global_mask[..., 8:].all() and not global_mask[..., :8].any()
    torch.testing.assert_close(
        ours(input_ids=ids, attention_mask=mask, global_attention_mask=global_mask).logits,
        source(input_ids=ids, attention_mask=mask).logits, atol=2e-5, rtol=1e-4,
    )


def test_a_longformer_without_pooler_in_bf16(tmp_path):
    torch.manual_seed(0)
    source = transformers.LongformerModel(
        transformers.LongformerConfig(**TINY, attention_window=8), add_pooling_layer=False
    ).to(torch.bfloat16).eval()
    ours = from_longformer(source)
    assert ours.pooler is None and next(ours.parameters()).dtype == torch.bfloat16
    ids, mask, global_mask = batch(45)
    inputs = dict(input_ids=ids, attention_mask=mask, global_attention_mask=global_mask)
    real = mask.bool()
    want, got = source(**inputs).last_hidden_state[real].float(), ours(**inputs).last_hidden_state[real].float()
    assert (got - want).norm() / want.norm() < 2e-2  # bf16 rounding of two different kernels


def test_not_a_longformer_is_refused_clearly(tmp_path):
    transformers.RobertaModel(transformers.RobertaConfig(**TINY)).save_pretrained(tmp_path)
    with pytest.raises(NotALongformerError, match="'roberta' checkpoint, not a Longformer.*zoo.configure"):
        from_longformer(tmp_path)


def test_global_projections_on_a_roberta_start_as_the_local_ones(tmp_path):
    """A RoBERTa checkpoint without global projections: they start as copies of query/key/value, so outputs equal
    global_projections=False (whether configured on the built model or loaded with a configured config)."""
    torch.manual_seed(0)
    base = transformers.RobertaModel(transformers.RobertaConfig(**TINY, pad_token_id=1)).eval()
    base.save_pretrained(tmp_path)
    ids, mask, global_mask = batch(45)
    inputs = dict(input_ids=ids, attention_mask=mask, global_attention_mask=global_mask)
    zoo.configure(base, "longformer", window=8, global_tokens=[])
    want = base(**inputs).last_hidden_state
    zoo.configure(base, "longformer", window=8, global_tokens=[], global_projections=True)
    torch.testing.assert_close(base(**inputs).last_hidden_state, want, atol=1e-5, rtol=1e-4)
    config = zoo.configure(transformers.AutoConfig.from_pretrained(tmp_path), "longformer", window=8,
                           global_tokens=[], global_projections=True)
    loaded = transformers.AutoModel.from_pretrained(tmp_path, config=config).eval()
    weights = loaded.encoder.layer[0].attention.self.attention_zoo
    torch.testing.assert_close(weights.query_global.weight, loaded.encoder.layer[0].attention.self.query.weight)
    torch.testing.assert_close(loaded(**inputs).last_hidden_state, want, atol=1e-5, rtol=1e-4)


def test_global_projections_refuse_decoding_with_a_cache():
    from zoo.plug.weights import build
    from zoo.variant import AttentionCall

    variant = zoo.get_variant_class("longformer")(window=8, global_tokens=[0], global_projections=True)
    config = transformers.RobertaConfig(**TINY)
    weights = build(variant, 0, config, 8, 4)
    q = torch.randn(1, 4, 1, 8)
    k = v = torch.randn(1, 4, 10, 8)
    call = AttentionCall(causal=True, scaling=8**-0.5, weights=weights)
    with pytest.raises(ValueError, match="whole sequence.*KV cache"):
        variant.attend(q, k, v, call)
