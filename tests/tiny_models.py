"""Tiny random-weight models for the mechanics of the owned cache and the batched loop (fast, no download):
a Llama (SmolLM2's architecture), a Gemma3 with sliding-window layers and a Qwen2 (biased q/k/v)."""

from __future__ import annotations

import torch

from specdec_core.model.model_runner import ModelRunner

VOCAB = 96


class DigitsTokenizer:
    """Enough of a tokenizer for the loop: ids <-> space-separated numbers; no EOS (outputs run to length)."""

    eos_token_id = None
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)

    def get_vocab(self):
        return {str(i): i for i in range(VOCAB)}


# The shape shared by the tiny Llama and Qwen2: 2 layers, grouped-query attention (4 query heads, 2 key/value heads).
TINY_DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
                    pad_token_id=0)


def tiny_llama(seed: int = 0, **options) -> ModelRunner:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY_DECODER)).eval()
    return ModelRunner(model, DigitsTokenizer(), "tiny-llama", "cpu", torch.float32, **options)


def tiny_llama_64(seed: int = 0) -> ModelRunner:
    """tiny_llama with SmolLM2's head_dim (64), which the bf16 step kernel (bf16_step_attention.py) takes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_DECODER, "head_dim": 64})).eval()
    return ModelRunner(model, DigitsTokenizer(), "tiny-llama-64", "cpu", torch.float32)


def tiny_gemma3(seed: int = 0, window: int = 8) -> ModelRunner:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, sliding_window=window, max_position_embeddings=512,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        final_logit_softcapping=30.0, attn_implementation="sdpa", bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    model = Gemma3ForCausalLM(config).eval()
    return ModelRunner(model, DigitsTokenizer(), "tiny-gemma3", "cpu", torch.float32)


def tiny_qwen2(seed: int = 0, **options) -> ModelRunner:
    """Qwen2's architecture: biases on the q/k/v projections (qwen2.5-coder's family)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY_DECODER)).eval()
    with torch.no_grad():  # HF initialises biases to zero, which would hide a bias handled wrongly
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.normal_(0.0, 0.5)
    return ModelRunner(model, DigitsTokenizer(), "tiny-qwen2", "cpu", torch.float32, **options)


def noisy_llama(scale: float = 0.3, seed: int = 0) -> ModelRunner:
    """tiny_llama(0) with each decoder-layer weight scaled by 1 + scale x N(0, 1): a draft model that drafts what the
    target says often and something else now and then, so verification both accepts and rolls back."""
    runner = tiny_llama(0)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in runner.model.model.layers.parameters():
            parameter.mul_(1.0 + scale * torch.randn(parameter.shape, generator=generator))
    return runner


def hf_greedy(runner: ModelRunner, prompt: list[int], new_tokens: int) -> list[int]:
    """The model's own `generate` (greedy, batch 1): the reference every batched row must equal."""
    with torch.inference_mode():
        out = runner.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                    pad_token_id=0)
    return out[0, len(prompt):].tolist()


def repetitive_prompt(seed: int, length: int) -> list[int]:
    """Random ids with a repeated block, so copy drafters find matches."""
    generator = torch.Generator().manual_seed(seed)
    block = torch.randint(1, VOCAB, (max(4, length // 3),), generator=generator).tolist()
    ids = (block * 4)[:length]
    return ids
