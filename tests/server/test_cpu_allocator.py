"""The command line restarts itself under tcmalloc on CPU (ascendserve/cli/allocator.py)."""

import os
import subprocess
import sys

import pytest

from ascendserve.cli import allocator
from tests.server.utils import server  # noqa: F401

TCMALLOC = allocator.find_tcmalloc()
NO_ACCELERATOR = not any(os.path.exists(node) for node in allocator._ACCELERATOR_NODES)


def _needs_tcmalloc():
    if TCMALLOC is None:
        if os.environ.get("CI"):  # scripts/setup_venv.sh installs it where it can: CI must have it
            pytest.fail("tcmalloc is not installed; scripts/setup_venv.sh should have installed libtcmalloc-minimal4")
        pytest.skip("tcmalloc is not installed here (apt install libtcmalloc-minimal4)")


@pytest.mark.parametrize("argv", [["serve", "--port", "8001"], ["generate", "Hi"], ["bench", "throughput"],
                                  ["bench", "latency", "--device", "cpu"], ["serve", "--device=cpu"]])
def test_engine_commands_on_cpu_restart_with_tcmalloc(argv):
    _needs_tcmalloc()
    if "--device" not in " ".join(argv) and not NO_ACCELERATOR:
        pytest.skip("an accelerator's device node exists: the auto device is not the CPU here")
    env = allocator.preload_env(argv, {"LD_PRELOAD": "/opt/libiomp5.so"})
    assert env is not None
    assert env["LD_PRELOAD"] == f"{TCMALLOC}:/opt/libiomp5.so"
    assert env[allocator._EXECED] == "1"


@pytest.mark.parametrize("argv, env", [
    (["bench", "serve", "--base-url", "http://x"], {}),       # a client, no engine
    (["serve", "--device", "cuda"], {}),                      # not the CPU
    (["serve", "--device=npu:1"], {}),
    (["serve"], {allocator.ENV_VAR: "system"}),                # opted out
    (["serve"], {allocator._EXECED: "1"}),                     # restarted once already
])
def test_no_restart(argv, env):
    assert allocator.preload_env(argv, env) is None


def test_the_device_of_a_config_file_decides_too(tmp_path):
    """`serve --config FILE` with `device:` in the file: the restart reads it as it reads --device."""
    path = tmp_path / "config.yaml"
    path.write_text("device: cuda\n")
    assert allocator.preload_env(["serve", "--config", str(path)], {}) is None
    assert allocator.preload_env(["serve", f"--config={path}"], {}) is None
    assert allocator._device(["serve", "--config", str(path), "--device", "cpu"]) == "cpu"  # the command line wins
    path.write_text("device: [unclosed\n")
    assert allocator._device(["serve", "--config", str(path)]) == "auto"  # the parser reports the file later
    assert allocator._device(["serve", "--config", str(tmp_path / "missing.yaml")]) == "auto"
    path.write_text("device: cpu\n")
    assert allocator._device(["serve", "--config", str(path)]) == "cpu"


def test_a_named_library_is_preloaded_instead():
    if not NO_ACCELERATOR:
        pytest.skip("an accelerator's device node exists: the auto device is not the CPU here")
    env = allocator.preload_env(["serve"], {allocator.ENV_VAR: "/usr/lib/libjemalloc.so.2"})
    assert env["LD_PRELOAD"] == "/usr/lib/libjemalloc.so.2"


def test_the_server_process_runs_under_tcmalloc(server):  # noqa: F811
    _needs_tcmalloc()
    if not NO_ACCELERATOR:
        pytest.skip("an accelerator's device node exists: the shared server does not run on the CPU")
    with open(f"/proc/{server.proc.pid}/maps", encoding="utf-8") as f:  # exec keeps the pid
        assert "tcmalloc" in f.read()
    assert "CPU allocator: tcmalloc" in server.read_log()


def test_system_opts_out_and_the_log_says_so():
    # `generate --help` restarts (or not) before parsing, then prints help: the log line tells which malloc ran.
    out = subprocess.run([sys.executable, "-m", "ascendserve.cli.main", "generate", "--device", "cpu", "--help"],
                         env={**os.environ, allocator.ENV_VAR: "system"}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"CPU allocator: glibc malloc ({allocator.ENV_VAR}=system)" in out.stderr
    if TCMALLOC:
        out = subprocess.run([sys.executable, "-m", "ascendserve.cli.main", "generate", "--device", "cpu", "--help"],
                             env={k: v for k, v in os.environ.items() if k != allocator.ENV_VAR},
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "CPU allocator: tcmalloc" in out.stderr


def test_a_library_that_cannot_be_preloaded_is_named_and_the_command_still_runs(tmp_path):
    missing = str(tmp_path / "libnothere.so")
    out = subprocess.run([sys.executable, "-m", "ascendserve.cli.main", "generate", "--device", "cpu", "--help"],
                         env={**os.environ, allocator.ENV_VAR: missing}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"{allocator.ENV_VAR}={missing} could not be preloaded" in out.stderr
