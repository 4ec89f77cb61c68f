"""PNG charts of `bench serve` results (matplotlib, headless Agg backend)."""


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_sweep(results: list[dict], path: str) -> str:
    """Output throughput, and mean TTFT / TPOT, against max concurrency (one point per result)."""
    plt = _pyplot()
    results = sorted(results, key=lambda r: r["max_concurrency"] or 0)
    levels = [r["max_concurrency"] or r["num_prompts"] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(levels, [r["output_throughput"] for r in results], "o-")
    left.set(xscale="log", xlabel="max concurrency", ylabel="output tok/s", title="Output token throughput")
    right.plot(levels, [r["mean_ttft_ms"] for r in results], "o-", label="mean TTFT")
    right.plot(levels, [r["mean_tpot_ms"] for r in results], "s-", label="mean TPOT")
    right.set(xscale="log", yscale="log", xlabel="max concurrency", ylabel="ms", title="Latency")
    right.legend()
    for ax in (left, right):
        ax.set_xticks(levels, [str(v) for v in levels])
        ax.tick_params(axis="x", which="minor", labelbottom=False)
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{results[0]['model_id']} ({results[0]['backend']})")
    return _save(fig, plt, path)


def plot_requests(result: dict, path: str) -> str:
    """Per request: TTFT and end-to-end latency (ms) against its start time in the run."""
    plt = _pyplot()
    starts = result["start_times"]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.scatter(starts, [t * 1000 for t in result["ttfts"]], label="TTFT", marker="o")
    ax.scatter(starts, [t * 1000 for t in result["e2els"]], label="E2E latency", marker="s")
    ax.set(xlabel="request start (s into the run)", ylabel="ms",
           title=f"{result['model_id']}: {result['completed']} requests, concurrency {result['max_concurrency']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, plt, path)


def _save(fig, plt, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
