"""Our own LLM generator: load a local Llama-family model and generate, chat or stream."""

from generation.llm import LLM
from generation.outputs import RequestOutput
from generation.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
