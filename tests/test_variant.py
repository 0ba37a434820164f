"""The Variant base class: a parameter cannot shadow a member (error at class definition, naming the parameter,
the member and the fix), and ``renamed_params`` maps old parameter names with one log line."""

from __future__ import annotations

import inspect
import logging
import re

import pytest
import transformers

import zoo
from zoo.variant import Param, Variant, VariantParameterError


def define(params: dict, **members):
    return type("MyAttention", (Variant,), {"name": "mine", "params": params, **members})


@pytest.mark.parametrize(
    ("parameter", "member"),
    [("name", "Variant.name"), ("params", "Variant.params"), ("exact", "Variant.exact"), ("flops", "Variant.flops"),
     ("pattern", "Variant.pattern"), ("per_layer", "Variant.per_layer"), ("config", "Variant.config")],
)
def test_a_parameter_named_like_a_variant_member_is_refused_at_class_definition(parameter, member):
    with pytest.raises(TypeError, match=rf"parameter '{parameter}' has the name of the member {member}.*Rename"):
        define({parameter: Param(1, int)})


def test_a_parameter_named_like_a_method_of_the_subclass_is_refused():
    with pytest.raises(TypeError, match=r"parameter 'layout' has the name of the member MyAttention.layout"):
        define({"layout": Param(1, int)}, layout=lambda self: None)


def test_parameters_are_attributes():
    cls = define({"width": Param(4, int, min=1), "per": Param(2, int, per_layer=True)})
    variant = cls(per=[1, 3])
    assert variant.width == 4 and variant.config == {"width": 4, "per": [1, 3]}
    assert [variant.per_layer("per", i) for i in range(3)] == [1, 3, 1]


def test_renamed_params_map_an_old_name_with_one_log_line(caplog):
    cls = define({"width": Param(4, int, min=1)}, renamed_params={"size": "width"})
    with caplog.at_level(logging.WARNING, logger="zoo.variant"):
        variant = cls(size=7)
    assert variant.width == 7 and variant.config == {"width": 7}
    messages = [r.getMessage() for r in caplog.records if r.name == "zoo.variant"]
    assert len(messages) == 1 and "'size' is now called 'width'" in messages[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zoo.variant"):
        cls(width=7)
    assert not caplog.records  # the new name logs nothing
    with pytest.raises(VariantParameterError, match="got both 'size' and 'width'"):
        cls(size=1, width=2)


def test_renamed_params_must_map_an_old_name_to_a_current_parameter():
    with pytest.raises(TypeError, match="renamed_params"):
        define({"width": Param(4, int)}, renamed_params={"width": "size"})
    with pytest.raises(TypeError, match="renamed_params"):
        define({"width": Param(4, int)}, renamed_params={"size": "height"})


def test_configure_accepts_the_old_name_and_saves_the_new_one():
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    zoo.configure(config, "sparse_transformer", pattern="fixed", stride=8, num_summary=2)
    assert zoo.variant_spec(config)["params"] == {"layout": "fixed", "stride": 8, "num_summary": 2}


def test_every_built_in_variant_reads_its_parameters_one_way():
    """Attributes (``self.x``) or ``self.per_layer(...)``; never ``self.config[...]`` (the pre-check workaround)."""
    for name in zoo.list_variants():
        cls = zoo.get_variant_class(name)
        if not cls.__module__.startswith("zoo.variants."):
            continue
        source = inspect.getsource(inspect.getmodule(cls))
        reads = re.findall(r"self\.config\[[^\]]+\](?!\s*=[^=])", source)  # a stored value rewritten is no read
        assert not reads, f"{cls.__module__}: read parameters as attributes"


def test_a_pattern_only_variant_counts_its_flops_from_the_pattern_hints():
    """dilated_prefix (plugin fixture) declares no flops(): the count comes from its pattern's key blocks."""
    plugin = zoo.get_variant_class("dilated_prefix")
    n, heads, dim = 4096, 12, 64
    narrow, wide = plugin(window=64, dilation=2, prefix=4), plugin(window=256, dilation=2, prefix=4)
    # reach 128 -> 2 blocks of 64 on each side + its own, plus the block holding the 4 prefix tokens: 6 key blocks
    assert narrow.flops(n, heads, dim) == 4.0 * heads * dim * (n // 64) * 64 * 6 * 64
    dense = zoo.get_variant_class("sdpa")().flops(n, heads, dim)
    assert narrow.flops(n, heads, dim) < wide.flops(n, heads, dim) < dense
