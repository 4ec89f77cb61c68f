"""Session-wide test settings."""

import os
import shutil
import tempfile

import pytest
import torch

from ascendserve.loader.gguf_loader import TOKENIZER_CACHE_ENV_VAR

# the shared helpers' asserts explain their failures as the tests' own do (registered before any test imports them)
pytest.register_assert_rewrite("tests.models.reference", "tests.models.qwen3_5_tiny")

_OWN_CACHE: list[str] = []

# Without a GPU the Triton kernels' tests (tests/layers/test_triton_ops.py) run them under Triton's interpreter. It
# must be on before triton is first imported, which torch.compile may do in any test: triton's own library functions
# take their interpreted form as triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    # Tokenizers built from the tests' GGUF files are cached for this session only (server processes the
    # tests start inherit it), not in the user's ~/.cache, which would gain a directory per temp file.
    if TOKENIZER_CACHE_ENV_VAR not in os.environ:
        _OWN_CACHE.append(tempfile.mkdtemp(prefix="ascendserve-gguf-tokenizers-"))
        os.environ[TOKENIZER_CACHE_ENV_VAR] = _OWN_CACHE[0]


def pytest_unconfigure(config):
    for directory in _OWN_CACHE:
        shutil.rmtree(directory, ignore_errors=True)
