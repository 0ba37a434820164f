"""Choosing DuoAttention's full KV heads (zoo.retrofit.duo_gates, zoo.retrofit.heads): the gated attention's two
branches, gate training (α moves, the clamp holds, a large λ closes every gate), the needle score on a head built to
attend to the needle, the global top-share choice, the synthetic prompts and the config checks."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
import yaml

from zoo.plug.install import configure as zoo_configure
from zoo.retrofit import heads
from zoo.retrofit.duo_gates import (
    GATED,
    DuoGates,
    GateSettings,
    Probe,
    Retrieval,
    attention,
    full_attention,
    needle_mass,
    probe_attention,
    streaming_attention,
    train_gates,
)
from zoo.retrofit.heads import (
    DuoConfigError,
    choose_full_heads,
    count_heads,
    filler_passkey_prompts,
    load_config,
    passkey_prompts,
    plot_heads_map,
)

SINKS, RECENT = 2, 8


def tiny_llama(layers: int = 2) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def prompts(count: int = 3, n: int = 48) -> list[Retrieval]:
    generator = torch.Generator().manual_seed(1)
    return [Retrieval(ids=torch.randint(0, 128, (n,), generator=generator).tolist(), loss_rows=list(range(n - 8, n)),
                      answer_rows=[list(range(n - 6, n - 2))], needles=[(5, 9)]) for _ in range(count)]


def test_streaming_branch_equals_a_dense_masked_reference():
    n = 40
    q, k, v = torch.randn(1, 4, n, 16), torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
    gates = DuoGates(1, 2, SINKS, RECENT)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    mask = (j <= i) & ((j < SINKS) | (i - j < RECENT))
    reference = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                               attn_mask=mask, scale=0.25)
    torch.testing.assert_close(streaming_attention(q, k, v, 0.25, gates), reference, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(full_attention(q, k, v, 0.25), reference, atol=1e-3)  # the window does cut keys


def test_gates_at_one_are_the_full_model_and_at_zero_differ():
    model = tiny_llama()
    ids = torch.tensor([prompts(1)[0].ids])
    with torch.no_grad():
        original = model.model(input_ids=ids).last_hidden_state
        with attention(model, GATED):
            ones = model.model(input_ids=ids, duo_gates=DuoGates(2, 2, SINKS, RECENT)).last_hidden_state
            zeros = model.model(input_ids=ids, duo_gates=DuoGates(2, 2, SINKS, RECENT, initial=0.0)).last_hidden_state
    torch.testing.assert_close(ones, original, atol=1e-5, rtol=1e-5)
    assert (zeros - original)[0, RECENT + SINKS :].abs().max() > 1e-3
    assert model.config._attn_implementation == "sdpa"  # restored


def test_gates_move_and_the_clamp_holds():
    model = tiny_llama()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    trained = train_gates(model, prompts(), GateSettings(steps=6, learning_rate=0.2), SINKS, RECENT)
    alpha = trained["alpha"]
    assert alpha.shape == (2, 2) and not torch.equal(alpha, torch.ones(2, 2))
    assert alpha.min() >= 0 and alpha.max() <= 1
    assert len(trained["history"]) == 6 and all(row["seconds"] > 0 for row in trained["history"])
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())  # only the gates trained


def test_a_large_lambda_closes_every_gate():
    trained = train_gates(tiny_llama(), prompts(), GateSettings(steps=12, learning_rate=0.5, reg_weight=100.0),
                          SINKS, RECENT)
    assert torch.equal(trained["alpha"], torch.zeros(2, 2))


def test_the_mean_penalty_is_the_sum_penalty_over_the_gate_count():
    """λ·mean|α| (the official code's l1_loss, the default) is λ/N·Σ|α| (the paper's formula): the same gates when λ
    is scaled by N = 4, different ones when it is not."""
    def trained(weight, reduction):
        settings = GateSettings(steps=4, learning_rate=0.2, reg_weight=weight, reg_reduction=reduction)
        return train_gates(tiny_llama(), prompts(), settings, SINKS, RECENT)["alpha"]

    assert GateSettings().reg_reduction == "mean"
    torch.testing.assert_close(trained(0.4, "mean"), trained(0.1, "sum"), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(trained(0.1, "mean"), trained(0.1, "sum"))


def test_needle_mass_finds_the_head_that_attends_to_the_needle():
    n, needle = 20, slice(5, 8)
    key = torch.zeros(1, 2, n, 8)
    key[0, :, needle, 0] = 10.0  # the needle's keys point along e0 in both KV heads
    query = torch.zeros(1, 4, n, 8)
    query[0, 2:, :, 0] = 10.0  # only KV head 1's query heads (2, 3) look along e0
    rows = torch.tensor([15, 16, 17])
    targets = torch.zeros(3, n, dtype=torch.bool)
    targets[:, needle] = True
    probe = Probe(rows, targets)
    out, _ = probe_attention(types.SimpleNamespace(layer_idx=0), query, key, torch.randn(1, 2, n, 8), None,
                             scaling=1.0, duo_probe=probe)
    assert out.shape == (1, n, 4, 8)
    head0, head1 = probe.mass[0].tolist()
    assert head1 > 0.99
    assert head0 == pytest.approx(sum(3 / (int(r) + 1) for r in rows) / 3, abs=1e-5)  # uniform over earlier keys


def test_needle_mass_of_a_model_is_a_share_per_layer_and_kv_head():
    mass = needle_mass(tiny_llama(3), prompts(2))
    assert mass.shape == (3, 2) and bool(((mass > 0) & (mass < 1)).all())


def test_choose_full_heads_takes_the_top_share_across_the_model():
    scores = torch.tensor([[0.9, 0.1, 0.2], [0.3, 0.8, 0.0], [0.5, 0.4, 0.7], [0.05, 0.6, 0.15]])
    assert choose_full_heads(scores, 0.25) == [[0], [1], [2], []]
    assert count_heads(choose_full_heads(scores, 0.5)) == 6
    assert count_heads(choose_full_heads(scores, 1.0)) == 12
    assert count_heads(choose_full_heads(scores, 0.01)) == 1  # at least one head


def test_choose_full_heads_keeps_every_head_tied_with_the_last():
    scores = torch.tensor([[1.0, 0.5], [0.5, 0.5], [0.0, 0.0]])
    assert choose_full_heads(scores, 1 / 3) == [[0, 1], [0, 1], []]  # 2 asked, the 3 tied at 0.5 come too


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5, True, "half"])
def test_a_fraction_outside_the_unit_interval_is_refused(fraction):
    with pytest.raises(ValueError, match=r"fractions: .* outside \(0, 1\]"):
        choose_full_heads(torch.rand(3, 2), fraction)


class WordTokenizer:
    """Whitespace words -> ids (a space-led word keeps its space), enough for the prompt builder."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def _ids(self, text: str) -> list[int]:
        pieces = [piece for piece in text.replace("\n", " \n ").split(" ") if piece]
        return [self.vocab.setdefault(piece, len(self.vocab)) for piece in pieces]

    def __call__(self, text, add_special_tokens=False):
        ids = [self._ids(t) for t in text] if isinstance(text, list) else self._ids(text)
        return types.SimpleNamespace(input_ids=ids)


def test_passkey_prompts_hide_each_needle_and_ask_for_it():
    tokenizer = WordTokenizer()
    made = passkey_prompts(tokenizer, 3, [300, 400], passkeys=3, words=5, seed=7)
    again = passkey_prompts(tokenizer, 3, [300, 400], passkeys=3, words=5, seed=7)
    assert [p.ids for p in made] == [p.ids for p in again]
    for prompt in made:
        assert 300 <= len(prompt.ids) <= 400
        for (start, end), rows, key in zip(prompt.needles, prompt.answer_rows, prompt.meta["keys"], strict=True):
            answer = [prompt.ids[row + 1] for row in rows]
            assert answer == tokenizer(key).input_ids == prompt.ids[end - len(answer) : end]
            assert start < end <= prompt.loss_rows[0] <= rows[0]
    with pytest.raises(ValueError, match="raise data.lengths"):
        passkey_prompts(tokenizer, 1, [120, 120], passkeys=3, words=5, seed=7)


def test_filler_passkey_prompts_hide_the_key_and_end_with_its_answer():
    tokenizer = WordTokenizer()
    made = filler_passkey_prompts(tokenizer, 4, [200, 260], seed=5)
    assert [p.ids for p in made] == [p.ids for p in filler_passkey_prompts(tokenizer, 4, [200, 260], seed=5)]
    for prompt in made:
        key = tokenizer(str(prompt.meta["key"])).input_ids
        (start, end), rows = prompt.needles[0], prompt.answer_rows[0]
        assert 200 <= len(prompt.ids) <= 260 and len(prompt.answer_rows) == 1
        assert [prompt.ids[row + 1] for row in rows] == key and rows[-1] == len(prompt.ids) - 2
        assert key[0] in prompt.ids[start:end] and key[0] not in prompt.ids[:start] and end <= rows[0]
    assert len({p.meta["key"] for p in made}) == 4


def test_heads_map_is_drawn(tmp_path):
    scores = {"gates": torch.rand(4, 3), "needle": torch.rand(4, 3)}
    chosen = {name: {"0.25": choose_full_heads(table, 0.25)} for name, table in scores.items()}
    plot_heads_map(scores, chosen, tmp_path / "heads_map.png", "test")
    assert (tmp_path / "heads_map.png").stat().st_size > 1000


@pytest.mark.parametrize("change, message", [
    ({"color": 1}, r"unknown keys \['color'\]"),
    ({"fractions": [0.1, 1.2]}, r"fractions: 1.2 is outside \(0, 1\]"),
    ({"sinks": -1}, r"sinks=-1"),
    ({"recent": 5000}, r"recent=5000; use a whole number from 1 to 4096"),
    ({"data": {"lengths": [512]}}, r"data.lengths"),
    ({"gates": {"lr": 0.1}}, r"gates takes"),
    ({"gates": {"steps": -1}}, r"gates.steps=-1"),
    ({"gates": {"reg_reduction": "max"}}, r"gates.reg_reduction='max'; give 'mean'"),
    ({"data": {"passkey_prompts": -2}}, r"data.passkey_prompts=-2"),
])  # fmt: skip
def test_config_errors_name_the_key(tmp_path, tiny_smollm2_llama, change, message):
    path = tmp_path / "duo.yaml"
    path.write_text(yaml.safe_dump({"model": str(tiny_smollm2_llama()), "output_dir": str(tmp_path / "out"),
                                    **change}))
    with pytest.raises(DuoConfigError, match=message):
        load_config(path)


def test_config_defaults(tmp_path, tiny_smollm2_llama):
    path = tmp_path / "duo.yaml"
    path.write_text(yaml.safe_dump({"model": str(tiny_smollm2_llama()), "output_dir": str(tmp_path / "out")}))
    cfg = load_config(path)
    assert (cfg.sinks, cfg.recent, cfg.fractions) == (64, 256, [0.1, 0.25, 0.5])  # DuoAttention deploys 64 sinks
    assert (cfg.gates.learning_rate, cfg.gates.reg_weight) == (0.02, 0.05)


def test_the_recipe_writes_scores_choices_and_duo_folders_that_reload(tmp_path, tiny_smollm2_llama, monkeypatch):
    monkeypatch.setattr(heads, "WORDS_PER_BOOK", 3000)
    heads._train_books.cache_clear()
    path = tmp_path / "duo.yaml"
    path.write_text(yaml.safe_dump({
        "model": str(tiny_smollm2_llama()), "output_dir": str(tmp_path / "out"), "sinks": 2, "recent": 16,
        "fractions": [0.25, 0.5], "data": {"lengths": [300, 340], "passkeys": 2, "words": 4, "train_prompts": 2,
                                           "calibration_prompts": 2},
        "gates": {"steps": 3}, "held_out": {"sequences": 1, "length": 128}, "swap_kl": True}))
    summary = heads.run(heads.load_config(path))
    out = tmp_path / "out"
    record = json.loads((out / "heads.json").read_text())
    assert set(record["chosen"]) == {"gates", "needle", "swap_kl"}
    assert record["heads"]["needle"] == {"0.25": 1, "0.5": 2}  # 4 KV heads in the tiny model
    assert len(record["gates"]["history"]) == 3 and (out / "heads_map.png").is_file()
    assert set(record["held_out_kl"]["layouts"]) == {f"{m} {f}" for m in record["chosen"] for f in ("0.25", "0.5")}
    folder = out / summary["folders"]["needle 0.5"]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.attention_zoo["params"]["full_heads"] == record["chosen"]["needle"]["0.5"]
    assert "full_heads" in (folder / "README.md").read_text()


def test_the_recipe_without_gates_scores_needles_and_filler_passkeys(tmp_path, tiny_smollm2_llama, monkeypatch):
    """``gates.steps: 0`` trains nothing; ``data.passkey_prompts`` adds ``needle_passkey``, the larger of the two
    masses per head, so it keeps every head the needle score keeps at a share when that share's heads lead both."""
    monkeypatch.setattr(heads, "WORDS_PER_BOOK", 3000)
    heads._train_books.cache_clear()
    path = tmp_path / "duo.yaml"
    path.write_text(yaml.safe_dump({
        "model": str(tiny_smollm2_llama()), "output_dir": str(tmp_path / "out"), "sinks": 2, "recent": 16,
        "fractions": [0.5], "data": {"lengths": [300, 340], "passkeys": 2, "words": 4, "calibration_prompts": 2,
                                     "passkey_prompts": 2},
        "gates": {"steps": 0}, "held_out": {"sequences": 1, "length": 128}, "save_models": False}))
    masses = iter([torch.tensor([[0.9, 0.1], [0.2, 0.3]]), torch.tensor([[0.0, 0.0], [0.8, 0.1]])])
    seen = []
    monkeypatch.setattr(heads, "needle_mass", lambda model, prompts: seen.append(prompts) or next(masses))
    heads.run(heads.load_config(path))
    record = json.loads((tmp_path / "out" / "heads.json").read_text())
    assert set(record["chosen"]) == {"needle", "needle_passkey"} and "gates" not in record
    torch.testing.assert_close(torch.tensor(record["scores"]["needle_passkey"]),
                               torch.tensor([[0.9, 0.1], [0.8, 0.3]]))  # the larger mass per head
    assert record["chosen"]["needle"]["0.5"] == [[0], [1]] and record["chosen"]["needle_passkey"]["0.5"] == [[0], [0]]
    assert [len(p.needles) for p in seen[1]] == [1, 1] and "key" in seen[1][0].meta  # filler passkeys, one needle
    assert record["needle_passkey"]["prompts"] == 2 and record["data"]["seeds"]["passkey"] == 1236


def test_binary_gates_are_the_saved_duo_layout():
    model, ids = tiny_llama(), torch.tensor([prompts(1, n=40)[0].ids])
    gates = DuoGates(2, 2, SINKS, RECENT, initial=0.0)
    gates.alpha.data[1, 0] = 1.0
    with torch.no_grad(), attention(model, GATED):
        gated = model.model(input_ids=ids, duo_gates=gates).last_hidden_state
    zoo_configure(model, "duo", full_heads=[[], [0]], sinks=SINKS, recent=RECENT)
    with torch.no_grad():
        torch.testing.assert_close(model.model(input_ids=ids).last_hidden_state, gated, atol=1e-5, rtol=1e-5)


def test_every_shipped_duo_config_loads():
    shipped = sorted((Path(__file__).resolve().parents[1] / "recipes" / "configs" / "duo").glob("*.yaml"))
    assert shipped
    for path in shipped:  # a Hub model's config is checked with the bundled model (no Hub here)
        model = yaml.safe_load(path.read_text())["model"]
        overrides = {"model": "smollm2"} if "/" in model and not Path(model).exists() else None
        assert load_config(path, overrides).fractions, path
