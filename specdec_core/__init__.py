"""specdec_core: the model-agnostic speculative decoding engine (drafters, one verifier module, one decode loop).

The names below load on first use, so `import specdec_core.errors` (a job's argument check, Ray Data's reading and
tokenizing workers) does not import torch.
"""

from importlib import import_module

_EXPORTS = {
    "BatchDecoder": "loop.batch_decode",
    "DecodeRequest": "loop.batch_decode",
    "DecodeParams": "loop.requests",
    "DecodeResult": "loop.requests",
    "Engine": "engine",
    "EngineConfig": "engine",
    "METHODS": "methods",
    "MethodOptions": "methods",
    "get_method": "methods",
    "SamplingParams": "loop.sampling",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specdec_core' has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
