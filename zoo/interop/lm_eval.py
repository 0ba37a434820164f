"""lm-evaluation-harness's command line with the zoo imported first, so a saved zoo model loads with its variant.

``python -m zoo.interop.lm_eval --model hf --model_args pretrained=FOLDER --tasks ...`` takes exactly the arguments
of ``lm_eval`` (``pip install "attention-zoo[lm_eval]"``). lm-eval has no plugin hook that would import the zoo
(``trust_remote_code`` only loads a model folder's own code), and a config.json naming the zoo's attention loads only
once ``import zoo`` has registered it. In Python, ``import zoo`` and pass ``HFLM(pretrained=model)`` instead.
"""

from __future__ import annotations

from lm_eval.__main__ import cli_evaluate

import zoo  # noqa: F401  registers the zoo's attention with transformers before lm-eval loads the model


def main() -> None:
    """Run lm-eval's CLI on ``sys.argv``."""
    cli_evaluate()


if __name__ == "__main__":
    main()
