"""EngineMetrics and the stats it exports, without a model: vLLM's series, labels, HELP texts and log line."""

from prometheus_client import generate_latest

from ascendserve.metrics import EngineMetrics, IterationStats, PrefixCachingMetrics, RequestStateStats, SchedulerStats


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


def sample(metrics: EngineMetrics, name: str) -> float:
    """One sample of engine 0's series (0.0 while absent)."""
    return metrics.registry.get_sample_value(name, {"model_name": "m", "engine": "0"}) or 0.0


def test_a_sequences_phases_as_vllm_measures_them():
    """Arrives at 100, first scheduled at 101, tokens at 101.5, 102 and 103.5: queue 1, prefill 0.5 (scheduled -> first
    token), decode 2 (first -> last token), inference 2.5 (scheduled -> last token), 1 s per output token after the
    first; TTFT 1.5 and inter-token latencies 0.5 and 1.5."""
    it = IterationStats()
    req = RequestStateStats(arrival_time=100.0)
    for now in (101.5, 102.0, 103.5):
        it.update_from_output(req, 1, 7, now)
    it.update_from_finished_request(req, "length", 7, 3, first_scheduled_time=101.0, now=103.5)
    f = it.finished[0]
    assert (f.e2e_latency, f.queue_time, f.prefill_time, f.decode_time, f.inference_time,
            f.mean_time_per_output_token) == (3.5, 1.0, 0.5, 2.0, 2.5, 1.0)
    assert (f.num_prompt_tokens, f.num_generation_tokens, f.max_tokens_param) == (7, 3, 3)
    assert (it.num_prompt_tokens, it.num_generation_tokens) == (7, 3)
    assert (it.time_to_first_tokens, it.inter_token_latencies) == ([1.5], [0.5, 1.5])


def test_a_sequence_aborted_before_it_ran_only_queued():
    it = IterationStats()
    it.update_from_finished_request(RequestStateStats(arrival_time=10.0), "abort", 5, 16, None, now=12.0)
    f = it.finished[0]
    assert (f.e2e_latency, f.queue_time, f.prefill_time, f.decode_time, f.inference_time,
            f.mean_time_per_output_token) == (2.0, 2.0, 0.0, 0.0, 0.0, 0.0)


def test_record_exports_vllms_request_and_step_histograms():
    metrics = EngineMetrics("m", 2048)
    it = IterationStats(num_prompt_tokens=7, num_generation_tokens=3, inter_token_latencies=[0.5, 1.5],
                        engine_step=True)
    req = RequestStateStats(arrival_time=100.0, num_generation_tokens=3, first_token_time=101.5, last_token_time=103.5)
    it.update_from_finished_request(req, "length", 7, 16, first_scheduled_time=101.0, now=103.5)
    it.update_from_finished_parent(n=2, max_num_generation_tokens=3)
    metrics.record(SchedulerStats(), it)
    metrics.record(SchedulerStats(), IterationStats())  # an idle publish: no step, no iteration_tokens sample
    assert {name: sample(metrics, name) for name in [
        "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
        "vllm:request_inference_time_seconds_sum", "vllm:request_time_per_output_token_seconds_sum",
        "vllm:time_per_output_token_seconds_count", "vllm:time_per_output_token_seconds_sum",
        "vllm:request_params_n_sum", "vllm:request_max_num_generation_tokens_sum", "vllm:request_params_max_tokens_sum",
        "vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total_sum"]} == {
        "vllm:request_prefill_time_seconds_sum": 0.5, "vllm:request_decode_time_seconds_sum": 2.0,
        "vllm:request_inference_time_seconds_sum": 2.5, "vllm:request_time_per_output_token_seconds_sum": 1.0,
        "vllm:time_per_output_token_seconds_count": 2, "vllm:time_per_output_token_seconds_sum": 2.0,
        "vllm:request_params_n_sum": 2, "vllm:request_max_num_generation_tokens_sum": 3,
        "vllm:request_params_max_tokens_sum": 16, "vllm:iteration_tokens_total_count": 1,
        "vllm:iteration_tokens_total_sum": 10}
    helps = help_texts(render(metrics))
    assert helps["vllm:request_time_per_output_token_seconds"] == \
        "Histogram of time_per_output_token_seconds per request."
    assert helps["vllm:iteration_tokens_total"] == "Histogram of number of tokens per engine_step."


def test_cache_config_info_is_a_gauge_at_1_labelled_with_the_settings():
    metrics = EngineMetrics("m", 2048)
    metrics.log_engine_initialized({"block_size": "16", "num_gpu_blocks": "2048", "enable_prefix_caching": "True",
                                    "cache_dtype": "auto", "gpu_memory_utilization": "0.9"})
    labels = {"block_size": "16", "num_gpu_blocks": "2048", "enable_prefix_caching": "True", "cache_dtype": "auto",
              "gpu_memory_utilization": "0.9", "engine": "0"}
    assert metrics.registry.get_sample_value("vllm:cache_config_info", labels) == 1.0
    assert help_texts(render(metrics))["vllm:cache_config_info"] == "Information of the LLMEngine CacheConfig"


def test_log_line_hit_rate_is_over_recent_requests_not_the_interval():
    """vLLM's line shows the hit rate of the recent requests: an interval that only decodes (no lookup) keeps it,
    where the per-interval rate dropped to 0% between bursts."""
    metrics = EngineMetrics("m", 2048)
    burst = SchedulerStats(num_running=2, prefix_cache_requests=2, prefix_cache_queries=100, prefix_cache_hits=40)
    metrics.record(burst, IterationStats(num_prompt_tokens=100, engine_step=True))
    assert "Prefix cache hit rate: 40.0%" in metrics.log()
    metrics.record(burst, IterationStats(num_generation_tokens=2, engine_step=True))  # decode only: no new lookup
    assert "Prefix cache hit rate: 40.0%" in metrics.log()
    metrics.record(SchedulerStats(num_running=1, prefix_cache_requests=3, prefix_cache_queries=200,
                                  prefix_cache_hits=40), IterationStats(num_prompt_tokens=100, engine_step=True))
    assert "Prefix cache hit rate: 20.0%" in metrics.log()  # 40 of the 200 tokens the 3 requests looked up


def test_hit_rate_window_holds_the_last_1000_requests():
    window = PrefixCachingMetrics(max_recent_requests=1000)
    assert window.hit_rate == 0.0
    window.observe(600, 6000, 6000)  # all hits
    window.observe(300, 3000, 0)
    assert window.hit_rate == 6000 / 9000
    window.observe(200, 2000, 0)  # 1100 requests: the oldest batch (600) drops out
    assert window.hit_rate == 0.0
    window.observe(0, 0, 0)  # a step without lookups changes nothing
    window.observe(5000, 100, 50)  # a batch larger than the window stays, alone
    assert window.hit_rate == 0.5
