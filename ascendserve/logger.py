"""One logging setup for the whole package: `init_logger(__name__)` in every module."""

import logging
import os
import sys

_ROOT = "ascendserve"
_configured = False


LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _configure_root() -> None:
    """The package's stderr handler and level. The level is ASCENDSERVE_LOGGING_LEVEL, else vLLM's
    VLLM_LOGGING_LEVEL, else INFO; VLLM_CONFIGURE_LOGGING=0 (vLLM's) leaves handlers and level to the
    application, whose root logger then gets the records."""
    global _configured
    if _configured:
        return
    _configured = True
    root = logging.getLogger(_ROOT)
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        root.propagate = True
        return
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(
            "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s", "%m-%d %H:%M:%S"))
        root.addHandler(handler)
    root.propagate = False
    variable = next((v for v in ("ASCENDSERVE_LOGGING_LEVEL", "VLLM_LOGGING_LEVEL") if os.environ.get(v)), None)
    level = os.environ[variable].strip().upper() if variable else "INFO"
    root.setLevel(level if level in LEVELS else "INFO")
    if level not in LEVELS:  # it was a ValueError traceback on import, before any command ran
        root.warning("%s=%s is not a logging level (%s): INFO is used.", variable, os.environ[variable],
                     ", ".join(LEVELS))


def init_logger(name: str) -> logging.Logger:
    """Return the package logger for `name` (a module's `__name__`)."""
    _configure_root()
    return logging.getLogger(name)
