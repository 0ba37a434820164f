"""The contract suite (zoo/contract.py) over every registered variant, the plugin fixture included."""

from zoo.contract import *  # noqa: F403
