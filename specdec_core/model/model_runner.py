"""The one wrapper every decoder drives a model through (the target and a draft model alike): loading (dtype,
device, CPU tuning, the architecture check), the forward over the engine's slot cache (`forward_slots`: prefill,
decode, chain and tree verification) and the LM head.

Beside it: hardware.py resolves `auto` device and dtype, int8_linear.py quantizes a drafter, lm_head.py reads a head
in parts, attention_masks.py builds a slot forward's masks.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import SpecbatchError
from ..kernels import (bf16_attention, bf16_dot, bf16_step_attention, chain_plan, fp32_chain_attention, step_plan,
                       invariant_attention, kernel_plan, linear_plan, packed_linear, panel_linear)
from ..kernels.kernel_plan import KernelPlan
from . import block_attention, fast_forward, grouped_attention
from .attention_masks import attention_masks
from .attention_probe import capture_queries
from .fast_forward import MODEL_TYPES, FastForward
from .graph_step import GraphStep, step_mode
from .hardware import INT8, resolve_device, resolve_dtype
from .int8_linear import quantize_int8
from .lm_head import SubsetHead, head_weight
from .model_registry import resolve_model_path
from .ragged_tokens import MAX_REAL_SHARE, RaggedTokens
from .step_batch import AttentionPlan, StepBatch

if TYPE_CHECKING:
    from ..loop.kv_cache import SlotKVCache

log = logging.getLogger(__name__)

# "0" keeps HF's modules on a GPU. The fast forward is the default there: on an H100 its decode step took less time
# than HF's modules over the same cache (decisions.md: specdec_core/model/model_runner.py).
GPU_FAST_FORWARD_ENV = "SPECBATCH_GPU_FAST_FORWARD"
PICK_RUNS = 2  # forwards of the first masked prefill with each attention under `auto`: a warm-up, then timed


def gpu_fast_forward() -> bool:
    return os.environ.get(GPU_FAST_FORWARD_ENV, "1") != "0"


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [num_logits, vocab] float32: next-token logits after each of the last num_logits inputs
    hidden: torch.Tensor | None = None  # [num_inputs, hidden] of the requested layer, if asked for


class ModelRunner:
    """One loaded model. Caches are separate objects, so one runner serves many sequences."""

    def __init__(self, model, tokenizer, name: str, device: str, dtype: torch.dtype, quantized: bool = False,
                 fast_forward: bool | None = None, plan: KernelPlan | None = None):
        """plan: the machine's kernel plan for the model's linears (kernel_plan.py); None keeps their modules'."""
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.device = device
        self.dtype = dtype  # of activations and the KV cache (fp32 when the weights are int8)
        self.quantized = quantized
        config = model.config
        head = model.get_output_embeddings()  # (an int8 head's rows are read off it, not dequantized)
        self.vocab_size = int(getattr(head, "out_features", 0) or head_weight(head).shape[0])
        self.max_positions = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        # CPU only: on a GPU the padded tokens of a short step are almost free and every gather is a kernel launch.
        on_cpu = str(device).startswith("cpu")
        layers = getattr(getattr(model, model.base_model_prefix, model), "layers", None)
        ragged = RaggedTokens(layers) if on_cpu and layers is not None else None
        self.ragged = ragged if ragged is not None and ragged.hooked else None
        self.grouped_attention = on_cpu and _sdpa_family(config)
        if fast_forward is None:  # the device's default: on a CPU always; on a GPU see GPU_FAST_FORWARD_ENV
            fast_forward = on_cpu or gpu_fast_forward()
        self.kernel_plan = plan
        self._deterministic = False
        self.fast = FastForward.build(model, self._routes()) if fast_forward and _sdpa_family(config) else None
        self.graph_mode = step_mode(device)  # of the graph-ready decode and verify step (graph_step.py)
        self.gpu_attention = block_attention.attention_mode()  # auto, sdpa, flex or split (block_attention.py)
        self._graph_step: GraphStep | None = None
        self.prefill_attention: str | None = None  # under auto: sdpa or flex, as timed at the first masked prefill
        self.prefill_attention_ms: dict[str, float] = {}  # what each took that prefill's forward
        self.attention_pick_s = 0.0  # seconds spent timing them, apart from the prefill

    @property
    def deterministic(self) -> bool:
        """Whether every forward attends through invariant_attention.py: a token's numbers are then the same in any
        forward (any batch, query count or prefill chunk), so lossless methods equal `ar` bit for bit in bf16 too."""
        return self._deterministic

    @deterministic.setter
    def deterministic(self, on: bool) -> None:
        if on and self.fast is not None and invariant_attention.kernel() is None:
            raise DeterminismUnavailableError(
                f"--deterministic needs numba's compiled attention: {invariant_attention.kernel.unavailable}")
        if on and (self.fast is None or self.dtype not in panel_linear.DTYPES or self.device != "cpu"):
            raise DeterminismUnavailableError(
                f"--deterministic runs on a CPU with Llama-family models ({', '.join(MODEL_TYPES)}) in fp32 or bf16; "
                f"{self.name} ({self.model.config.model_type}, {self.device}, {self.dtype_name}) is not covered")
        if on and self.dtype == torch.bfloat16:
            # oneDNN's bf16 linears are not row-invariant (a row of SmolLM2's down projection, [M, 1536] x
            # [1536, 576], changes from M = 14 rows on an avx512_bf16 CPU): the panel kernel's are, by construction.
            if not panel_linear.available(torch.bfloat16):
                why = panel_linear.kernels[self.dtype].unavailable or f"{panel_linear.DISABLE_ENV}=0 switches it off"
                raise DeterminismUnavailableError(f"--deterministic in bf16 needs numba's panel kernel: {why}")
            if tune_for_cpu(self.model, dtypes=(torch.bfloat16,)):  # both were bound to the replaced modules
                self.fast = FastForward.build(self.model)
                self.ragged = self.ragged and RaggedTokens(self.model.get_decoder().layers)
        self._deterministic = bool(on)
        if self.fast is not None and self.fast.plan is not self._routes():
            self.fast = FastForward.build(self.model, self._routes())

    def graph_step(self) -> GraphStep | None:
        """The graph-ready decode and verify step (graph_step.py) where it runs: its mode on, a fast forward, not
        --deterministic (whose exact kernels are the CPU's)."""
        if self.graph_mode == "off" or self.fast is None or self._deterministic:
            return None
        if self._graph_step is None:
            self._graph_step = GraphStep(self, self.graph_mode)
        return self._graph_step

    @property
    def captures_steps(self) -> bool:
        """Whether its graph-ready steps are captured as CUDA graphs (captured and compiled modes): the cache then
        keeps its buffers, whose addresses the graphs hold."""
        return self.graph_mode in ("captured", "compiled")

    def _routes(self) -> KernelPlan | None:
        """The plan the fast forward follows: none while deterministic (its routes change a row's numbers with its
        forward's row count), and none where it keeps every linear on its module's kernel (nothing to build)."""
        plan = self.kernel_plan
        return plan if plan is not None and plan.routed and not self._deterministic else None

    def kernel_plan_text(self) -> str | None:
        """The plan in one line, and whether --deterministic set it aside (the output rows' `kernel_plan`)."""
        if self.kernel_plan is None:
            return None
        aside = self.kernel_plan.routed and self._deterministic
        return self.kernel_plan.describe() + ("; set aside by --deterministic" if aside else "")

    def determinism_costs_nothing(self) -> bool:
        """Whether `--deterministic auto` switches it on: a bf16 forward on a CPU whose linears already run the panel
        kernel (tune_for_cpu: no AMX) and whose attention runs the bf16 kernels (avx512_bf16, head_dim 64 or 128).
        There the switch only changes which of our kernels attends, at about plain speed (decisions.md:
        specdec_core/model/model_runner.py). Not in fp32 (lossless methods are exact without it), not with AMX (the
        linears would leave oneDNN's tiles: not compared), not on a GPU (no fast forward)."""
        head_dim = self.fast.head_dim if self.fast is not None else 0
        routed = self.kernel_plan is not None and self.kernel_plan.routed  # it would give up the plan's faster kernels
        return (self.fast is not None and self.dtype == torch.bfloat16 and self.device == "cpu" and not routed
                and bf16_linears_on_panels() and bf16_attention.usable(head_dim)
                and bf16_step_attention.usable(head_dim))

    def _compiled_short_attention(self, num_new: int) -> bool:
        """Whether a bf16 decode or verify forward on a CPU attends through a compiled kernel without the switch
        (bf16_step_attention.py where it runs, else invariant_attention.py): SDPA's flash kernel, built for long
        queries, was most of a bf16 decode step on an avx512_bf16 CPU, and invariant_attention.py a fraction of it
        (decisions.md: specdec_core/model/model_runner.py). fp32 has its own (cpu_attention.py)."""
        return (self.fast is not None and self.dtype == torch.bfloat16 and self.device == "cpu"
                and num_new <= grouped_attention.MAX_QUERIES and invariant_attention.kernel() is not None)

    def _bf16_steps(self, visible: torch.Tensor) -> bool:
        """Whether a bf16 decode or verify step attends through bf16_step_attention.py (without --deterministic):
        several times faster than the compiled fp32 kernel at decode and verify on an avx512_bf16 CPU (decisions.md:
        specdec_core/model/model_runner.py)."""
        return bf16_step_attention.usable(self.fast.head_dim) and bf16_step_attention.takes(visible.cpu())

    def _bf16_step_kernel(self) -> bool:
        """Whether this bf16 CPU model's steps can run bf16_step_attention.py (its head_dim, this CPU)."""
        return (self.fast is not None and self.dtype == torch.bfloat16 and self.device == "cpu"
                and bf16_step_attention.usable(self.fast.head_dim))

    @property
    def unmasked_prefill(self) -> bool:
        """Whether a prefill chunk attends without a mask wherever it starts (bf16_attention.py,
        fp32_chain_attention.py), so a prefix-cache hit never brings one back (prefill_plan.worth_reusing); not
        where the plan picked SDPA for prompt chains, which masks a row with cached keys."""
        chains = self._chain_attention(grouped_attention.MAX_QUERIES + 1, prefill=True)
        return chains and self._prompt_chain_kernel() is None

    @property
    def prefill_rows_apart(self) -> bool:
        """Whether each row of a prefill forward attends on its own (a chain kernel), so that a prefix hit masks
        only its own row (prefill_plan.worth_reusing)."""
        return self._chain_attention(grouped_attention.MAX_QUERIES + 1, prefill=True)

    def _step_kernel(self):
        """The module attending bf16 decode and verify steps without --deterministic: the kernel plan's choice
        (step_plan.py: the AMX tiles where they were faster), else bf16_step_attention.py."""
        plan = self.kernel_plan
        if plan is None or plan.step_attention == step_plan.DEFAULT:
            return bf16_step_attention
        module = step_plan.kernel(plan.step_attention)
        return module if module.usable(self.fast.head_dim) else bf16_step_attention

    def _prompt_chain_kernel(self):
        """The module attending bf16 prompt chains where the kernel plan timed another faster than
        bf16_attention.py (chain_plan.py: SDPA on an AMX CPU), else None; never with --deterministic, whose prompts
        stay on bf16_attention.py's row-invariant kernel."""
        plan = self.kernel_plan
        if (plan is None or self._deterministic or self.dtype != torch.bfloat16
                or plan.prompt_attention == chain_plan.DEFAULT):
            return None
        return chain_plan.kernel(plan.prompt_attention)

    def _chain_attention(self, num_new: int, prefill: bool) -> bool:
        """Whether a CPU forward attends through a chain kernel (if its rows are chains): bf16_attention.py in bf16,
        fp32_chain_attention.py in fp32. SDPA was the largest part of a bf16 summarisation prefill on an avx512_bf16
        CPU, several times the kernel's time, and slower than ours in fp32 (decisions.md:
        specdec_core/model/model_runner.py). fp32: forwards of more than MAX_QUERIES tokens a row, without the
        switch only. bf16: without the switch, forwards of more than
        MAX_QUERIES tokens a row; with it, every prefill forward and nothing else: a token's result there depends on
        its own keys only, and a prompt's tokens are then always computed by it, generated ones always by
        bf16_step_attention.py's exact kernel (invariant_attention.py where that does not run), whatever the widths
        (a prompt's last chunk may be short; a verify block may be long)."""
        if self.fast is None or self.device != "cpu":
            return False
        if self.dtype == torch.float32:  # not with --deterministic (invariant_attention.py), a forced attention or
            # captured steps (a GPU's ways, as its tests simulate them on a CPU)
            return (not self.deterministic and num_new > grouped_attention.MAX_QUERIES and self.gpu_attention == "auto"
                    and not self.captures_steps and fp32_chain_attention.usable(self.fast.head_dim))
        usable = self.dtype == torch.bfloat16 and bf16_attention.usable(self.fast.head_dim)
        return usable and (prefill if self.deterministic else num_new > grouped_attention.MAX_QUERIES)

    @classmethod
    def load(cls, name: str, dtype: str = "auto", device: str = "auto") -> "ModelRunner":
        """dtype: auto, float32, bfloat16, float16, or int8 (drafters on a CPU only: see INT8)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        device = resolve_device(device)
        quantized = dtype == INT8
        if quantized and device != "cpu":
            raise ValueError("int8 weights run on a CPU only (PyTorch's CPU int8 kernels); choose bfloat16 or float16 here")
        # int8 weights compute in bf16 where the CPU runs bf16 fast (weight-only kernels), else in fp32 (quantize_int8)
        torch_dtype = resolve_dtype("auto", device) if quantized else resolve_dtype(dtype, device)
        path = resolve_model_path(name)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device)
        model.eval()
        if quantized:
            quantize_int8(model)
        plan = None
        if device == "cpu":
            tune_for_cpu(model)
            plan = None if quantized else cpu_kernel_plan(model, torch_dtype)
        elif device.startswith("cuda"):
            # cuDNN's attention builds an execution plan for every new shape, and a batched decode meets a new
            # key length at almost every step, so a first pass over new prompts paid for its plans (decisions.md:
            # specdec_core/model/model_runner.py). PyTorch then picks its flash / memory-efficient kernels.
            torch.backends.cuda.enable_cudnn_sdp(False)
        return cls(model, tokenizer, name, device, torch_dtype, quantized, plan=plan)

    @property
    def dtype_name(self) -> str:
        return INT8 if self.quantized else str(self.dtype).removeprefix("torch.")

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(
        self,
        cache,
        input_ids: list[int],
        num_logits: int = 1,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        hidden_layer: int | None = None,
    ) -> ForwardOutput:
        """Run input_ids after what the cache holds; the cache grows by len(input_ids).

        Only the last num_logits positions go through the LM head: a long prefill with full logits would
        materialise [tokens, vocab] floats for nothing.
        """
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)  # [1, T]
        past = cache.get_seq_length()
        kwargs = {}
        if attention_mask is not None:
            # 4-D float mask [1, 1, T, past + T]: 0 where a token may attend, dtype-min elsewhere (tree attention).
            kwargs["attention_mask"] = attention_mask.to(self.device, self.dtype)
        if position_ids is not None:
            kwargs["position_ids"] = position_ids.to(self.device).view(1, -1)
        out = self.model(
            input_ids=ids,
            past_key_values=cache,
            use_cache=True,
            cache_position=torch.arange(past, past + len(input_ids), device=self.device),
            logits_to_keep=num_logits,
            output_hidden_states=hidden_layer is not None,
            **kwargs,
        )
        logits = out.logits[0, -num_logits:].float()  # [num_logits, vocab]
        hidden = out.hidden_states[hidden_layer][0] if hidden_layer is not None else None  # [T, hidden]
        return ForwardOutput(logits=logits, hidden=hidden)

    # ------------------------------------------------------------------------------------------- the owned cache
    @torch.inference_mode()
    def forward_slots(self, cache: SlotKVCache, batch: StepBatch, head: SubsetHead | None = None) -> torch.Tensor:
        """One forward over the cache's live rows (or `batch.rows`); keys/values land at each row's length.

        batch      the new tokens, what may attend what, the logits wanted and what to record (step_batch.py).
                   Hidden states of `batch.captured`'s layers (layer l = the output of decoder layer l - 1, as HF's
                   `hidden_states[l]`; 0 = the embeddings) are captured during this same forward: no second forward,
                   no `output_hidden_states` for every layer. `batch.query_heads`' post-rotary queries fill
                   `batch.queries` (for their attention weights, attention_probe.py).
        head       the LM head restricted to some tokens (SubsetHead), or None for the whole vocabulary
        -> [N, vocab] float32 logits. The rows' lengths are NOT advanced: the caller commits what it accepts.
        """
        num_new = batch.input_ids.shape[1]
        cache.bind(num_new, batch.rows)
        lengths = torch.tensor(cache.bound_lengths())  # [b]
        for layer in batch.captured:
            if not 0 <= layer <= self.num_layers:
                raise ValueError(f"hidden layer {layer} is out of range: {self.name} has layers 0..{self.num_layers}")
        plan = self._attention_for(cache, lengths, batch)
        if self._picks_prefill_attention(batch, plan):
            plan = None  # (its [b, T, L] mask: each attention's run plans its own)
            return self._pick_prefill_attention(cache, lengths, batch, head)
        return self._run(cache, lengths, batch, plan, head)

    def _run(self, cache: SlotKVCache, lengths: torch.Tensor, batch: StepBatch, plan: AttentionPlan,
             head: SubsetHead | None) -> torch.Tensor:
        """forward_slots's forward once its attention is planned -> [N, vocab] float32 logits."""
        real = batch.real  # [b, T]
        # each row's new tokens up to its last real one: its padding past that neither attends nor is attended
        extent = (real * torch.arange(1, real.shape[1] + 1)).amax(dim=1) if real.numel() else lengths * 0  # [b]
        with grouped_attention.real_keys(lengths + extent, cache.kv_heads * cache.head_dim, extent):
            if self.fast is not None:
                mask = plan.mask["full_attention"] if isinstance(plan.mask, dict) else plan.mask
                plan.mask = None if mask is None else mask.to(self.device)
                hidden = self.fast.run(cache, batch, plan,
                                       real if RaggedTokens.worth_it(real, self.gather_share) else None)
            else:
                hidden = self._hf_hidden(cache, batch, plan.mask, real)
        return head(hidden) if head is not None else self.head_logits(hidden)  # [N, vocab]

    def masked_attention(self, prefill: bool) -> str:
        """sdpa or flex: how a fast forward that needs a mask attends (block_attention.py). Under `auto`, prefills
        as timed at the first masked prefill (_pick_prefill_attention), other forwards (eager decode and verify
        steps) as the graph-ready steps picked; sdpa until then, and where nothing is captured."""
        if self.gpu_attention != "auto":
            return "sdpa" if self.gpu_attention in block_attention.OPT_IN else self.gpu_attention
        if prefill:
            return self.prefill_attention or "sdpa"
        step = self._graph_step
        return step.attention if step is not None and step.attention in block_attention.CANDIDATES else "sdpa"

    def _picks_prefill_attention(self, batch: StepBatch, plan: AttentionPlan) -> bool:
        """Whether this forward times the attentions for prefills: the first masked prefill under `auto` where the
        steps are captured (a GPU; elsewhere a timed forward would cost a whole prefill)."""
        return (batch.prefill and self.gpu_attention == "auto" and self.prefill_attention is None
                and self.fast is not None and self.captures_steps and self.graph_step() is not None
                and self.graph_step().capture and (plan.mask is not None or plan.blocks is not None))

    def _pick_prefill_attention(self, cache: SlotKVCache, lengths: torch.Tensor, batch: StepBatch,
                                head: SubsetHead | None) -> torch.Tensor:
        """The first masked prefill under `auto`, run PICK_RUNS times with each attention (the first run of each
        compiles and warms up, the last is timed); the faster serves every later prefill (one log line). The same
        keys land in the cache each time; masked SDPA runs last, so the cache and the logits are what `sdpa` gives.
        A flex forward that fails, or whose kernel failed, drops out. -> the forward's [N, vocab] logits."""
        started = time.perf_counter()
        logits = None
        for attention in ("flex", "sdpa"):
            self.prefill_attention = attention
            try:
                for _ in range(PICK_RUNS):
                    self.synchronize()
                    run_started = time.perf_counter()
                    logits = self._run(cache, lengths, batch, self._attention_for(cache, lengths, batch), head)
                    self.synchronize()
                    self.prefill_attention_ms[attention] = (time.perf_counter() - run_started) * 1e3
            except Exception as exc:
                if attention == "sdpa":
                    raise
                log.warning("a prefill with flex attention failed (%s: %s); it is not a candidate",
                            type(exc).__name__, exc)
                self.prefill_attention_ms.pop(attention, None)
            if attention == "flex" and block_attention.kernel_state(self.device) == "failed":
                self.prefill_attention_ms.pop(attention, None)  # it ran as masked SDPA
        self.prefill_attention = min(self.prefill_attention_ms, key=self.prefill_attention_ms.get)
        log.info("prefills attend through %s (%d prompt tokens: %s)", self.prefill_attention, int(batch.real.sum()),
                 ", ".join(f"{name} {ms:.2f} ms" for name, ms in self.prefill_attention_ms.items()))
        # one forward's time is the prefill's; the rest was the choice's
        self.attention_pick_s += time.perf_counter() - started - self.prefill_attention_ms["sdpa"] / 1e3
        return logits

    def _attention_for(self, cache: SlotKVCache, lengths: torch.Tensor, batch: StepBatch) -> AttentionPlan:
        """Which attention a forward_slots call runs, and what it needs: bf16_attention.py for prompt chains in bf16,
        bf16_step_attention.py for bf16 decode and verify steps, invariant_attention.py for --deterministic elsewhere
        and short fp32 steps; else SDPA, with the padded mask unless the forward is one plain prompt from
        position 0."""
        positions, visible, prefill = batch.positions, batch.visible, batch.prefill
        num_new = visible.shape[1]
        news = bf16_attention.chain_news(visible) if self._chain_attention(num_new, prefill) else None
        chain = (lengths, news) if news is not None else None
        chain_kernel = self._prompt_chain_kernel() if chain is not None else None
        short = chain is None and self._compiled_short_attention(num_new)
        if chain is None and not prefill and self.deterministic and self._bf16_step_kernel():
            # every generated token, in a step of any width, through the exact kernel (prompts: bf16_attention.py)
            step = bf16_step_attention.Step(visible, lengths, cache.bound_rows(), exact=True)
        elif short and not self.deterministic and self._bf16_steps(visible):
            step = self._step_kernel().Step(visible, lengths, cache.bound_rows())
        else:
            step = None
        compiled = chain is not None or step is not None
        invariant = (visible.cpu(), lengths) if not compiled and (self.deterministic or short) else None
        masked = invariant is None and not compiled and not self._plain_prefill(lengths, positions, visible)
        # built on the forward's device: on a GPU, CPU ops building a prefill's [b, T, L] mask slowed each admission
        device = self.device
        if masked and self.fast is not None and self.masked_attention(prefill) == "flex":  # each row's own keys
            news = visible.diagonal(dim1=1, dim2=2).sum(1)  # [b]: real nodes, the first of each row's T
            blocks = block_attention.block_mask(lengths.to(device), visible.to(device), cache.kv_length(),
                                                news.to(device))
            return AttentionPlan(chain, chain_kernel, step, invariant, None, blocks)
        mask = attention_masks(self.model.config, lengths.to(device), positions.to(device), visible.to(device),
                               cache.kv_length(), self.dtype) if masked else None
        return AttentionPlan(chain, chain_kernel, step, invariant, mask)

    def _hf_hidden(self, cache: SlotKVCache, batch: StepBatch, mask, real: torch.Tensor) -> torch.Tensor:
        """forward_slots through the model's own modules (architectures the fast forward does not cover): the
        ragged gather, our attention and the capture hooks hooked in for this forward only -> [N, hidden]."""
        hooks = []
        with ExitStack() as scope:
            scope.callback(lambda: [hook.remove() for hook in hooks])
            if self.ragged is not None and self.ragged.worth_it(real):
                scope.enter_context(self.ragged.only(real))
            if self.grouped_attention:
                scope.enter_context(self._attention(grouped_attention.NAME))
            for layer in batch.captured:
                hooks.append(self._capture_hook(layer, batch.captured))
            if batch.query_heads:
                hooks += capture_queries(self, batch.query_heads, batch.queries)
            out = self.base_model(
                input_ids=batch.input_ids.to(self.device),
                position_ids=batch.positions.to(self.device),
                attention_mask={k: m.to(self.device) for k, m in mask.items()} if isinstance(mask, dict)
                else mask.to(self.device) if mask is not None else None,
                past_key_values=cache,
                use_cache=True,
                cache_position=torch.arange(batch.input_ids.shape[1], device=self.device),
            )
        index = batch.logit_index.to(self.device)
        return out.last_hidden_state[index[:, 0], index[:, 1]]

    @contextmanager
    def _attention(self, name: str):
        """The slot-cache forwards use `name` (grouped_attention.py); everything else keeps the model's own (HF
        `generate`, run on this same model as the peer, stays stock)."""
        config = self.model.config
        before = config._attn_implementation
        config._attn_implementation = name
        try:
            yield
        finally:
            config._attn_implementation = before

    def _plain_prefill(self, lengths: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> bool:
        """A single row fed from position 0 as a causal chain (a prefill) needs no mask of ours: without one, SDPA
        runs its causal kernel, faster with identical logits (decisions.md: specdec_core/model/model_runner.py), and
        prefill is most of a long-prompt job's time on a CPU. A model whose sliding window the prompt
        exceeds keeps the explicit masks."""
        num_new = positions.shape[1]
        if lengths.numel() != 1 or int(lengths[0]) != 0 or num_new < 2:
            return False
        window = getattr(self.model.config, "sliding_window", None)
        if window and num_new > window:
            return False
        return bool(torch.equal(positions[0].cpu(), torch.arange(num_new))
                    and torch.equal(visible[0].cpu(), torch.ones(num_new, num_new, dtype=torch.bool).tril()))

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    def _capture_hook(self, layer: int, captured: dict[int, torch.Tensor]):
        """A forward hook that stores `hidden_states[layer]` of the running forward into captured[layer]."""

        def store(module, args, kwargs, output):
            hidden = output[0] if isinstance(output, tuple) else output  # [b, T, hidden]
            captured[layer] = hidden.detach().float()

        def store_input(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]  # the embeddings entering layer 0
            captured[layer] = hidden.detach().float()

        layers = self.base_model.layers
        if layer == 0:
            return layers[0].register_forward_pre_hook(store_input, with_kwargs=True)
        return layers[layer - 1].register_forward_hook(store, with_kwargs=True)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32, as the model's own LM head computes them (Gemma's soft-capping too)."""
        logits = self.model.get_output_embeddings()(hidden)
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def synchronize(self) -> None:
        """Wait for queued device work (timing a GPU forward needs it; a no-op on CPU)."""
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)

    @property
    def gather_share(self) -> float:
        """The share of a forward's [b, T] block that may be real tokens for its per-token work to gather them."""
        return fast_forward.GATHER_MAX_REAL_SHARE if self.fast is not None else MAX_REAL_SHARE

    @property
    def base_model(self):
        return getattr(self.model, self.model.base_model_prefix)


def bf16_linears_on_panels() -> bool:
    """Whether tune_for_cpu puts bf16 linears on the panel kernel by default: where the CPU's bf16 dot product runs
    them (bf16_dot.py), unless it has AMX, where oneDNN's tiles run them (bf16_linears_packed)."""
    return not torch.cpu._is_amx_tile_supported() and bf16_dot.available()


def bf16_linears_packed() -> bool:
    """Whether tune_for_cpu reorders bf16 linears once into oneDNN's blocked layout by default: on an AMX CPU, where
    oneDNN's tiles run them far ahead of our bf16 kernels and F.linear would reorder a plain weight at every call
    (docs/decisions.md: "AMX")."""
    return torch.cpu._is_amx_tile_supported() and packed_linear.bf16_available()


def tune_for_cpu(model, dtypes: tuple | None = None) -> int:
    """CPU-only speed-ups that leave the numbers identical in every decoder (AR included), so losslessness holds.
    The linear layers of `dtypes` go to the panel kernel (oneDNN's packed layout for fp32 without it); returns how
    many were replaced (a packed bf16 layer too: --deterministic's call puts it on panels). By default fp32, and bf16
    where the CPU's bf16 dot product runs them (bf16_dot.py: faster than oneDNN at every row count on an AMD
    avx512_bf16 CPU), or on an AMX CPU bf16 in oneDNN's packed layout (bf16_linears_packed)."""
    packed_bf16 = dtypes is None and bf16_linears_packed()
    if dtypes is None:
        dtypes = ((torch.float32, torch.bfloat16) if bf16_linears_on_panels() or packed_bf16
                  else (torch.float32,))
    # Let SDPA handle grouped-query attention itself even with a mask (multi-token verify forwards): otherwise
    # transformers copies every cached K/V head n_rep times per layer per forward (~20% of an 11-token forward).
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    layers = getattr(getattr(model, model.base_model_prefix, model), "layers", None)
    count = 0
    for dtype in dtypes:
        if dtype == torch.bfloat16 and packed_bf16:
            make = packed_linear.PackedLinear
        elif panel_linear.available(dtype):
            make = panel_linear.PanelLinear
        elif dtype == torch.float32 and packed_linear.available():
            make = packed_linear.PackedLinear
        else:
            continue
        # decoder linears of this dtype only (int8 drafters keep theirs)
        count += 0 if layers is None else packed_linear.replace_linears(layers, make, (dtype,))
        head = model.get_output_embeddings()
        plain = type(head) is torch.nn.Linear and head.weight.dtype == dtype
        if plain or (type(head) is packed_linear.PackedLinear and head.dtype == dtype and make is not type(head)):
            # A tied head keeps pointing at the embedding's dense weight until replaced: it gets a copy of its own.
            model.config.tie_word_embeddings = False  # no later re-tie may put a dense weight back
            model.set_output_embeddings(make(head))
            count += 1
    return count


def cpu_kernel_plan(model, dtype: torch.dtype) -> KernelPlan | None:
    """This machine's kernel plan for a CPU model the fast forward runs (kernel_plan.plan_for), or None; a plan that
    fails to be made leaves the linears on their modules' kernels (one log line)."""
    if fast_forward.unsupported(model) is not None:
        return None
    try:
        config = model.config
        primary = kernel_plan.primary_kernel(model.get_decoder().layers[0].mlp.down_proj)
        return kernel_plan.plan_for(linear_plan.model_shapes(config), config.num_hidden_layers, dtype, primary,
                                    linear_plan.model_heads(config))
    except Exception as exc:  # never a reason to fail a load: the flags' kernels still run
        log.warning("no kernel plan (%s: %s); the linears keep the kernels the CPU's flags pick",
                    type(exc).__name__, exc)
        return None


SERVABLE_LAYER_TYPES = {"full_attention", "sliding_attention"}


class DeterminismUnavailableError(SpecbatchError):
    pass


class UnsupportedArchitectureError(SpecbatchError):
    pass


def check_servable(config) -> None:
    """The owned cache serves decoder-only attention models; anything else (linear attention, SSM, chunked or
    encoder-decoder attention) gets one clear error instead of wrong tokens."""
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    unknown = layer_types - SERVABLE_LAYER_TYPES
    if unknown or getattr(config, "is_encoder_decoder", False):
        raise UnsupportedArchitectureError(
            f"the batched engine cannot serve {config.model_type!r}: layer types {sorted(unknown) or 'encoder-decoder'}"
            " need a cache it does not have (it serves full and sliding-window attention)"
        )


def _sdpa_family(config) -> bool:
    """Whether the model runs SDPA attention, which grouped_attention.py replaces for short forwards (a model loaded
    with eager or flash attention keeps it)."""
    return getattr(config, "_attn_implementation", None) in (None, "sdpa")


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
