"""The contract suite's plugin-facing pytest path: ``pytest --pyargs zoo.contract -k my_variant`` (it lives in
:mod:`zoo.testing.contract`)."""

from zoo.testing.contract import *  # noqa: F403
