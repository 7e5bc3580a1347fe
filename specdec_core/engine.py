"""Engine: a loaded target (and optional draft model) that decodes requests with any registered method.

This is the public entry point that the CLI and the Ray operators share; it returns the engine's part of the output
contract (ids, text, finish reason, every speed metric) for one request.
"""

from __future__ import annotations

from dataclasses import dataclass

from .decode import DecodeParams, decode
from .methods import MethodOptions, get_method
from .model_runner import ModelRunner
from .prompts import build_prompt_ids
from .sampling import SamplingParams


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"
    dtype: str = "auto"
    device: str = "auto"
    drafter: str | None = None  # draft model for `draft` / `copyspec+draft`
    drafter_dtype: str | None = None  # default: the target's dtype


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.target = ModelRunner.load(config.model, config.dtype, config.device)
        self.draft_model = None
        if config.drafter:
            self.draft_model = ModelRunner.load(
                config.drafter, config.drafter_dtype or self.target.dtype_name, self.target.device
            )

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def prompt_ids(self, prompt: str | None = None, messages: list[dict] | None = None, raw: bool = False) -> list[int]:
        return build_prompt_ids(self.tokenizer, prompt=prompt, messages=messages, raw=raw)

    def generate_ids(
        self,
        prompt_ids: list[int],
        method: str = "ar",
        params: DecodeParams | None = None,
        options: MethodOptions | None = None,
        context_ids: list[int] | None = None,
    ) -> dict:
        spec = get_method(method)
        drafter = spec.build_drafter(options or MethodOptions(), self.draft_model)
        params = params or DecodeParams()
        result = decode(self.target, drafter, prompt_ids, params, context_ids)
        sampling: SamplingParams = params.sampling
        return {
            "method": method,
            "model": self.config.model,
            "drafter": self.config.drafter if spec.needs_draft_model else None,
            "dtype": self.target.dtype_name,
            "device": self.target.device,
            "temperature": sampling.temperature,
            "seed": sampling.seed,
            "output_text": result.text,
            "output_token_ids": result.token_ids,
            "finish_reason": result.finish_reason,
            "lossy": not spec.lossless,
            **result.metrics.as_dict(),
        }

    def generate(
        self,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        method: str = "ar",
        params: DecodeParams | None = None,
        options: MethodOptions | None = None,
        raw: bool = False,
    ) -> dict:
        return self.generate_ids(self.prompt_ids(prompt, messages, raw), method, params, options)
