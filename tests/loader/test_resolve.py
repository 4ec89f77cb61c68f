"""resolve_model_path: local paths, HF cache, ModelScope cache, download, and the not-found message."""

import shutil
import sys
import types
from pathlib import Path

import huggingface_hub
import pytest

from ascendserve.loader.resolve import ModelNotFoundError, resolve_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
GGUF_BYTES = b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 16  # magic, version 3, no tensors, no keys


@pytest.fixture(autouse=True)
def isolated_env(tmp_path, monkeypatch):
    """Point every cache at empty tmp dirs, force offline, and fail on any real download."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "MODELSCOPE_CACHE",
                "VLLM_USE_MODELSCOPE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)

    def no_network(*args, **kwargs):
        raise AssertionError("unexpected download")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)


def _model_dir(path: Path, name: str = "config.json", data: bytes = b"{}") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / name).write_bytes(data)
    return path


def _hf_snapshot(cache: Path, repo_id: str, commit: str = COMMIT, ref: str | None = "main") -> Path:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    if ref is not None:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    snapshot = _model_dir(repo / "snapshots" / commit)
    (snapshot / "model.safetensors").write_bytes(b"")  # resolution looks for weight files, not into them
    return snapshot


# ---------------------------------------------------------------------------------------------------
# 1. local paths
# ---------------------------------------------------------------------------------------------------

def test_local_dir_with_config(tmp_path):
    model = _model_dir(tmp_path / "my-model")
    assert resolve_model_path(str(model)) == str(model)
    assert resolve_model_path("my-model") == "my-model"  # relative, as given


def test_local_gguf_file_and_dir_with_one_gguf(tmp_path):
    gguf_dir = _model_dir(tmp_path / "g", "m.Q4_0.gguf", GGUF_BYTES)
    assert resolve_model_path(str(gguf_dir / "m.Q4_0.gguf")) == str(gguf_dir / "m.Q4_0.gguf")
    assert resolve_model_path(str(gguf_dir)) == str(gguf_dir / "m.Q4_0.gguf")


def test_local_dir_with_two_ggufs_is_ambiguous(tmp_path):
    gguf_dir = _model_dir(tmp_path / "g", "a.gguf", GGUF_BYTES)
    (gguf_dir / "b.gguf").write_bytes(GGUF_BYTES)
    with pytest.raises(ModelNotFoundError, match=r"2 \.gguf files \(a\.gguf, b\.gguf\)"):
        resolve_model_path(str(gguf_dir))


def test_local_path_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelNotFoundError, match="is a file but not a GGUF file"):
        resolve_model_path(str(tmp_path / "notes.txt"))
    with pytest.raises(ModelNotFoundError, match="neither a local model nor a repo id"):
        resolve_model_path(str(tmp_path / "missing"))


def test_an_existing_local_path_is_never_taken_for_a_repo_id(tmp_path, monkeypatch):
    """`models/qwen` (relative) that exists but holds no model is reported at once, as a local path; it looked like
    a repo id and was downloaded (or, offline, retried for half a minute and reported as a Hub failure)."""
    monkeypatch.delenv("HF_HUB_OFFLINE")  # the fixture's no_network fails the test on a download attempt
    (tmp_path / "models" / "qwen").mkdir(parents=True)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_path("models/qwen")
    message = str(info.value)
    assert f"{tmp_path / 'models' / 'qwen'} (local path: has no config.json and no .gguf file)" in message
    assert "Not downloaded: the path exists on this machine, so it is not looked up as a repo id" in message
    with pytest.raises(ModelNotFoundError, match=r"(?s)^Tokenizer 'models/qwen' was not found.*has no tokenizer file"):
        resolve_model_path("models/qwen", tokenizer_only=True)


# ---------------------------------------------------------------------------------------------------
# 2. Hugging Face cache
# ---------------------------------------------------------------------------------------------------

def test_hf_cache_refs_main_via_hf_hub_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = _hf_snapshot(tmp_path / "hub", "Qwen/Qwen3-0.6B")
    assert resolve_model_path("Qwen/Qwen3-0.6B") == str(snapshot)


def test_hf_cache_via_hf_home_and_default(tmp_path, monkeypatch):
    snapshot = _hf_snapshot(tmp_path / "home" / ".cache" / "huggingface" / "hub", "org/default")
    assert resolve_model_path("org/default") == str(snapshot)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    snapshot = _hf_snapshot(tmp_path / "hf" / "hub", "org/home")
    assert resolve_model_path("org/home") == str(snapshot)


def test_hf_cache_explicit_revision(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    main = _hf_snapshot(tmp_path / "hub", "org/name", COMMIT, ref="main")
    branch = _hf_snapshot(tmp_path / "hub", "org/name", OTHER_COMMIT, ref="v2")
    assert resolve_model_path("org/name") == str(main)
    assert resolve_model_path("org/name", revision="v2") == str(branch)
    assert resolve_model_path("org/name", revision=COMMIT) == str(main)  # commit hash, no ref file
    with pytest.raises(ModelNotFoundError, match="refs/v3"):
        resolve_model_path("org/name", revision="v3")


def test_hf_snapshot_without_weights_does_not_count(tmp_path, monkeypatch):
    """A snapshot an earlier AutoConfig call left (config.json only) is no hit: the download fills it in."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = _hf_snapshot(tmp_path / "hub", "org/name")
    (snapshot / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="has a config.json but no weight files"):
        resolve_model_path("org/name")
    (snapshot / "pytorch_model.bin").write_bytes(b"")
    assert resolve_model_path("org/name") == str(snapshot)


def test_hf_snapshot_without_config_or_gguf_does_not_count(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = _hf_snapshot(tmp_path / "hub", "org/name")
    (snapshot / "config.json").unlink()
    (snapshot / "README.md").write_text("partial download")
    with pytest.raises(ModelNotFoundError, match="has no config.json and no .gguf file"):
        resolve_model_path("org/name")
    (snapshot / "model.Q8_0.gguf").write_bytes(GGUF_BYTES)
    assert resolve_model_path("org/name") == str(snapshot / "model.Q8_0.gguf")


# ---------------------------------------------------------------------------------------------------
# 3. ModelScope cache
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["models/Qwen/Qwen2.5-0.5B", "models/Qwen/Qwen2___5-0___5B",
                                    "Qwen/Qwen2.5-0.5B"])
def test_modelscope_cache(tmp_path, monkeypatch, layout):
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms"))
    model = _model_dir(tmp_path / "ms" / layout)
    with pytest.raises(ModelNotFoundError):  # ignored unless VLLM_USE_MODELSCOPE is set
        resolve_model_path("Qwen/Qwen2.5-0.5B")
    monkeypatch.setenv("VLLM_USE_MODELSCOPE", "True")
    assert resolve_model_path("Qwen/Qwen2.5-0.5B") == str(model)


def test_modelscope_default_cache_and_truthy_values(tmp_path, monkeypatch):
    model = _model_dir(tmp_path / "home" / ".cache" / "modelscope" / "hub" / "models" / "org" / "name")
    for value in ("1", "true", "TRUE"):
        monkeypatch.setenv("VLLM_USE_MODELSCOPE", value)
        assert resolve_model_path("org/name") == str(model)
    monkeypatch.setenv("VLLM_USE_MODELSCOPE", "0")
    with pytest.raises(ModelNotFoundError):
        resolve_model_path("org/name")


def test_hf_cache_wins_over_modelscope_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_USE_MODELSCOPE", "1")
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    _model_dir(tmp_path / "ms" / "models" / "org" / "name")
    snapshot = _hf_snapshot(tmp_path / "hub", "org/name")
    assert resolve_model_path("org/name") == str(snapshot)


# ---------------------------------------------------------------------------------------------------
# 4./5. download and the not-found error
# ---------------------------------------------------------------------------------------------------

def test_not_found_lists_every_place_searched(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms"))
    monkeypatch.setenv("VLLM_USE_MODELSCOPE", "true")
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_path("org/my.model", revision="dev")
    message = str(info.value)
    assert "'org/my.model' (revision dev) was not found" in message
    for place in [tmp_path / "org" / "my.model",
                  tmp_path / "hub" / "models--org--my.model" / "refs" / "dev",
                  tmp_path / "ms" / "models" / "org" / "my.model",
                  tmp_path / "ms" / "models" / "org" / "my___model",
                  tmp_path / "ms" / "org" / "my.model",
                  tmp_path / "ms" / "hub" / "models" / "org" / "my.model"]:
        assert str(place) in message, place
    assert "Not downloaded: HF_HUB_OFFLINE=1 is set" in message
    assert isinstance(info.value, ValueError)


def test_not_found_reasons_for_download(tmp_path, monkeypatch):
    with pytest.raises(ModelNotFoundError, match="Not downloaded: download=False"):
        resolve_model_path("org/name", download=False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("VLLM_USE_MODELSCOPE", "1")
    monkeypatch.setitem(sys.modules, "modelscope", None)  # import fails
    with pytest.raises(ModelNotFoundError, match="modelscope package is not installed"):
        resolve_model_path("org/name")
    monkeypatch.setenv("VLLM_USE_MODELSCOPE", "0")

    def failing(*args, **kwargs):
        raise OSError("connection refused")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    with pytest.raises(ModelNotFoundError, match="Hugging Face Hub failed: OSError: connection refused"):
        resolve_model_path("org/name")


def test_download_calls_hf_snapshot_download(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    source = _model_dir(tmp_path / "remote")
    (source / "model.safetensors").write_bytes(b"weights")
    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None, **kwargs):
        calls.append((repo_id, revision, allow_patterns, kwargs))
        dest = tmp_path / "downloaded" / (revision or "main")
        shutil.copytree(source, dest)
        return str(dest)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model_path("org/name", revision="v1") == str(tmp_path / "downloaded" / "v1")
    repo_id, revision, patterns, kwargs = calls[0]
    assert (repo_id, revision, kwargs) == ("org/name", "v1", {})
    assert {"*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"} <= set(patterns)


@pytest.mark.parametrize("files, weights", [(["model.safetensors", "pytorch_model.bin"], "*.safetensors"),
                                            (["pytorch_model-00001-of-00002.bin"], "*.bin")])
def test_download_takes_bin_weights_only_without_safetensors(tmp_path, monkeypatch, files, weights):
    """vLLM's fallback: a repo with PyTorch .bin weights and no safetensors gets its .bin files (it used to get no
    weights at all)."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo_id, revision=None: ["config.json", *files])
    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None, **kwargs):
        calls.append(allow_patterns)
        return str(_model_dir(tmp_path / "downloaded"))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    resolve_model_path("org/name")
    assert weights in calls[0] and "*.json" in calls[0] and ("*.bin" in calls[0]) != ("*.safetensors" in calls[0])


def test_tokenizer_repo_without_a_model(tmp_path, monkeypatch):
    """--tokenizer ORG/NAME may name a tokenizer-only repo: its cached snapshot counts (no config.json or weights
    needed), and a download fetches only tokenizer files."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    repo = cache / "models--org--tok"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = _model_dir(repo / "snapshots" / COMMIT, "tokenizer.json")
    assert resolve_model_path("org/tok", tokenizer_only=True) == str(snapshot)
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve_model_path("org/tok")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, revision=None, allow_patterns=None: calls.append((revision, allow_patterns))
                        or str(_model_dir(tmp_path / "fetched", "tokenizer_config.json")))
    assert resolve_model_path("org/other", revision="v2", tokenizer_only=True) == str(tmp_path / "fetched")
    assert calls == [("v2", ["*.json", "*.model", "*.txt", "*.jinja", "tokenizer*"])]


def test_tokenizer_repo_id_loads_offline_from_the_cache(tmp_path, monkeypatch):
    """`--tokenizer org/tok` with the repo in the HF cache and HF_HUB_OFFLINE set: transformers itself, given the repo
    id, looks for a config.json that a tokenizer-only repo lacks and fails offline; given the snapshot it loads."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from ascendserve.config import EngineArgs
    from ascendserve.loader.model_loader import load_tokenizer

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    repo = cache / "models--org--tok"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "v2").write_text(COMMIT)
    snapshot = _model_dir(repo / "snapshots" / COMMIT, "tokenizer_config.json",
                          b'{"tokenizer_class": "PreTrainedTokenizerFast"}')
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(snapshot / "tokenizer.json"))
    tokenizer = load_tokenizer("unused", EngineArgs(tokenizer="org/tok", tokenizer_revision="v2"))
    assert tokenizer.encode("hello world", add_special_tokens=False) == [1, 2]


def test_download_of_a_repo_without_config_is_reported(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    empty = tmp_path / "empty-snapshot"
    empty.mkdir()
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: str(empty))
    with pytest.raises(ModelNotFoundError, match="has no config.json and no .gguf file"):
        resolve_model_path("org/name")


def test_modelscope_download(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("VLLM_USE_MODELSCOPE", "1")
    model = _model_dir(tmp_path / "ms-download")
    calls = []
    fake = types.ModuleType("modelscope")
    fake.snapshot_download = lambda model_id, **kwargs: calls.append((model_id, kwargs)) or str(model)
    monkeypatch.setitem(sys.modules, "modelscope", fake)
    assert resolve_model_path("org/name", revision="v1.0") == str(model)
    assert calls == [("org/name", {"revision": "v1.0"})]


def test_max_model_len_above_the_model_needs_vllms_switch(monkeypatch):
    """Above max_position_embeddings: a ValueError naming both numbers and VLLM_ALLOW_LONG_MAX_MODEL_LEN; with it set,
    the asked length is used (with a warning), as in vLLM."""
    from types import SimpleNamespace

    from ascendserve.loader.model_loader import ALLOW_LONG_ENV, _resolve_max_model_len

    config = SimpleNamespace(max_position_embeddings=8192)
    monkeypatch.delenv(ALLOW_LONG_ENV, raising=False)
    assert _resolve_max_model_len(None, config) == 8192 and _resolve_max_model_len(4096, config) == 4096
    with pytest.raises(ValueError, match=r"max_model_len \(100000\).*\(8192:.*VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"):
        _resolve_max_model_len(100000, config)
    monkeypatch.setenv(ALLOW_LONG_ENV, "1")
    assert _resolve_max_model_len(100000, config) == 100000
