"""specdec_core: the model-agnostic speculative decoding engine (drafters, one verifier module, one decode loop)."""

from .batch_decode import BatchDecoder, DecodeRequest, decode
from .decode import DecodeParams, DecodeResult
from .engine import Engine, EngineConfig
from .methods import METHODS, MethodOptions, get_method
from .sampling import SamplingParams

__all__ = [
    "BatchDecoder",
    "DecodeRequest",
    "METHODS",
    "DecodeParams",
    "DecodeResult",
    "Engine",
    "EngineConfig",
    "MethodOptions",
    "SamplingParams",
    "decode",
    "get_method",
]
