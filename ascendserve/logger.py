"""One logging setup for the whole package: `init_logger(__name__)` in every module."""

import logging
import os
import sys

_ROOT = "ascendserve"
_configured = False


def _configure_root() -> None:
    global _configured
    if _configured:
        return
    root = logging.getLogger(_ROOT)
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(
            "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s", "%m-%d %H:%M:%S"))
        root.addHandler(handler)
    root.setLevel(os.environ.get("ASCENDSERVE_LOGGING_LEVEL", "INFO").upper())
    root.propagate = False
    _configured = True


def init_logger(name: str) -> logging.Logger:
    """Return the package logger for `name` (a module's `__name__`)."""
    _configure_root()
    return logging.getLogger(name)
