"""The transformers releases attention-zoo supports, checked once at ``import zoo``.

The zoo relies on transformers behaviour that changed within 5.x (the mask function's ``q_length`` since 5.4, a
config's saved ``attn_implementation`` kept since 5.4, ``cache=`` reaching the model since 5.24): below the floor it
would run, and answer wrong without an error, so importing it there is refused. Above the newest release tested it
imports with a warning. ``scripts/compat_check.sh`` runs the suite on each release named here (docs:
docs/guides/supported-transformers.md).
"""

from __future__ import annotations

import importlib.metadata
import warnings

from packaging.version import Version

FLOOR = "5.24"  # the first release the zoo works on (pyproject.toml's lower bound)
NEWEST_TESTED = "5.25"  # the newest release the compatibility job passes on (pyproject.toml: <5.26)
BELOW_FLOOR_CHECKED = "5.23.0"  # the release the compatibility job shows the refusal on


class UnsupportedTransformersError(ImportError):
    """The installed transformers is older than the first release attention-zoo works on."""


class UntestedTransformersWarning(UserWarning):
    """The installed transformers is newer than the newest release attention-zoo was tested on."""


def supported_range() -> str:
    return f">={FLOOR},<={NEWEST_TESTED}.x"


def check_transformers(installed: str | None = None) -> None:
    """Refuse a transformers older than `FLOOR`; warn once for one newer than `NEWEST_TESTED`.

    Args:
        installed: the version to judge; None: the installed transformers.

    Raises:
        UnsupportedTransformersError: the release is below `FLOOR` (the message names it, the range and the fix).
    """
    installed = installed or importlib.metadata.version("transformers")
    release = Version(installed).release[:2]
    if release < Version(FLOOR).release[:2]:
        raise UnsupportedTransformersError(
            f"attention-zoo needs transformers {supported_range()}, but transformers {installed} is installed: on "
            f"releases before {FLOOR} the zoo would run and give wrong answers without an error (cache= ignored, "
            f"saved variants reloaded as SDPA). Upgrade it: pip install \"transformers>={FLOOR}\""
        )
    if release > Version(NEWEST_TESTED).release[:2]:
        warnings.warn(
            f"attention-zoo was tested on transformers {FLOOR} to {NEWEST_TESTED}; transformers {installed} is "
            f"newer and untested: run `pytest --pyargs zoo.contract` or scripts/compat_check.sh {installed} before "
            f"trusting its results, or pip install \"transformers>={FLOOR},<{_next_minor(NEWEST_TESTED)}\".",
            UntestedTransformersWarning,
            stacklevel=3,
        )


def _next_minor(version: str) -> str:
    major, minor = Version(version).release[:2]
    return f"{major}.{minor + 1}"
