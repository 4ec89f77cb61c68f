"""The CPU platform's malloc settings: large blocks freed on the model thread are reused, not faulted in again."""

import json
import os
import subprocess
import sys

import pytest

# Runs in a fresh process (malloc settings and thread arenas are per process): builds a real engine on a
# tiny saved model, then on the engine's model thread fills a 64 MiB tensor twice and reports the minor
# page faults of the second fill (RUSAGE_THREAD: that thread only).
_SCRIPT = r"""
import json, resource, sys
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from ascendserve import LLM

config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, architectures=["LlamaForCausalLM"])
AutoModelForCausalLM.from_config(config).save_pretrained(sys.argv[1])
llm = LLM(sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=64)

def faults_of_second_fill():
    torch.empty(16 << 20).fill_(1.0)  # 64 MiB, freed at once
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    torch.empty(16 << 20).fill_(2.0)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

print(json.dumps(llm.llm_engine._model_thread.submit(faults_of_second_fill).result()))
"""


def _second_fill_faults(tmp_path, **env) -> tuple[int, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    environ.update(env)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "model")], env=environ,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc and RUSAGE_THREAD are Linux's")
def test_model_thread_reuses_large_freed_blocks(tmp_path):
    faults, log = _second_fill_faults(tmp_path)
    assert "malloc keeps freed blocks" in log
    # 64 MiB is 16384 pages of 4 KiB: all faulted in again without the setting, none with it.
    assert faults < 1000, faults
    faults, log = _second_fill_faults(tmp_path, ASCENDSERVE_CPU_MALLOC="0")
    assert "malloc settings left as they are (ASCENDSERVE_CPU_MALLOC=0)" in log
    assert faults > 8000, faults


def test_users_own_malloc_settings_win(tmp_path):
    _, log = _second_fill_faults(tmp_path, MALLOC_ARENA_MAX="4")
    assert "malloc settings left as they are (MALLOC_ARENA_MAX is set)" in log
