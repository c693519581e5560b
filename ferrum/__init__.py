"""ferrum: a readable LLM inference engine on PyTorch.

    from ferrum import LLM, SamplingParams
    llm = LLM("smollm2")
    print(llm.generate(["The capital of France is"], SamplingParams(temperature=0))[0].outputs[0].text)
"""
from ferrum.outputs import Logprob
from ferrum.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "Logprob", "SamplingParams"]


def __getattr__(name):  # LLM pulls in the whole engine; import it on first use
    if name == "LLM":
        from ferrum.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)
