"""Turn `--model` into a local path the way vLLM does: local path, HF cache, ModelScope cache, download.

Order (first hit wins):
  1. a local path: a directory with config.json, a .gguf file, or a directory holding one .gguf;
  2. a repo id (`org/name`) in the Hugging Face cache (`models--org--name/snapshots/<commit>`);
  3. with VLLM_USE_MODELSCOPE=true, the ModelScope cache (`<MODELSCOPE_CACHE>/models/org/name`);
  4. a download (`modelscope.snapshot_download` or `huggingface_hub.snapshot_download`),
     unless `download=False` or HF_HUB_OFFLINE is set.
Otherwise `ModelNotFoundError` lists every place searched and why nothing was downloaded.
"""

import os
import re
from pathlib import Path

from ascendserve.loader.gguf_loader import is_gguf
from ascendserve.logger import init_logger

logger = init_logger(__name__)

# What a download fetches: config, tokenizer and chat template, then the weights: safetensors, or PyTorch .bin files
# where the repo has no safetensors (vLLM's fallback).
TOKENIZER_PATTERNS = ["*.json", "*.model", "*.txt", "*.jinja", "tokenizer*"]
SAFETENSORS_PATTERN, PYTORCH_BIN_PATTERN = "*.safetensors", "*.bin"  # the loader reads the same two kinds
HF_ALLOW_PATTERNS = TOKENIZER_PATTERNS + [SAFETENSORS_PATTERN]
# The files that make a directory a tokenizer (--tokenizer ORG/NAME may name a repo without a model).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_REPO_ID_RE = re.compile(r"[A-Za-z0-9_][\w.-]*(/[\w.-]+)?")
_COMMIT_RE = re.compile(r"[0-9a-f]{40}")


class ModelNotFoundError(ValueError):
    """`--model` names no local model, no cached snapshot, and could not be downloaded."""


def resolve_model_path(model: str, revision: str | None = None, download: bool = True,
                       tokenizer_only: bool = False) -> str:
    """Return a local model directory or .gguf file for `model` (a path or a hub repo id); with `tokenizer_only`, a
    directory holding a tokenizer (no config.json or weights needed) or a .gguf file, fetching only tokenizer files."""
    searched: list[str] = []
    local = Path(model).expanduser()
    found = _find_local(local, searched, tokenizer_only)
    if found is not None:
        return found
    if local.exists():  # a directory or file here is what was meant (vLLM reads it as local too), never a repo id
        raise ModelNotFoundError(_not_found_message(
            model, revision, searched, "the path exists on this machine, so it is not looked up as a repo id",
            tokenizer_only))
    if not _REPO_ID_RE.fullmatch(model):
        raise ModelNotFoundError(_not_found_message(
            model, revision, searched, "it is neither a local model nor a repo id like 'org/name'", tokenizer_only))
    found = _find_in_hf_cache(model, revision, searched, tokenizer_only)
    if found is None and use_modelscope():
        found = _find_in_modelscope_cache(model, searched, tokenizer_only)
    if found is None:
        found, why = _download(model, revision, download, tokenizer_only)
        if found is None:
            raise ModelNotFoundError(_not_found_message(model, revision, searched, why, tokenizer_only))
    logger.debug("Resolved %s %r to %s", "tokenizer" if tokenizer_only else "model", model, found)
    return found


def use_modelscope() -> bool:
    """True when VLLM_USE_MODELSCOPE is set to '1' or 'true' (any case), as in vLLM."""
    return os.environ.get("VLLM_USE_MODELSCOPE", "").strip().lower() in ("1", "true")


def _is_offline() -> bool:
    # huggingface_hub's own truthy parsing of HF_HUB_OFFLINE.
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


# ---------------------------------------------------------------------------------------------------
# Local directories and files
# ---------------------------------------------------------------------------------------------------

def _model_in(path: Path, tokenizer_only: bool = False) -> tuple[str | None, str]:
    """(the model at `path` or None, why not): a dir with config.json (tokenizer_only: with a TOKENIZER_FILES file),
    a .gguf, or a dir with one .gguf."""
    if path.is_file():
        return (str(path), "") if is_gguf(path) else (None, "is a file but not a GGUF file")
    if not path.is_dir():
        return None, "does not exist"
    if tokenizer_only and any((path / name).is_file() for name in TOKENIZER_FILES):
        return str(path), ""
    if (path / "config.json").is_file() and not tokenizer_only:
        return str(path), ""
    ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(ggufs) == 1:
        return str(ggufs[0]), ""
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ModelNotFoundError(f"{path} has no config.json and {len(ggufs)} .gguf files ({names}); "
                                 "pass the path of the one to load")
    return None, ("has no tokenizer file (" + ", ".join(TOKENIZER_FILES) + ") and no .gguf file" if tokenizer_only
                  else "has no config.json and no .gguf file")


def _find_local(path: Path, searched: list[str], tokenizer_only: bool = False) -> str | None:
    found, why = _model_in(path, tokenizer_only)
    if found is None:
        searched.append(f"{path.absolute()} (local path: {why})")
    return found


# ---------------------------------------------------------------------------------------------------
# Hugging Face cache: <cache>/models--org--name/{refs/<revision>, snapshots/<commit>/}
# ---------------------------------------------------------------------------------------------------

def hf_hub_cache_dir() -> Path:
    """The HF hub cache, resolved as huggingface_hub does (HF_HUB_CACHE, HF_HOME/hub, XDG, ~/.cache)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    hf_home = os.environ.get("HF_HOME")
    if hf_home:
        return Path(hf_home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def _find_in_hf_cache(repo_id: str, revision: str | None, searched: list[str],
                      tokenizer_only: bool = False) -> str | None:
    repo_dir = hf_hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    rev = revision or "main"
    ref = repo_dir / "refs" / rev
    if ref.is_file():
        commit = ref.read_text().strip()
        found = _find_snapshot(repo_dir / "snapshots" / commit, searched, f"refs/{rev} -> {commit}", tokenizer_only)
        if found is not None:
            return found
    else:
        searched.append(f"{ref} (HF cache: no such ref)")
    if _COMMIT_RE.fullmatch(rev):
        return _find_snapshot(repo_dir / "snapshots" / rev, searched, "revision is a commit hash", tokenizer_only)
    return None


def _find_snapshot(snapshot: Path, searched: list[str], how: str, tokenizer_only: bool = False) -> str | None:
    """The model in a cached snapshot; one with a config.json but no weight file (what a config-only fetch leaves) is
    no hit, so the download fills it in."""
    found, why = _model_in(snapshot, tokenizer_only)
    if found is not None and not tokenizer_only and Path(found).is_dir() and not any(
            any(snapshot.glob(pattern)) for pattern in (SAFETENSORS_PATTERN, PYTORCH_BIN_PATTERN)):
        found, why = None, "has a config.json but no weight files (an incomplete download)"
    if found is None:
        searched.append(f"{snapshot} (HF cache, {how}: {why})")
    return found


# ---------------------------------------------------------------------------------------------------
# ModelScope cache
# ---------------------------------------------------------------------------------------------------

def modelscope_cache_candidates(repo_id: str) -> list[Path]:
    """Directories the ModelScope SDK may have used for `repo_id`, newest layout first.

    The cache root is $MODELSCOPE_CACHE, default ~/.cache/modelscope/hub. Recent SDKs store
    `<root>/models/<org>/<name>` with '.' in the name written as '___' (`Qwen2.5-0.5B` ->
    `Qwen2___5-0___5B`); older ones `<root>/<org>/<name>`, and some read $MODELSCOPE_CACHE as the
    parent of `hub/` -- so an explicit $MODELSCOPE_CACHE is also searched under `hub/`.
    """
    explicit = os.environ.get("MODELSCOPE_CACHE")
    root = Path(explicit).expanduser() if explicit else Path.home() / ".cache" / "modelscope" / "hub"
    bases = [root / "models", root] + ([root / "hub" / "models", root / "hub"] if explicit else [])
    org, _, name = repo_id.rpartition("/")
    names = dict.fromkeys([name, name.replace(".", "___")])
    return [base / org / n for base in bases for n in names]


def _find_in_modelscope_cache(repo_id: str, searched: list[str], tokenizer_only: bool = False) -> str | None:
    for candidate in modelscope_cache_candidates(repo_id):
        found, why = _model_in(candidate, tokenizer_only)
        if found is not None:
            return found
        searched.append(f"{candidate} (ModelScope cache: {why})")
    return None


# ---------------------------------------------------------------------------------------------------
# Download
# ---------------------------------------------------------------------------------------------------

def _download(repo_id: str, revision: str | None, download: bool,
              tokenizer_only: bool = False) -> tuple[str | None, str]:
    """(the downloaded model or None, why nothing was downloaded)."""
    if not download:
        return None, "download=False"
    if _is_offline():
        return None, f"HF_HUB_OFFLINE={os.environ['HF_HUB_OFFLINE']} is set"
    hub = "ModelScope" if use_modelscope() else "the Hugging Face Hub"
    try:
        snapshot = _modelscope_download(repo_id, revision) if use_modelscope() else _hf_download(
            repo_id, revision, tokenizer_only)
    except ImportError as e:
        return None, f"VLLM_USE_MODELSCOPE is set but {e} (pip install modelscope)"
    except Exception as e:  # noqa: BLE001 - any hub failure becomes part of the not-found message
        return None, f"download from {hub} failed: {type(e).__name__}: {e}"
    found, why = _model_in(Path(snapshot), tokenizer_only)
    if found is None:
        return None, f"the snapshot of {repo_id} from {hub} at {snapshot} {why}"
    return found, ""


def _hf_download(repo_id: str, revision: str | None, tokenizer_only: bool = False) -> str:
    import huggingface_hub

    what = "the tokenizer of " if tokenizer_only else ""
    logger.info("Downloading %s%s (revision %s) from the Hugging Face Hub", what, repo_id, revision or "main")
    patterns = TOKENIZER_PATTERNS if tokenizer_only else _weight_patterns(repo_id, revision)
    return huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=patterns)


def _weight_patterns(repo_id: str, revision: str | None) -> list[str]:
    """HF_ALLOW_PATTERNS, with PyTorch .bin weights instead of safetensors for a repo that has none of the latter."""
    import huggingface_hub

    try:
        files = huggingface_hub.list_repo_files(repo_id, revision=revision)
    except Exception:  # noqa: BLE001 - the listing is a hint; snapshot_download reports real failures
        return HF_ALLOW_PATTERNS
    if not any(f.endswith(".safetensors") for f in files) and any(f.endswith(".bin") for f in files):
        logger.info("%s has no safetensors weights: downloading its PyTorch .bin weights", repo_id)
        return TOKENIZER_PATTERNS + [PYTORCH_BIN_PATTERN]
    return HF_ALLOW_PATTERNS


def _modelscope_download(repo_id: str, revision: str | None) -> str:
    try:
        from modelscope import snapshot_download
    except ImportError:
        raise ImportError("the modelscope package is not installed") from None
    logger.info("Downloading %s (revision %s) from ModelScope", repo_id, revision or "master")
    kwargs = {"revision": revision} if revision else {}
    return snapshot_download(repo_id, **kwargs)


def _not_found_message(model: str, revision: str | None, searched: list[str], why: str,
                       tokenizer_only: bool = False) -> str:
    rev = f" (revision {revision})" if revision else ""
    places = "\n".join(f"  - {place}" for place in searched)
    what = "Tokenizer" if tokenizer_only else "Model"
    return f"{what} {model!r}{rev} was not found. Searched:\n{places}\nNot downloaded: {why}."
