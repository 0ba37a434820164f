"""lm-evaluation-harness's command line with the zoo imported first, so a saved zoo model loads with its variant.

``python -m zoo.interop.lm_eval --model hf --model_args pretrained=FOLDER --tasks ...`` takes exactly the arguments
of ``lm_eval`` (``pip install "attention-zoo[lm_eval]"``). lm-eval has no plugin hook that would import the zoo
(``trust_remote_code`` only loads a model folder's own code), and a config.json naming the zoo's attention loads only
once ``import zoo`` has registered it. In Python, ``import zoo`` and pass ``HFLM(pretrained=model)`` instead.

One argument of the zoo's own, ``--ruler_essays books``, puts the held-out Gutenberg books where RULER's essay
haystack would be downloaded (as ``zoo eval``'s ``essays: books`` does, :mod:`zoo.eval.ruler`), so the two give the
same RULER samples offline.
"""

from __future__ import annotations

import contextlib
import sys

from lm_eval.__main__ import cli_evaluate

import zoo  # noqa: F401  registers the zoo's attention with transformers before lm-eval loads the model
from zoo.eval import ruler


def main() -> None:
    """Run lm-eval's CLI on ``sys.argv`` (less ``--ruler_essays MODE``, which is the zoo's)."""
    argv, essays = list(sys.argv), None
    if "--ruler_essays" in argv:
        at = argv.index("--ruler_essays")
        if at + 1 >= len(argv):
            raise SystemExit("--ruler_essays needs a value: books, download or auto.")
        essays = argv[at + 1]
        del argv[at : at + 2]
    context = contextlib.nullcontext()
    if essays is not None:
        ruler.check_options("ruler", essays, "auto")
        ruler.sentence_model()
        context = ruler.essay_haystack(essays, {})
    sys.argv = argv
    with context:
        cli_evaluate()


if __name__ == "__main__":
    main()
