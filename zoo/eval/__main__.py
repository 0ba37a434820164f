"""``python -m zoo.eval CONFIG``: :func:`zoo.eval.cli.main`."""

import sys

from zoo.eval.cli import main

sys.exit(main())
