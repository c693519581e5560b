"""Structured outputs: constrain generation to a JSON schema, regex, choice list or grammar
(llguidance computes the per-step token bitmask; `ferrum.layers.sampler` applies it)."""
from ferrum.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
