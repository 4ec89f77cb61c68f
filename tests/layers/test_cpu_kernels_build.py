"""cpu_kernels' build lock handling: a lock left by a killed build must not hang every later process."""

import logging
import os
import time

from ascendserve.layers import cpu_kernels


def test_a_stale_build_lock_is_removed_with_a_warning(tmp_path, caplog):
    lock = tmp_path / "lock"
    lock.write_text("")
    old = time.time() - cpu_kernels.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING):
        assert cpu_kernels.clear_stale_build_lock(str(tmp_path))
    assert not lock.exists() and "stale CPU-kernel build lock" in caplog.text


def test_a_recent_build_lock_is_kept_and_the_wait_named(tmp_path, caplog):
    lock = tmp_path / "lock"
    lock.write_text("")  # another process may be building now
    with caplog.at_level(logging.INFO):
        assert not cpu_kernels.clear_stale_build_lock(str(tmp_path))
    assert lock.exists()
    assert "Waiting for the CPU-kernel build" in caplog.text and str(lock) in caplog.text
    assert not cpu_kernels.clear_stale_build_lock(str(tmp_path / "missing"))
