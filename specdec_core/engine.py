"""Engine: a loaded target (and optional draft model) that decodes requests with any registered method.

This is the public entry point that the CLI and the Ray operators share; it returns the engine's part of the output
contract (ids, text, finish reason, every speed metric) per request. `decode_batch` runs many requests through one
continuous-batching loop; `generate_ids` is its one-request case.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import torch

from .defaults import DEFAULT_BATCH_SIZE, DEFAULT_DETERMINISTIC, DEFAULT_MEMORY_TOKENS, DEFAULT_MODEL, determinism_mode
from .drafters.cross_vocab_model import CrossVocabPool
from .drafters.draft_model import DraftModelPool
from .drafters.job_memory import JobMemory, read_outputs
from .drafters.retrieval_index import check_index_tokenizer
from .drafters.vocab_mapping import load_or_build_mapping
from .errors import BadRequestError
from .loop.batch_decode import BatchDecoder, DecodeRequest
from .loop.prefix_cache import PrefixCache
from .loop.requests import DecodeParams, DecodeResult
from .loop.speculation_budget import AcceptanceEstimate, DraftPricing, MeasuredPayoff, SpeculationBudget, StepCostModel
from .methods import MethodOptions, get_method
from .model.hardware import INT8
from .model.model_runner import ModelRunner
from .prompts import build_prompt_ids


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    device: str = "auto"
    drafter: str | None = None  # draft model for `draft` / `copyspec+draft`
    drafter_dtype: str | None = None  # default: default_drafter_dtype (int8 on a bf16 CPU, else the target's)
    # The target's tokens independent of batch and step (ModelRunner.deterministic): "on" (an error where it cannot
    # run), "off", or "auto": on where it costs nothing (ModelRunner.determinism_costs_nothing); True / False: on /
    # off.
    deterministic: str | bool = DEFAULT_DETERMINISTIC
    memory_tokens: int = DEFAULT_MEMORY_TOKENS  # bound of each method's job memory (job_memory.py); 0 = none
    memory_from: str | None = None  # earlier runs' outputs to seed the job memory with (job_memory.read_outputs)
    # What one method learns (prompt prefixes, step costs) serves every method: faster where several methods
    # decode the same prompts (the tests), but a method's figures then depend on what ran before it. Off, each
    # method's pass is timed as if it ran alone: the jobs keep it off, so their reports compare methods fairly.
    share_across_methods: bool = False


@dataclass
class BatchItem:
    """One request of a batch: `key` comes back with its result."""

    key: object
    prompt_ids: list[int]
    params: DecodeParams
    context_ids: list[int] | None = None


def default_drafter_dtype(target: ModelRunner) -> str:
    """int8 weights (computing in bf16) for a drafter of a bf16 target on a CPU: ~40 % cheaper drafter forwards at
    the same drafts (int8_linear.Int8WeightLinear); otherwise the target's dtype (an fp32 CPU's int8 path,
    dynamic quantization, costs acceptance; a GPU runs no int8 kernel here)."""
    if str(target.device).startswith("cpu") and target.dtype == torch.bfloat16:
        return INT8
    return target.dtype_name


class Engine:
    def __init__(self, config: EngineConfig, target: ModelRunner | None = None,
                 draft_model: ModelRunner | None = None):
        """Loads config.model (and config.drafter); `target` / `draft_model` given are used as they are (models
        already in memory: the tests' tiny random ones, a caller's own)."""
        self.config = config
        self.checked_indexes: set[str] = set()  # retrieval indexes whose tokenizer matches the target's
        if config.dtype == INT8:
            raise ValueError("int8 is for drafters only (--drafter-dtype int8): an int8 target would be another model")
        self.target = target or ModelRunner.load(config.model, config.dtype, config.device)
        mode = determinism_mode(config.deterministic)
        if mode == "on" or (mode == "auto" and self.target.determinism_costs_nothing()):
            self.target.deterministic = True  # DeterminismUnavailableError where the fast forward does not run
        self.draft_model = draft_model
        if config.drafter and draft_model is None:
            self.draft_model = ModelRunner.load(
                config.drafter, config.drafter_dtype or default_drafter_dtype(self.target), self.target.device
            )
        # Another tokenizer: only the cross-vocabulary methods (slem) can use it; `draft` refuses it per request.
        self.same_vocabulary = self.draft_model is None or same_vocabulary(self.target, self.draft_model)
        self._vocab_mapping = None
        # What decoding learns carries to the next decoder of the same method (a job's actor builds one per call,
        # the CLI one per prompt), never to another method: each method's figures are those of it running alone.
        # Step costs (the clock's model of a step), keyed by method (None: shared, or a decoder without a method).
        self.step_costs: dict[str | None, StepCostModel] = {}
        # Each method's drafts: acceptance pooled over rows, the clock's verdict on wide steps, drafted tokens' prices.
        self.learned: dict[str, tuple[AcceptanceEstimate, MeasuredPayoff, DraftPricing]] = {}
        # Prompt prefixes' keys and values (prefix_cache.py): one bounded store, each method reading only its own.
        self.prefix_cache = PrefixCache()
        # Job memory, one per method that drafts from it, kept for the engine's life (a job's actor: all its calls).
        self.memories: dict[str, JobMemory] = {}
        self._memory_seed: list[list[int]] | None = None

    def forget(self) -> None:
        """Drop everything decoding learned (step costs, acceptance, prompt prefixes, job memories): the next pass of
        each method starts as in a new process, its kernels compiled (warm_up.py, the benchmarks)."""
        self.step_costs.clear()
        self.learned.clear()
        self.prefix_cache.clear()
        self.memories.clear()

    @classmethod
    def from_runners(cls, target: ModelRunner, draft_model: ModelRunner | None = None,
                     deterministic: str | bool = DEFAULT_DETERMINISTIC) -> "Engine":
        """An engine on models already in memory (the tests' tiny random ones, a caller's own)."""
        config = EngineConfig(model=target.name, dtype=target.dtype_name, device=str(target.device),
                              drafter=draft_model.name if draft_model is not None else None,
                              deterministic=deterministic)
        return cls(config, target, draft_model)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def prompt_ids(self, prompt: str | None = None, messages: list[dict] | None = None, raw: bool = False) -> list[int]:
        return build_prompt_ids(self.tokenizer, prompt=prompt, messages=messages, raw=raw)

    def context_ids(self, context: str) -> list[int]:
        """A request's separate context document in the target's tokens (as the prompt stage tokenizes it)."""
        return self.tokenizer(context, add_special_tokens=False)["input_ids"]

    def decoder(self, batch_size: int = DEFAULT_BATCH_SIZE, token_budget: int | None = None,
                speculation_budget: bool = True,
                row_timeout_s: float | None = None, method: str | None = None,
                prefill_tokens: int | None = None) -> BatchDecoder:
        """A batched decoder on this engine's models; with `method`, its budget starts from what earlier decoders
        of that method learned (and adds to it). prefill_tokens: padded tokens a prefill forward (None: the
        device's default, prefill_plan.default_budget)."""
        learned = {}
        if method is not None:
            learned = dict(zip(("pooled", "payoff", "pricing"), self.learned.setdefault(
                method, (AcceptanceEstimate(), MeasuredPayoff(), DraftPricing()))))
        scope = None if self.config.share_across_methods else method
        cost = self.step_costs.setdefault(scope, StepCostModel())
        budget = SpeculationBudget.for_target(self.target, cost=cost, token_budget=token_budget,
                                              enabled=speculation_budget, **learned)
        memory = self.memory_for(method) if method is not None and get_method(method).uses_job_memory else None
        return BatchDecoder(self.target, max_batch=batch_size, budget=budget, row_timeout_s=row_timeout_s,
                            prefix_cache=self.prefix_cache.scope(scope), draft_pool=self._draft_pool(budget.pricing),
                            job_memory=memory, prefill_tokens=prefill_tokens)

    def _draft_pool(self, pricing: DraftPricing):
        """One draft-model pool per decoder: its drafters' rows step together on the draft model's own cache."""
        if self.draft_model is None:
            return None
        if self.same_vocabulary:
            return DraftModelPool(self.draft_model, pricing)
        return CrossVocabPool(self.draft_model, self.target.tokenizer, self.vocab_mapping(), pricing)

    def memory_for(self, method: str) -> JobMemory:
        """`method`'s job memory, seeded from config.memory_from when first asked for."""
        memory = self.memories.get(method)
        if memory is None:
            memory = self.memories[method] = JobMemory(self.config.memory_tokens)
            if self.config.memory_from:
                if self._memory_seed is None:
                    # (checked by the job before it started: the first night's own --output may not exist yet)
                    self._memory_seed = read_outputs(self.config.memory_from, self.target.tokenizer,
                                                     self.config.model, self.config.memory_tokens, missing_ok=True)
                memory.seed_sequences(self._memory_seed)
        return memory

    def vocab_mapping(self):
        """The drafter's and the target's shared tokens (built once per pair, cached on disk)."""
        if self._vocab_mapping is None:

            self._vocab_mapping = load_or_build_mapping(self.draft_model.tokenizer, self.target.tokenizer,
                                                        self.draft_model.vocab_size, self.target.vocab_size)
        return self._vocab_mapping

    def request(self, item: BatchItem, method: str, options: MethodOptions | None,
                decoder: BatchDecoder) -> DecodeRequest:
        spec = get_method(method)
        options = options or MethodOptions()
        if options.retrieval_index and options.retrieval_index not in self.checked_indexes:
            check_index_tokenizer(options.retrieval_index, self.tokenizer, self.config.model)
            self.checked_indexes.add(options.retrieval_index)
        drafter = spec.build_drafter(options, decoder.draft_pool)
        rule = None if spec.verification is None else replace(  # p(EOS) is the target's
            spec.verification(options), eos_ids=tuple(sorted(self.target.eos_token_ids)))
        return DecodeRequest(item.key, list(item.prompt_ids), item.params, drafter, item.context_ids, rule=rule)

    def decode_batch(
        self,
        items: Iterable[BatchItem],
        method: str = "ar",
        options: MethodOptions | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        token_budget: int | None = None,
        speculation_budget: bool = True,
        prefill_tokens: int | None = None,
    ) -> Iterator[tuple[object, dict]]:
        """Decode every item with `method`, `batch_size` rows at a time; yields (key, result dict) as rows finish.
        A failing row yields a dict with only `method` and `error` set (the others go on)."""
        decoder = self.decoder(batch_size, token_budget, speculation_budget, method=method,
                               prefill_tokens=prefill_tokens)
        for item in items:
            decoder.submit(self.request(item, method, options, decoder))
        yield from self.results(decoder, method)

    def results(self, decoder: BatchDecoder, method: str) -> Iterator[tuple[object, dict]]:
        """Run a decoder whose requests were submitted; (key, result dict) as rows finish. Requests submitted while
        iterating (a conversation's next turn) join the running batch."""
        for request, result in decoder.run():
            yield request.key, self.result_dict(method, request.params, result)

    def result_dict(self, method: str, params: DecodeParams, result: DecodeResult | str) -> dict:
        if isinstance(result, str):
            return {"method": method, "error": result}
        spec = get_method(method)
        sampling = params.sampling
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
            "error": None,
            **result.metrics.as_dict(),
        }

    def generate_ids(
        self,
        prompt_ids: list[int],
        method: str = "ar",
        params: DecodeParams | None = None,
        options: MethodOptions | None = None,
        context_ids: list[int] | None = None,
    ) -> dict:
        """One request (B = 1). A request that cannot be decoded raises BadRequestError with the reason."""
        item = BatchItem(0, list(prompt_ids), params or DecodeParams(), context_ids)
        [(_, result)] = list(self.decode_batch([item], method, options, batch_size=1))
        if result["error"]:
            raise BadRequestError(result["error"].split(": ", 1)[-1])
        return result

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


def same_vocabulary(target: ModelRunner, draft: ModelRunner) -> bool:
    """Identical token ids: the drafter's tokens can be verified as the target's as they are."""
    return target.tokenizer.get_vocab() == draft.tokenizer.get_vocab()
