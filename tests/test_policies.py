"""KV policies as objects (zoo/cache/policies/, one dataclass per policy, its parameters as fields): the cache and
the budget variant ask the policy what to record and how to score, built-in policies and a plugin's alike; a
third-party policy comes in through the entry point group ``attention_zoo.kv_policies`` (the fixture package
``tests/plugin_fixture_policy``), the way variants do. A policy is given by name, dict or instance, checked when
built, saved in config.json, and takes the old ``window`` parameter as it was."""

import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from conftest import install_plugin_fixture

import zoo
from zoo import registry
from zoo.cache import DEFAULT_POLICY, POLICIES, BudgetedLayer, KernelStateLayer, Policy, as_policy
from zoo.cache.policies import TOVA, ExpectedAttention, SnapKV
from zoo.registry import get_variant_class
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
    assert BudgetedLayer(16, sinks=1, recent=2, policy="tova").window == 1  # TOVA: the current query
    snapkv = BudgetedLayer(16, sinks=1, recent=2, policy={"name": "snapkv", "window": 8})
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


# ------------------------------------------------------------------------------------------------------
# a policy's own parameters (dataclass fields): given by name, dict or instance, checked, saved, and the old window


def test_parameters_reach_the_score_and_the_recorded_queries():
    layer = _decode("snapkv").layers[0]
    torch.testing.assert_close(layer.scores(), SnapKV(pool=7).score(layer))
    assert not torch.equal(SnapKV(pool=1).score(layer), SnapKV(pool=7).score(layer))  # pooling widens the peaks
    assert (SnapKV(pool=7).score(layer) >= SnapKV(pool=1).score(layer)).all()
    assert layer.queries.shape[-2] == 23  # every query so far, fewer than the default window (32)
    narrow = _decode({"name": "snapkv", "window": 3}).layers[0]
    assert narrow.window == 3 and narrow.queries.shape[-2] == 3 and narrow.policy == SnapKV(window=3)
    assert _decode({"name": "tova", "window": 2}).layers[0].queries.shape[-2] == 2


def test_a_policy_by_name_dict_or_instance_is_the_same_policy():
    configs = [zoo.configure(transformers.LlamaConfig(**SMALL), "budget", tokens=16, sinks=2, recent=4, policy=p)
               for p in ("snapkv", {"name": "snapkv"}, SnapKV(), {"name": "snapkv", "window": 32, "pool": 7})]
    policies = [zoo.variant_for(c).kv_policy for c in configs]
    assert all(p == SnapKV() for p in policies)
    stored = [c.attention_zoo["params"]["policy"] for c in configs]
    assert stored == ["snapkv", *[{"name": "snapkv", "window": 32, "pool": 7}] * 3]  # a name stays a name
    for spec in ({"name": "snapkv", "window": 64, "pool": 5}, SnapKV(window=64, pool=5)):
        assert as_policy(spec) == SnapKV(window=64, pool=5)
    assert as_policy(SnapKV(window=64, pool=5).to_dict()) == SnapKV(window=64, pool=5)
    assert json.loads(json.dumps(SnapKV(window=64).to_dict())) == SnapKV(window=64).to_dict()


def test_a_parametrised_policy_survives_save_pretrained_and_from_pretrained(tmp_path):
    config = transformers.LlamaConfig(**SMALL)
    zoo.configure(config, "budget", tokens=12, sinks=2, recent=4, policy=SnapKV(window=6, pool=3))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["attention_zoo"]["params"]
    assert saved["policy"] == {"name": "snapkv", "window": 6, "pool": 3} and saved["window"] is None
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert zoo.variant_for(reloaded.config).kv_policy == SnapKV(window=6, pool=3)
    ids = torch.randint(3, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    outs = []
    for m in (model, reloaded):
        with torch.no_grad():
            outs.append(m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                                   pad_token_id=0, return_dict_in_generate=True))
    assert outs[0].sequences.tolist() == outs[1].sequences.tolist()
    assert [layer.pos.tolist() for layer in outs[1].past_key_values.layers] == \
        [layer.pos.tolist() for layer in outs[0].past_key_values.layers]
    assert outs[1].past_key_values.layers[0].queries.shape[-2] == 6


@pytest.mark.parametrize("policy, says", [
    ({"name": "snapkv", "windw": 64}, r"has no field 'windw'; its fields: window, pool"),
    ({"name": "snapkv", "window": "64"}, r"field 'window' = '64' is invalid; allowed: a value of type int"),
    ({"name": "snapkv", "window": True}, r"field 'window' = True is invalid"),
    ({"name": "snapkv", "pool": 4}, r"field 'pool' = 4 is invalid; allowed: an odd int >= 1"),
    ({"name": "expected_attention", "window": 0}, r"field 'window' = 0 is invalid; allowed: an int >= 1"),
    ({"name": "h2o", "window": 8}, r"KV policy 'h2o' has no field 'window'; its fields: none"),
    ({"window": 8}, r"needs its name"),
    (3, r"'policy' = 3 is invalid; allowed: str or dict or Policy"),
])
def test_a_bad_policy_is_a_parameter_error_naming_the_field_before_any_work(policy, says):
    with pytest.raises(VariantParameterError, match=says):
        zoo.configure(transformers.LlamaConfig(**SMALL), "budget", tokens=16, sinks=2, recent=4, policy=policy)


def test_the_old_window_parameter_sets_the_window_it_used_to_set():
    def configured(**params):
        config = zoo.configure(transformers.LlamaConfig(**SMALL), "budget", tokens=16, sinks=2, recent=4, **params)
        return zoo.variant_for(config).kv_policy, config.attention_zoo["params"]

    with pytest.warns(DeprecationWarning, match=r"pass policy=\{'name': 'snapkv', 'window': 32\}"):
        policy, params = configured(policy="snapkv", window=32)  # what every config.json before the change holds
    assert policy == SnapKV() and params["policy"] == "snapkv" and params["window"] is None
    with pytest.warns(DeprecationWarning):
        policy, params = configured(policy="expected_attention", window=8)
    assert policy == ExpectedAttention(window=8) and params["policy"] == {"name": "expected_attention", "window": 8}
    with pytest.warns(DeprecationWarning, match="policy 'tova' never read it"):
        assert configured(policy="tova", window=8)[0] == TOVA()  # TOVA kept its one query
    with pytest.raises(VariantParameterError, match=r"'window' is deprecated .*policy=\{'name': 'snapkv', 'window'"):
        configured(policy={"name": "snapkv"}, window=8)
    with pytest.warns(DeprecationWarning):
        assert BudgetedLayer(16, sinks=1, recent=2, policy="snapkv", window=8).window == 8


def test_an_old_config_json_with_window_reloads_with_the_same_policy(tmp_path):
    config = transformers.LlamaConfig(**SMALL)
    zoo.configure(config, "budget", tokens=12, sinks=2, recent=4, policy="snapkv")
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["attention_zoo"]["params"]["window"] = 16  # as written before policies owned their window
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.warns(DeprecationWarning, match="'window' is deprecated"):
        reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
        assert zoo.variant_for(reloaded.config).kv_policy == SnapKV(window=16)


def test_the_cache_the_variant_and_the_eval_config_share_one_default_policy():
    from zoo.eval.config import expand_contestants

    assert DEFAULT_POLICY == "snapkv"
    assert inspect.signature(BudgetedLayer).parameters["policy"].default is DEFAULT_POLICY
    assert get_variant_class("budget").params["policy"].default is DEFAULT_POLICY
    assert expand_contestants([{"family": "budget", "budgets": [0.5]}])[0]["policy"] is DEFAULT_POLICY
    assert BudgetedLayer(16, sinks=1, recent=2).policy == SnapKV()


def test_the_eval_config_takes_policies_with_fields_and_refuses_bad_ones():
    from zoo.eval.config import EvalConfigError, expand_contestants

    rows = expand_contestants([{"family": "budget", "budgets": [0.25],
                                "policies": ["snapkv", {"name": "snapkv", "window": 64, "pool": 5}]}])
    assert [r["name"] for r in rows] == ["budget snapkv 25%", "budget snapkv(window=64,pool=5) 25%"]
    assert rows[1]["policy"] == {"name": "snapkv", "window": 64, "pool": 5}
    with pytest.raises(EvalConfigError, match=r"contestants\[0\]: policy .*field 'pool' = 2 is invalid"):
        expand_contestants([{"family": "budget", "budgets": [0.25], "policies": [{"name": "snapkv", "pool": 2}]}])
    with pytest.raises(EvalConfigError, match=r"contestants\[0\]: policy 'nope'"):
        expand_contestants([{"family": "budget", "budgets": [0.25], "policy": "nope"}])


@dataclass(frozen=True)
class _Stride(Policy):
    """A plugin-style policy with a field of its own: keeps every ``every``-th key."""

    name = "stride"
    every: int = 2

    def check(self) -> None:
        self.at_least("every", 1)

    def score(self, layer) -> torch.Tensor:
        return (layer.pos % self.every == 0).to(torch.float32)


def test_a_registered_policy_receives_its_fields_through_the_dict_form(fresh_policies):
    fresh_policies.register_policy(_Stride)
    layer = _decode({"name": "stride", "every": 3}).layers[0]
    assert layer.policy == _Stride(every=3)
    others = [p for p in layer.pos[0, 0].tolist() if 2 <= p < 23 - 4]  # beyond the sinks and the recent keys
    assert others and all(p % 3 == 0 for p in others)
    with pytest.raises(VariantParameterError, match="field 'every' = 0 is invalid"):
        zoo.configure(transformers.LlamaConfig(**SMALL), "budget", tokens=16, sinks=2, recent=4,
                      policy={"name": "stride", "every": 0})


class _StateLayer(KernelStateLayer):
    state_names = ("summary",)


def test_a_kernel_state_layer_reorders_its_keys_and_state_with_the_beams():
    layer = _StateLayer()
    keys = torch.arange(3.0)[:, None, None, None].expand(3, 1, 5, 2).contiguous()
    layer.update(keys, keys.clone(), kwargs={})
    layer.summary = torch.arange(3)
    layer.reorder_cache(torch.tensor([2, 0, 0]))
    assert layer.keys[:, 0, 0, 0].tolist() == [2.0, 0.0, 0.0] and layer.summary.tolist() == [2, 0, 0]
    layer.batch_select_indices(torch.tensor([0]))
    layer.batch_repeat_interleave(2)
    assert layer.values[:, 0, 0, 0].tolist() == [2.0, 2.0] and layer.summary.tolist() == [2, 2]
    layer.update(keys[:2, :, :1], keys[:2, :, :1], kwargs={})  # the growing buffers follow the new rows
    assert layer.keys[:, 0, :, 0].tolist() == [[2.0] * 5 + [0.0], [2.0] * 5 + [1.0]]
