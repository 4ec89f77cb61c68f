"""ascendserve: an LLM inference engine and OpenAI-compatible server for Qwen3.5 (and friends)."""

from ascendserve.engine.beam_search import BeamSearchParams
from ascendserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from ascendserve.engine.sampling_params import SamplingParams
from ascendserve.version import __version__


def __getattr__(name):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from ascendserve.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
