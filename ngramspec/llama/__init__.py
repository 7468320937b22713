"""ngramspec on llama.cpp (llama-cpp-python): the batched serving engine and its parameters.

Everything here imports ``llama_cpp`` (the ``live`` extra).
"""
from .params import SamplingParams, SpeculationParams
from .scheduler import Chunk, Completion, QueueFull, RequestHandle, Scheduler

__all__ = ["Chunk", "Completion", "QueueFull", "RequestHandle", "SamplingParams", "Scheduler",
           "SpeculationParams"]
