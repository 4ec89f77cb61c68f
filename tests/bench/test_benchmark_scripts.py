"""The benchmark scripts in benchmarks/: the names they use exist, and their own arguments are checked.

compare_cpu.py is run by hand for an hour at a time, so a helper dropped from peers.py (as happened
once to `libiomp5` and `_guard_torchvision`) only surfaced as an AttributeError at the vLLM
configuration of the next run. This catches it at test time without starting any engine.
"""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


@pytest.mark.parametrize("script", ["compare_cpu", "compare_models", "compare_report", "inprocess_refs"])
def test_compare_cpu_uses_only_names_peers_defines(script):
    peers = _module("peers")
    tree = ast.parse((BENCHMARKS / f"{script}.py").read_text())
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "peers"}
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "peers"
                for alias in node.names}
    assert used or imported
    assert sorted(name for name in used | imported if not hasattr(peers, name)) == []


def test_compare_cpu_imports_only_names_its_modules_define():
    """compare_cpu.py's `from compare_models / compare_report import ...` names exist there."""
    tree = ast.parse((BENCHMARKS / "compare_cpu.py").read_text())
    imports = [(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and node.module in ("compare_models", "compare_report") for alias in node.names]
    assert {module for module, _ in imports} == {"compare_models", "compare_report"}
    assert [(m, name) for m, name in imports if not hasattr(_module(m), name)] == []



def test_ascendserve_args_set_environment_levels_and_weight_bytes(tmp_path, monkeypatch):
    compare_cpu = _module("compare_cpu")
    from ascendserve.platforms import cpu
    monkeypatch.setattr(cpu, "bf16_by_default", lambda: False)  # a CPU where auto is fp32 (Zen 4: no AMX)
    (tmp_path / "config.json").write_text('{"text_config": {"dtype": "bfloat16"}}')
    model = compare_cpu.Model("m", "title", tmp_path, tmp_path)
    ns = compare_cpu.parse_args(["--threads", "2"])
    default = compare_cpu._ascendserve(ns, model, 1000, 448, "")
    # A bf16 checkpoint runs in fp32 from bf16 weights: 2 bytes a weight for the roofline.
    assert default.weights == "bf16 weights, fp32 compute" and default.decode_bytes == 2000
    assert default.spec(1234, 1).env == {"OMP_NUM_THREADS": "2"}
    fp32 = compare_cpu._ascendserve(ns, model, 1000, 448, "C=1,8:ASCENDSERVE_COMPACT_WEIGHTS=0 --max-num-seqs 8")
    spec = fp32.spec(1234, 8)
    assert fp32.levels == [1, 8] and fp32.weights == "float32" and fp32.decode_bytes == 4000
    assert spec.env == {"OMP_NUM_THREADS": "2", "ASCENDSERVE_COMPACT_WEIGHTS": "0"}
    assert "--max-num-seqs" in spec.argv and "ASCENDSERVE_COMPACT_WEIGHTS=0" not in spec.argv
    bf16 = compare_cpu._ascendserve(ns, model, 1000, 448, "--dtype bfloat16")  # bf16 panels: 2 bytes a weight
    assert bf16.weights == "bfloat16" and bf16.decode_bytes == 2000
    monkeypatch.setattr(cpu, "bf16_by_default", lambda: True)  # with AMX or on Zen 5, auto is bf16
    assert compare_cpu._ascendserve(ns, model, 1000, 448, "").weights == "bfloat16"


@pytest.mark.parametrize("value", ["C=1,8--quantization int4", "C=x:--dtype float32", "C=:", "C=1,,8:", "C=0:"])
def test_a_mistyped_level_prefix_is_a_usage_error(value, capsys):
    compare_cpu = _module("compare_cpu")
    with pytest.raises(SystemExit) as exit_info:
        compare_cpu.parse_args(["--ascendserve-args", value])
    assert exit_info.value.code == 2
    assert "a level prefix is 'C='" in capsys.readouterr().err


def test_a_level_prefix_and_plain_flags_parse():
    compare_cpu = _module("compare_cpu")
    ns = compare_cpu.parse_args(["--ascendserve-args", "C=1,16:--quantization int4", "--ascendserve-args", ""])
    assert ns.ascendserve_args == ["C=1,16:--quantization int4", ""]


def test_a_q4_gguf_counts_its_grid_for_the_roofline(tmp_path, monkeypatch):
    # ascendserve keeps Q4_0 / Q4_1 layers as their 4-bit grid (0.5 byte + fp32 d and m per 32 inputs) and
    # Q8_0 ones (the tied embedding as lm_head) as their 8-bit grid (1 byte + fp32 d per 32) for one
    # stream; everything else is read as fp32.
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf import quants
    compare_cpu = _module("compare_cpu")
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    layer, embed = rng.standard_normal((64, 128)).astype(np.float32), rng.standard_normal((96, 128)).astype(np.float32)
    for name, values, qtype in (("blk.0.ffn_up.weight", layer, Q.Q4_1), ("token_embd.weight", embed, Q.Q8_0)):
        data = quants.quantize(values, qtype)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(128, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected = 64 * 128 * 0.75 + 96 * 128 * 1.125 + 128 * 4
    assert compare_cpu.gguf_grid_decode_bytes(path) == int(expected)
    model = compare_cpu.Model("m", "title", tmp_path, path)
    ns = compare_cpu.parse_args(["--threads", "2"])
    from ascendserve.platforms import cpu
    monkeypatch.setattr(cpu, "bf16_by_default", lambda: False)  # a CPU where auto is fp32 (Zen 4: no AMX)
    config = compare_cpu._ascendserve(ns, model, 1000, 448, "")
    assert config.weights == "4/8-bit grids (Q4 / Q8_0), fp32 rest" and config.decode_bytes == int(expected)
    fp32 = compare_cpu._ascendserve(ns, model, 1000, 448, "ASCENDSERVE_COMPACT_WEIGHTS=0")
    assert fp32.weights == "float32" and fp32.decode_bytes == 4000
    # with AMX / on Zen 5 a quantized GGUF (half precision by its file type) runs in bf16, the grids dequantized to
    # bf16 panels
    monkeypatch.setattr(cpu, "bf16_by_default", lambda: True)
    assert compare_cpu._ascendserve(ns, model, 1000, 448, "").weights == "bfloat16"
    bf16 = compare_cpu._ascendserve(ns, model, 1000, 448, "--dtype bfloat16")  # the grids dequantized to bf16
    assert bf16.weights == "bfloat16" and bf16.decode_bytes == 2000


def _summary(tok_s: float, ttft: float) -> dict:
    return {"output_throughput": tok_s, "median_ttft_ms": ttft, "median_tpot_ms": 100.0}


def test_rounds_keep_the_median_run_and_the_ratio_of_each_round():
    compare_cpu, report = _module("compare_cpu"), _module("compare_report")
    ours = [{"engine": "ascendserve", "servers": [{"command": f"a{i}"}], "wall_s": 10, "weights": "float32",
             "decode_bytes": 1, "levels": {64: _summary(tok, 100 + i)}} for i, tok in enumerate((150, 200, 180))]
    theirs = [{"engine": "vllm", "servers": [{"command": f"v{i}"}], "wall_s": 20, "weights": "float32",
               "decode_bytes": 1, "levels": {64: _summary(tok, 200 + i)}} for i, tok in enumerate((150, 140, 160))]
    theirs[2]["levels"][64] = {"error": "server died"}
    merged = {"ascendserve": report.merge_rounds(ours), "vllm float32": report.merge_rounds(theirs)}
    # The median run (180 tok/s, round 3) is kept whole, TTFT included; every round's figure is listed.
    assert merged["ascendserve"]["levels"][64]["median_ttft_ms"] == 102
    assert merged["ascendserve"]["levels"][64]["rounds"] == [150, 200, 180]
    assert len(merged["ascendserve"]["servers"]) == 3 and merged["ascendserve"]["wall_s"] == 30
    # Two good runs of three: the lower of the middle two; the failed round counts as None.
    assert merged["vllm float32"]["levels"][64]["output_throughput"] == 140
    assert merged["vllm float32"]["levels"][64]["rounds"] == [150, 140, None]
    # Ratios only from rounds where both ran: 150/150, 200/140.
    assert report.round_ratios(merged, 64) == pytest.approx([1.0, 200 / 140])
    ns = compare_cpu.parse_args(["--threads", "2", "--engines", "ascendserve,vllm", "--concurrency", "64",
                                 "--rounds", "3"])
    table = "\n".join(report.model_tables(ns, {"title": "demo", "configs": merged, "notes": []}, 20.0))
    assert "1.21x (vllm float32; rounds 1.00, 1.43)" in table  # the median of the two per-round ratios
    assert "180.0 / 102 / 100.0 (rounds 150.0, 200.0, 180.0)" in table


def test_sampling_flags_reach_every_engines_client_and_the_report(tmp_path):
    """--temperature / --top-p / --top-k go into each level's `bench serve` command, and the report says so;
    without them the requests are greedy and top_p / top_k are not sent."""
    compare_cpu, report = _module("compare_cpu"), _module("compare_report")
    model = compare_cpu.Model("m", "title", tmp_path, tmp_path)
    spec = compare_cpu.ServerSpec(["srv"], "m", {})

    def command(*flags):
        ns = compare_cpu.parse_args(["--threads", "2", *flags])
        argv = compare_cpu.bench_command(ns, model, spec, "http://x", 8, 8, tmp_path, ["--ignore-eos"])
        return ns, argv

    ns, argv = command()
    assert argv[argv.index("--temperature") + 1] == "0.0"
    assert "--top-p" not in argv and "--top-k" not in argv
    assert report.sampling_text(ns) == "temperature 0"
    ns, argv = command("--temperature", "0.7", "--top-p", "0.8", "--top-k", "20")
    assert argv[argv.index("--temperature") + 1] == "0.7"
    assert argv[argv.index("--top-p") + 1] == "0.8" and argv[argv.index("--top-k") + 1] == "20"
    assert report.sampling_text(ns) == "temperature 0.7 top_p 0.8 top_k 20"
    for no_limit in (0, -1):  # vLLM's, SamplingParams' and llama.cpp's "every token"
        assert compare_cpu.parse_args(["--top-k", str(no_limit)]).top_k == no_limit
    for flags, message in ((["--temperature", "-1"], "--temperature must be >= 0"),
                           (["--temperature", "nan"], "--temperature must be >= 0 and finite"),
                           (["--temperature", "inf"], "--temperature must be >= 0 and finite"),
                           (["--top-p", "0"], r"--top-p must be in \(0, 1\]"),
                           (["--top-k", "-2"], "--top-k must be >= 1, or 0 / -1")):
        with pytest.raises(SystemExit, match=message):
            compare_cpu.parse_args(flags)


def test_a_failed_configuration_merges_to_its_error():
    compare_cpu, report = _module("compare_cpu"), _module("compare_report")
    runs = [{"engine": "vllm", "servers": [], "levels": {8: {"error": f"boom {i}"}}} for i in range(2)]
    merged = report.merge_rounds(runs)
    assert merged["levels"][8]["error"] == "boom 1" and merged["levels"][8]["rounds"] == [None, None]
    with pytest.raises(SystemExit, match="--rounds must be >= 1"):
        compare_cpu.parse_args(["--rounds", "0"])


def test_in_process_references_share_one_set_of_prompts_of_exact_length():
    refs = _module("inprocess_refs")
    ast.parse(refs.RUNNER)  # the code each engine's interpreter runs
    batches = refs.prompt_batches([1, 8], 256, 49152, seed=3)
    assert sorted(batches) == [1, 8] and [len(batches[8]), len(batches[1])] == [8, 1]
    assert all(len(p) == 256 and all(100 <= t < 49152 - 100 for t in p) for b in batches.values() for p in b)
    assert batches == refs.prompt_batches([1, 8], 256, 49152, seed=3)


def test_an_older_qwen35_directory_gets_the_fp32_state_declared(tmp_path, monkeypatch):
    # Runs up to 88 built the shape without mamba_ssm_dtype, so vLLM kept its recurrent state in bf16 (its "auto")
    # while the real checkpoints, and ascendserve, keep fp32.
    import json
    models = _module("compare_models")
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports qwen3_5_speed when called, as compare_cpu.py runs it
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text", "hidden_size": 1024}))
    models._declare_state_dtype(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config == {"model_type": "qwen3_5_text", "hidden_size": 1024, "mamba_ssm_dtype": "float32"}
    assert _module("qwen3_5_speed").QWEN3_5_08B["mamba_ssm_dtype"] == "float32"


@pytest.mark.parametrize("script", sorted(p.name for p in (Path(__file__).parents[2] / "benchmarks").glob("*.sh")))
def test_shell_scripts_parse(script):
    """The benchmark shell scripts run rarely (on a lent GPU, or a regression check): at least they parse."""
    path = Path(__file__).parents[2] / "benchmarks" / script
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True).returncode == 0


def test_the_replay_splits_prefill_and_decode_steps_and_profiles_both(tmp_path, monkeypatch, capsys):
    """benchmarks/replay_served_workload.py on a tiny Llama: 3 prompts of 40 tokens under a 64-token budget take two
    prefill steps (40 + 24, then 16 + 40 with one decode row); the last two prompts' 2nd to 4th tokens take three
    decode steps more. Each kind's profile is printed."""
    from tests.models.llama_tiny import build_llama

    path, _, _ = build_llama(tmp_path / "llama")
    replay = _module("replay_served_workload")
    monkeypatch.setattr(sys, "argv", ["replay", path, "--num-prompts", "3", "--input-len", "40", "--output-len", "4",
                                      "--max-num-batched-tokens", "64", "--kv-cache-gib", "0.05",
                                      "--profile-steps", "1"])
    replay.main()
    out = capsys.readouterr().out
    assert "3 x 40 in / 4 out" in out and "whole run" in out
    counts = {line.split()[0]: int(line.split()[2]) for line in out.splitlines()
              if line.startswith(("  prefill ", "  decode "))}
    assert counts == {"prefill": 2, "decode": 3}, out
    assert "prefill steps (up to 1)" in out and "decode steps (up to 1)" in out
    assert out.count("Self CPU time total") == 2, out
