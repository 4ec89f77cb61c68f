"""The package logger's environment: ASCENDSERVE_LOGGING_LEVEL, vLLM's VLLM_LOGGING_LEVEL and VLLM_CONFIGURE_LOGGING.
Each case runs in its own interpreter (the logger is configured once per process)."""

import subprocess
import sys

import pytest

SCRIPT = """
import logging, sys
logging.basicConfig(stream=sys.stdout, level=logging.DEBUG, format="APP %(levelname)s %(message)s")
from ascendserve.logger import init_logger
log = init_logger("ascendserve.probe")
log.debug("a debug line")
log.info("an info line")
"""


def run(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", **env})


@pytest.mark.parametrize("env, debug", [
    ({}, False),
    ({"VLLM_LOGGING_LEVEL": "DEBUG"}, True),  # vLLM's variable was ignored
    ({"VLLM_LOGGING_LEVEL": "debug"}, True),
    ({"ASCENDSERVE_LOGGING_LEVEL": "INFO", "VLLM_LOGGING_LEVEL": "DEBUG"}, False),  # ours first
])
def test_the_level_as_vllm_reads_it(env, debug):
    proc = run(env)
    assert proc.returncode == 0, proc.stderr
    assert "an info line" in proc.stderr and ("a debug line" in proc.stderr) == debug
    assert "APP" not in proc.stdout  # the package logs through its own handler, not the application's


def test_an_unknown_level_is_one_warning_not_a_traceback():
    proc = run({"VLLM_LOGGING_LEVEL": "verbose"})  # was ValueError: Unknown level: 'VERBOSE' on import
    assert proc.returncode == 0, proc.stderr
    assert ("VLLM_LOGGING_LEVEL=verbose is not a logging level (DEBUG, INFO, WARNING, ERROR, CRITICAL): INFO is used."
            in proc.stderr)
    assert "an info line" in proc.stderr and "a debug line" not in proc.stderr


def test_configure_logging_off_leaves_the_records_to_the_application():
    proc = run({"VLLM_CONFIGURE_LOGGING": "0"})
    assert proc.returncode == 0, proc.stderr
    assert "APP DEBUG a debug line" in proc.stdout and "APP INFO an info line" in proc.stdout
    assert "an info line" not in proc.stderr
