"""The batched loop's forward for Llama-family models (Llama, Qwen2, Mistral), written over the owned cache.

Hugging Face's decoder runs each layer through a dozen modules, hooks and kwargs dicts, and hands the cache a padded
`[b, T]` block. This forward runs the same arithmetic as a loop of tensor calls per layer:
- the per-token work (norms, projections, MLP) runs on the real tokens only, flattened `[M, hidden]`; only
  attention sees the padded `[b, T]` layout (grouped_attention.py picks its kernel);
- new keys and values go straight to their slot positions, and the final norm runs only on the positions whose
  logits are wanted;
- hidden states of a layer and post-rotary queries of chosen heads (what PLD+ reads) come out of the same pass.

It computes what HF's modules compute (RMSNorm in fp32, rotate-half RoPE from the model's own rotary embedding,
SiLU gate) with the same linear layers (panel_linear.py), or, given a machine's kernel plan (kernel_plan.py), with
the kernel the plan picks for each linear at the forward's row count. On an fp32 CPU each residual add and the RMSNorm after it,
and the SiLU gate over gate and up computed in one call, are single compiled passes (residual_norm.py), so its
logits equal HF's forward over the same cache within float rounding (tests/specdec_core/test_fast_forward.py), and
each row's numbers stay its own. benchmarks/forward_bench.py compares the two in one process. Models it does
not cover (other architectures, int8 drafters, sliding windows) run HF's forward: `FastForward.build` says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import block_attention, grouped_attention
from ..kernels import (bf16_attention, decode_layer, fp32_chain_attention, invariant_attention, kernel_plan,
                       packed_linear, panel_linear, residual_norm, rope_store)
from ..kernels.kernel_plan import KernelPlan
from ..kernels.packed_linear import PackedLinear
from ..kernels.panel_linear import PanelLinear
from .step_batch import AttentionPlan, StepBatch

log = logging.getLogger(__name__)
MODEL_TYPES = ("llama", "qwen2", "mistral")
LINEARS = (torch.nn.Linear, PanelLinear, PackedLinear)
# Per-token work runs on the real tokens whenever at least 5 % of a [b, T] block is padding: here a gather costs two
# small copies a layer (HF's hooked modules pay more: ragged_tokens.MAX_REAL_SHARE), and a shared prefill forward of
# prompts of different lengths is ~20 % padding.
GATHER_MAX_REAL_SHARE = 0.95


class _Projection:
    """One linear layer as a plain call: the panel kernel (panel_linear.py), oneDNN on its reordered weight
    (packed_linear.py), else F.linear."""

    def __init__(self, module):
        if type(module) not in LINEARS:
            raise TypeError(f"{type(module).__name__} is not a plain, panel or packed linear layer")
        self.module = module
        self.run = module.project if type(module) is not torch.nn.Linear else self._dense
        self.out_features = module.out_features

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.module.weight, self.module.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        return self.run(x)


class _Routed:
    """One linear whose kernel depends on the forward's row count M (a kernel plan's route)."""

    def __init__(self, steps: list[tuple[int | None, object]]):
        self.steps = steps  # [(the most rows or None, x [M, in] -> [M, out])], by rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        rows = x.shape[0]
        for most, run in self.steps:
            if most is None or rows <= most:
                break
        return run(x)


def _routed(plan: KernelPlan | None, role: str, modules: list, stacked):
    """`role`'s linear as the plan routes it, or None where the plan keeps it on its modules' kernel. stacked: the
    modules already stacked into one (or None); other layouts are built from their dense weights."""
    if plan is None or all(name == plan.primary for _, name in plan.routes.get(role, ())):
        return None
    weight = (stacked.weight if stacked is not None else torch.cat([m.weight for m in modules])).detach()  # [out, in]
    bias = None
    if any(m.bias is not None for m in modules):  # Qwen2's q, k and v: added to the kernels' rounded outputs
        bias = torch.cat([m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features)
                          for m in modules]).to(weight.dtype)  # [out]
    runs = {}
    for _, name in plan.routes[role]:
        if name in runs:
            continue
        if stacked is not None and hasattr(stacked, "project") and name == kernel_plan.primary_kernel(stacked):
            runs[name] = stacked.project  # the modules' own layout, bias included
        elif name == plan.primary and all(type(m) is torch.nn.Linear for m in modules):
            runs[name] = _dense_run(modules)  # oneDNN over the modules' own weights: no copy of them
        elif name == "onednn_packed":  # the bias added inside oneDNN's call, as the modules' own layout adds it
            packed = packed_linear.reorder(weight)
            runs[name] = lambda x, packed=packed: packed_linear.linear(x, packed, bias)
        else:
            run = kernel_plan.build(name, weight)
            runs[name] = run if bias is None else (lambda x, run=run: run(x).add_(bias))
    return _Routed([(most, runs[name]) for most, name in plan.routes[role]])


def _dense_run(modules: list[torch.nn.Linear]):
    """x [M, in] -> the modules' outputs side by side [M, sum of out], each through its own weight and bias."""
    if len(modules) == 1:
        return lambda x, m=modules[0]: F.linear(x, m.weight, m.bias)
    return lambda x: torch.cat([F.linear(x, m.weight, m.bias) for m in modules], dim=-1)


class _Layer:
    """One decoder layer's weights and settings."""

    def __init__(self, layer, plan: KernelPlan | None = None):
        attn, mlp = layer.self_attn, layer.mlp
        self.on_gpu = _on_gpu(attn.q_proj)  # no compiled CPU passes there, and every copy is a kernel launch
        dense = self.on_gpu and all(type(getattr(module, n)) is torch.nn.Linear for module, n in (
            (attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj"), (mlp, "gate_proj"), (mlp, "up_proj")))
        self.attn = attn  # handed to SDPA for long queries (it reads num_key_value_groups and is_causal)
        self.norm1, self.eps1 = layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon
        self.norm2 = layer.post_attention_layernorm.weight.detach()
        self.eps2 = layer.post_attention_layernorm.variance_epsilon
        self.q, self.k, self.v, self.o = (_Projection(getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        self.gate, self.up, self.down = (_Projection(getattr(mlp, n)) for n in ("gate_proj", "up_proj", "down_proj"))
        # gate and up in one call, then silu(gate) * up in one pass (residual_norm.py), where both are on panels
        both = (panel_linear.stack(mlp.gate_proj, mlp.up_proj)
                if type(mlp.gate_proj) is PanelLinear and type(mlp.up_proj) is PanelLinear
                else _stack_dense(mlp.gate_proj, mlp.up_proj) if dense else None)
        self.gate_up = None if both is None else _Projection(both)
        # q, k and v in one call: each kernel call costs host work (decisions.md: specdec_core/model/fast_forward.py)
        projections = [attn.q_proj, attn.k_proj, attn.v_proj]
        qkv = (panel_linear.stack(*projections) if all(type(p) is PanelLinear for p in projections)
               else _stack_dense(*projections) if dense else None)
        self.qkv = None if qkv is None else _Projection(qkv)
        self.qkv_widths = [p.out_features for p in projections]
        if not self.on_gpu:  # the machine's kernel plan, where it routes a linear away from its module's kernel
            routed = _routed(plan, "qkv", projections, qkv)
            self.qkv = routed or self.qkv
            routed = _routed(plan, "gate_up", [mlp.gate_proj, mlp.up_proj], both)
            self.gate_up = routed or self.gate_up
            self.o = _routed(plan, "o", [attn.o_proj], attn.o_proj) or self.o
            self.down = _routed(plan, "down", [mlp.down_proj], mlp.down_proj) or self.down
        self.scaling = attn.scaling
        projections = (self.qkv, self.o, self.gate_up, self.down)
        # the layer as one compiled call in a bf16 step (decode_layer.py), where its linears are all bf16 panels
        self.fused = None if self.on_gpu or any(type(p) is not _Projection for p in projections) else (
            decode_layer.weights(self.norm1, self.norm2, (self.eps1, self.eps2), self.scaling,
                                 [p.module for p in projections]))


def _on_gpu(module) -> bool:
    return module.weight.device.type != "cpu"


def _stack_dense(*modules: torch.nn.Linear) -> torch.nn.Linear:
    """One nn.Linear computing `modules` side by side (on a GPU: one matmul launch instead of several). The modules'
    weights become views of the stacked weight, so nothing is stored twice and HF's modules still compute with them."""
    weight = torch.cat([m.weight.detach() for m in modules])  # [sum of out, in]
    with_bias = any(m.bias is not None for m in modules)
    bias = torch.cat([m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features)
                      for m in modules]) if with_bias else None  # [sum of out]
    stacked = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=with_bias, device="meta")
    stacked.weight = torch.nn.Parameter(weight, requires_grad=False)
    stacked.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
    start = 0
    for m in modules:
        end = start + m.out_features
        m.weight = torch.nn.Parameter(weight[start:end], requires_grad=False)
        if m.bias is not None:
            m.bias = torch.nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return stacked


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[M, hidden], as LlamaRMSNorm computes it (in fp32, then back to the activations' dtype)."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [M, hidden] -> (x + delta, its RMSNorm): one compiled pass on an fp32 CPU (residual_norm.py)."""
    if residual_norm.usable(x):
        return residual_norm.add_rms_norm(x, delta, weight, eps)
    x = x if delta is None else x + delta
    return x, _rms_norm(x, weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[M, heads, d] rotated by each token's [M, 1, d] cos / sin (rotate-half form, as HF's apply_rotary_pos_emb)."""
    return x * cos + _rotate_half(x) * sin


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@dataclass
class _Tokens:
    """One forward's per-token facts, computed once and read by every layer. M = the real tokens computed."""

    cache: object  # the SlotKVCache, bound to the forward's b rows
    attention: AttentionPlan
    flat: torch.Tensor | None  # [M] indices into b x T of the real tokens (None: all b x T)
    b: int
    num_new: int  # T
    cos: torch.Tensor  # [M, 1, d]
    sin: torch.Tensor  # [M, 1, d]
    rows: torch.Tensor  # [M] cache slot of each token's keys
    places: torch.Tensor  # [M] their place in the slot
    rotation: object  # rope_store's compiled RoPE and cache write, or None (eager)
    queries: dict  # filled: {layer: [b, n, T, d] float32}


class FastForward:
    """A model's decoder layers as stacked weights; `run` is one forward over a bound SlotKVCache."""

    def __init__(self, model, plan: KernelPlan | None = None):
        base = getattr(model, model.base_model_prefix)
        config = model.config
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.final_norm, self.final_eps = base.norm.weight, base.norm.variance_epsilon
        self.plan = plan  # the kernel plan its linears follow (kernel_plan.py), or None: their modules' kernels
        self.layers = [_Layer(layer, plan) for layer in base.layers]
        fused = [layer.fused for layer in self.layers]
        self.fused = fused if all(weights is not None for weights in fused) else None  # decode_layer.py's
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads

    @classmethod
    def build(cls, model, plan: KernelPlan | None = None) -> "FastForward | None":
        """The fast forward for `model`, or None (with one log line) when its architecture is not covered."""
        reason = unsupported(model)
        if reason is None:
            try:
                return cls(model, plan)
            except Exception as exc:  # an unexpected module layout: HF's forward still serves it
                reason = f"{type(exc).__name__}: {exc}"
        log.info("fast forward off for %s: %s; using the Hugging Face forward", model.config.model_type, reason)
        return None

    @torch.inference_mode()
    def run(self, cache, batch: StepBatch, attention: AttentionPlan, real: torch.Tensor | None) -> torch.Tensor:
        """cache      bound to the forward's rows (cache.bind)
        batch      the forward's tokens and what to record (step_batch.py); captured layers are filled with
                   [b, T, hidden] float32 (0 = embeddings; padding rows are zeros)
        attention  how it attends (step_batch.AttentionPlan); its mask on the forward's device
        real       [b, T] bool: compute only these tokens' per-token work (None: all b x T)
        -> [N, hidden] final-normed hidden states of batch.logit_index's positions."""
        b, num_new = batch.input_ids.shape
        device = self.embed.weight.device
        input_ids, positions = batch.input_ids.to(device), batch.positions.to(device)
        flat = None if real is None else real.reshape(-1).nonzero().squeeze(1).to(device)  # [M] of b x T
        ids = input_ids.reshape(-1) if flat is None else input_ids.reshape(-1)[flat]  # [M]
        x = self.embed(ids)  # [M, hidden]
        cos, sin = self.rotary(x, positions)  # [b, T, d] each
        cos, sin = cos.reshape(b * num_new, 1, -1), sin.reshape(b * num_new, 1, -1)  # [b x T, 1, d]
        if flat is not None:
            cos, sin = cos[flat], sin[flat]  # [M, 1, d]
        rows, places = cache.token_slots(flat)  # [M], [M]: where each token's keys go
        rotation = rope_store.prepare(cos, sin, rows, places, x, cache.keys[0])  # None: eager RoPE and cache writes
        tokens = _Tokens(cache, attention, flat, b, num_new, cos, sin, rows, places, rotation, batch.queries)
        captured = batch.captured
        if 0 in captured:
            captured[0] = self._padded(x, flat, b, num_new).float()
        delta = None  # the last MLP's output, added to x by the next layer's norm (one pass with it)
        fused = self.fused is not None and decode_layer.usable(attention.step, rotation, x.shape[0])
        index, count = 0, len(self.layers)
        while index < count:
            if fused:  # the layers up to the next one whose output is recorded, in one compiled call each
                end = index + 1
                while end < count and end not in captured:
                    end += 1
                heads = {layer - index: batch.query_heads[layer] for layer in range(index, end)
                         if batch.query_heads.get(layer)}
                x, delta, queries = decode_layer.run_layers(
                    self.fused[index:end], x, delta, flat, (b, num_new, self.heads, self.kv_heads), attention.step,
                    rotation, (cache.keys[index:end], cache.values[index:end]), heads)
                batch.queries.update({index + offset: query for offset, query in queries.items()})
            else:
                x, delta = self._layer(index, self.layers[index], x, delta, tokens, batch.query_heads.get(index))
                end = index + 1
            index = end
            if index in captured:
                x, delta = x + delta, None
                captured[index] = self._padded(x, flat, b, num_new).float()
        logit_index = batch.logit_index
        wanted = (logit_index[:, 0] * num_new + logit_index[:, 1]).to(device)  # [N] of b x T
        if flat is not None:
            where = torch.full((b * num_new,), -1, dtype=torch.long, device=device)
            where[flat] = torch.arange(flat.numel(), device=device)
            wanted = where[wanted]
        last = x[wanted] if delta is None else x[wanted] + delta[wanted]  # [N, hidden]
        return _rms_norm(last, self.final_norm, self.final_eps)  # [N, hidden]

    def _layer(self, index: int, layer, x: torch.Tensor, delta: torch.Tensor | None, tokens: _Tokens,
               heads: list[int] | None):
        """x [M, hidden] the residual stream, delta [M, hidden] or None still to be added to it; heads: the query
        heads of this layer to record -> (x, the MLP's output still to be added)."""
        cache, attention, flat, b, num_new = tokens.cache, tokens.attention, tokens.flat, tokens.b, tokens.num_new
        count = x.shape[0]  # M
        x, normed = _add_rms_norm(x, delta, layer.norm1, layer.eps1)  # [M, hidden] each
        if layer.qkv is not None and layer.on_gpu:  # views: each split dimension stays a view, no copy launches
            q, k, v = layer.qkv(normed).split(layer.qkv_widths, dim=1)
        elif layer.qkv is not None:
            q, k, v = (part.contiguous() for part in layer.qkv(normed).split(layer.qkv_widths, dim=1))
        else:
            q, k, v = layer.q(normed), layer.k(normed), layer.v(normed)
        q = q.view(count, self.heads, self.head_dim)  # [M, H, d]
        k = k.view(count, self.kv_heads, self.head_dim)  # [M, KV, d]
        v = v.view(count, self.kv_heads, self.head_dim)
        if tokens.rotation is not None:
            q = tokens.rotation(q, k, v, cache.keys[index], cache.values[index])
        else:
            q, k = _rope(q, tokens.cos, tokens.sin), _rope(k, tokens.cos, tokens.sin)
            cache.write_tokens(index, tokens.rows, tokens.places, k, v)
        query = self._padded(q, flat, b, num_new).view(b, num_new, self.heads, self.head_dim).transpose(1, 2)
        if heads:
            tokens.queries[index] = query[:, heads].float()  # [b, n, T, d]
        if attention.invariant is not None:
            visible, lengths = attention.invariant
            attended = invariant_attention.attend(query, cache.keys[index], cache.values[index], cache.bound_rows(),
                                                  lengths, visible, layer.scaling)  # [b, T, H, d]
        elif attention.step is not None:
            attended = attention.step.attend(query, cache.keys[index], cache.values[index],
                                             layer.scaling)  # [b, T, H, d]
        elif attention.chain is not None:
            lengths, news = attention.chain
            chain = attention.chain_kernel or (bf16_attention if query.dtype == torch.bfloat16
                                               else fp32_chain_attention)
            attended = chain.attend(query, cache.keys[index], cache.values[index], cache.bound_rows(), lengths, news,
                                    layer.scaling)  # [b, T, H, d]
        elif attention.blocks is not None:
            attended = block_attention.attend(query, *cache.bound_view(index), attention.blocks,
                                              layer.scaling)  # [b, T, H, d]
        else:
            keys, values = cache.bound_view(index)  # [b, KV, L, d] each
            attended, _ = grouped_attention.grouped_attention_forward(
                layer.attn, query, keys, values, attention.mask, scaling=layer.scaling)  # [b, T, H, d]
        attended = attended.reshape(b * num_new, self.heads * self.head_dim)
        if flat is not None:
            attended = attended[flat]  # [M, H d]
        x, normed = _add_rms_norm(x, layer.o(attended), layer.norm2, layer.eps2)
        if layer.gate_up is not None and residual_norm.usable(normed):
            return x, layer.down(residual_norm.silu_mul(layer.gate_up(normed)))
        if layer.gate_up is not None and layer.on_gpu:
            return x, layer.down(_silu_mul(*layer.gate_up(normed).chunk(2, dim=1)))
        return x, layer.down(_silu_mul(layer.gate(normed), layer.up(normed)))

    @staticmethod
    def _padded(values: torch.Tensor, flat: torch.Tensor | None, b: int, num_new: int) -> torch.Tensor:
        """[M, ...] per real token -> [b, T, ...] with zeros at the padding."""
        if flat is None:
            return values.reshape(b, num_new, *values.shape[1:])
        full = values.new_zeros(b * num_new, *values.shape[1:])
        full.index_copy_(0, flat, values)
        return full.view(b, num_new, *values.shape[1:])


def unsupported(model) -> str | None:
    """Why `model` cannot run the fast forward, or None when it can."""
    config = model.config
    if config.model_type not in MODEL_TYPES:
        return f"model type {config.model_type!r} (covered: {', '.join(MODEL_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        return f"layer types {sorted(layer_types)}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "a sliding window"
    base = getattr(model, model.base_model_prefix, None)
    for layer in getattr(base, "layers", None) or [None]:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(type(linear) in LINEARS for linear in linears):
            return "linear layers that are not plain nn.Linear (quantized weights)"
        if any(hasattr(attn, n) for n in ("q_norm", "k_norm")):
            return "query / key norms"
    return None
