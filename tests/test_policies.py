"""KV policies as objects (zoo/cache/policies.py): the cache and the budget variant ask the policy what to record and
how to score, built-in policies and a plugin's alike; a third-party policy comes in through the entry point group
``attention_zoo.kv_policies`` (the fixture package ``tests/plugin_fixture_policy``), the way variants do."""

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from conftest import install_plugin_fixture

import zoo
from zoo import registry
from zoo.cache import POLICIES, BudgetedLayer, Policy
from zoo.variant import VariantParameterError

POLICY_SRC = Path(__file__).parent / "plugin_fixture_policy"
SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, pad_token_id=0, eos_token_id=None, max_position_embeddings=128)


@pytest.fixture
def fresh_policies(monkeypatch):
    """Rediscover KV policies from scratch and restore the registry afterwards."""
    monkeypatch.setattr(registry, "_policy_entries", {})
    monkeypatch.setattr(registry, "_policies_discovered", False)
    return registry


@pytest.fixture
def policy_plugin(fresh_policies, monkeypatch):
    """The fixture plugin pip-installed into a private folder on sys.path."""
    monkeypatch.syspath_prepend(str(install_plugin_fixture(POLICY_SRC, "zoo_policy_plugin")))
    return fresh_policies


def _decode(policy, tokens=12, sinks=2, recent=4, length=20, new=4):
    config = transformers.LlamaConfig(**SMALL)
    zoo.configure(config, "budget", tokens=tokens, sinks=sinks, recent=recent, policy=policy)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(3, 64, (1, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             pad_token_id=0, return_dict_in_generate=True)
    return out.past_key_values


def test_the_built_in_policies_state_what_the_cache_records():
    assert set(POLICIES) <= set(registry.list_policies())
    flags = {name: (registry.get_policy_class(name)().records_queries, registry.get_policy_class(name)().accumulates)
             for name in POLICIES}
    assert flags == {"sinks_recent": (False, False), "knorm": (False, False), "tova": (True, False),
                     "h2o": (False, True), "snapkv": (True, False), "expected_attention": (True, False)}
    assert BudgetedLayer(16, sinks=1, recent=2, policy="tova", window=8).window == 1  # TOVA: the current query
    snapkv = BudgetedLayer(16, sinks=1, recent=2, policy="snapkv", window=8)
    assert snapkv.window == 8 and snapkv.records_queries and not snapkv.accumulates
    assert registry.policy_source("tova").distribution == "attention-zoo"


def test_a_plugin_policy_is_discovered_from_its_own_distribution_and_used_by_budget(policy_plugin):
    assert "oldest_first" in policy_plugin.list_policies()
    assert policy_plugin.policy_source("oldest_first").distribution == "zoo-policy-plugin"
    cache = _decode("oldest_first")
    seen = 20 + 4 - 1  # the last generated token is not fed back
    for layer in cache.layers:
        assert type(layer.policy).__name__ == "OldestFirst" and layer.evicted
        # the sinks, then the oldest of the others (the plugin's score), then the recent keys
        expected = [0, 1, *range(2, 8), *range(seen - 4, seen)]
        assert layer.pos.tolist() == [[expected] * 2]
        assert layer.queries.shape[-2] == 2  # the policy's own query window, not the variant's (32)


def test_an_unknown_policy_is_a_parameter_error_naming_the_choices(fresh_policies):
    with pytest.raises(VariantParameterError, match=r"'policy' = 'nope' is invalid; allowed: one of .*'tova'"):
        zoo.configure(transformers.LlamaConfig(**SMALL), "budget", tokens=16, sinks=2, recent=4, policy="nope")
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        BudgetedLayer(16, sinks=1, recent=2, policy="nope")


def test_a_broken_policy_plugin_warns_and_the_built_ins_still_work(fresh_policies, tmp_path, monkeypatch):
    info = tmp_path / "broken_policy_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-policy-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[attention_zoo.kv_policies]\nnot_a_policy = collections:OrderedDict\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match=r"'not_a_policy'.*broken-policy-plugin.*zoo.cache.Policy subclass"):
        names = fresh_policies.list_policies()
    assert "not_a_policy" not in names and "tova" in names
    with pytest.raises(zoo.BrokenVariantError, match="KV policy 'not_a_policy'"):
        fresh_policies.get_policy_class("not_a_policy")
    with pytest.raises(VariantParameterError, match="'policy' = 'not_a_policy': .*failed to import"):
        zoo.configure(transformers.LlamaConfig(**SMALL), "budget", tokens=16, sinks=2, recent=4,
                      policy="not_a_policy")


@dataclass(frozen=True)
class _NewestOthers(Policy):
    """Keeps the newest keys: the same choice as sinks_recent, from a score of its own."""

    name = "newest_others"
    accumulates = True

    def score(self, layer) -> torch.Tensor:
        return layer.pos.to(torch.float32) * 2


def test_a_policy_registered_in_process_is_asked_for_its_flags_and_scores(fresh_policies):
    fresh_policies.register_policy(_NewestOthers)
    assert fresh_policies.get_policy_class("newest_others") is _NewestOthers
    cache = _decode("newest_others")
    recency = _decode("sinks_recent")
    for layer, reference in zip(cache.layers, recency.layers, strict=True):
        assert layer.accumulates and float(layer.mass.sum()) > 0  # the kernel summed attention mass for it
        torch.testing.assert_close(layer.scores(), 2 * reference.scores())
        assert layer.pos.tolist() == reference.pos.tolist()
    with pytest.raises(TypeError, match="override score"):
        fresh_policies.register_policy(type("NoScore", (Policy,), {"name": "no_score"}))
