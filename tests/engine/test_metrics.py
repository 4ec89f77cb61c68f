"""EngineMetrics and the stats it exports, without a model: vLLM's series, labels, HELP texts and log line."""

from prometheus_client import generate_latest

from ascendserve.metrics import EngineMetrics


def render(metrics: EngineMetrics) -> str:
    """What /metrics serves."""
    return generate_latest(metrics.registry).decode()


def help_texts(text: str) -> dict[str, str]:
    """{metric name: HELP text} of an exposition (a counter's name with its _total, as served)."""
    return dict(line[len("# HELP "):].split(" ", 1) for line in text.splitlines() if line.startswith("# HELP "))


def test_every_vllm_series_has_model_name_and_engine_labels():
    samples = [line for line in render(EngineMetrics("m", 2048)).splitlines() if line.startswith("vllm:")]
    assert samples
    assert [s for s in samples if 'model_name="m"' not in s or 'engine="0"' not in s] == []


def test_help_texts_are_vllms():
    helps = help_texts(render(EngineMetrics("m", 2048)))
    assert helps["vllm:num_preemptions_total"] == "Cumulative number of preemption from the engine."
    assert helps["vllm:prefix_cache_queries_total"] == "Prefix cache queries, in terms of number of queried tokens."
    assert helps["vllm:prefix_cache_hits_total"] == "Prefix cache hits, in terms of number of cached tokens."
    assert helps["vllm:kv_cache_usage_perc"] == "KV-cache usage. 1 means 100 percent usage."
    assert helps["vllm:request_success_total"] == "Count of successfully processed requests."


def test_each_registry_has_the_process_and_python_collectors():
    """vLLM serves prometheus_client's global registry, which has process_* and python_* series; each engine's own
    registry gets them too, and two engines in one process still do not clash."""
    first, second = EngineMetrics("a", 2048), EngineMetrics("b", 2048)
    for metrics in (first, second):
        text = render(metrics)
        for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "python_info",
                     "python_gc_objects_collected_total"):
            assert f"\n{name}" in text, name
