"""A decode or verify step's attention alone, on a GPU (issue 50): the Qwen2.5-1.5B shape's heads (12 query heads
over 2 key heads, d 128), batch x width queries over ~`--context` cached keys a row, with the step's additive mask
in its folded layout (graph_step.py: the query heads of one key head side by side along the query axis). Each
candidate runs once per layer over that layer's own keys and values (so the cache is read from memory, not from
L2), captured in one CUDA graph and replayed; its time is set against the bytes the keys and values take.

  sdpa        F.scaled_dot_product_attention with the mask, the backend torch picks (what the steps run today)
  efficient   the same, held to the memory-efficient backend
  cudnn       the same, held to cuDNN's backend
  matmul      two batched matmuls around an fp32 softmax (each key head's keys read once per pass)
  split       kernels/split_kv_attention.py: each row's keys split into ranges, merged (reads each row's keys only)

  python benchmarks/gpu_attention_bench.py
  python benchmarks/gpu_attention_bench.py --device cpu --dtype float32 --batch-sizes 2 --layers 2 --context 40
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from specdec_core.kernels import split_kv_attention  # noqa: E402

KV_HEADS, GROUP, HEAD_DIM = 2, 6, 128


def matmul_attention(query, keys, values, mask, scale):
    """query [b, KV, g T, d], keys / values [b, KV, L, d], mask [b, 1, g T, L] additive -> [b, KV, g T, d]."""
    scores = torch.matmul(query, keys.transpose(-1, -2)).float() * scale + mask
    return torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)


def sdpa_with(backend):
    def run(query, keys, values, mask, scale):
        if backend is None:
            return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
    return run


CANDIDATES = {"sdpa": sdpa_with(None), "efficient": sdpa_with(SDPBackend.EFFICIENT_ATTENTION),
              "cudnn": sdpa_with(SDPBackend.CUDNN_ATTENTION), "matmul": matmul_attention, "split": None}


def measure(name, attend, layers, query, mask, scale, device, reps) -> tuple[float, torch.Tensor]:
    """Milliseconds a step's attention takes over every layer (median of reps) -> (ms, layer 0's output)."""
    def step():
        return [attend(query, keys, values, mask, scale) for keys, values in layers]
    step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step()
        replay = graph.replay
    else:
        outputs, replay = step(), step
    times = []
    for _ in range(reps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        replay()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2] * 1e3, outputs[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--widths", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--context", type=int, default=500)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device, dtype = args.device, getattr(torch, args.dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    records = []
    for rows in args.batch_sizes:
        keys_count = -(-(args.context + args.context // 8 + 8) // 64) * 64  # a bucket's key count
        lengths = torch.tensor([args.context + (row * 37) % max(1, args.context // 8) for row in range(rows)],
                               device=device)
        layers = [tuple(torch.randn(rows, KV_HEADS, keys_count, HEAD_DIM, device=device, dtype=dtype,
                                    generator=generator) for _ in range(2)) for _ in range(args.layers)]
        for width in args.widths:
            query = torch.randn(rows, KV_HEADS, GROUP * width, HEAD_DIM, device=device, dtype=dtype,
                                generator=generator)
            seen = torch.arange(keys_count, device=device)[None, :] < (lengths + width)[:, None]  # [b, L]
            mask = torch.zeros(rows, 1, GROUP * width, keys_count, device=device, dtype=dtype)
            mask.masked_fill_(~seen[:, None, None, :], float("-inf"))
            real_bytes = int((lengths + width).sum()) * KV_HEADS * HEAD_DIM * 2 * dtype.itemsize * args.layers
            reference = None
            ends = (lengths + width).clamp(max=keys_count)
            for name, attend in CANDIDATES.items():
                if name == "split":
                    attend = (lambda q, k, v, m, scale, ends=ends: split_kv_attention.attend(q, k, v, m, ends, scale)
                              if split_kv_attention.usable() else None)
                try:
                    ms, out = measure(name, attend, layers, query, mask, HEAD_DIM ** -0.5, device, args.reps)
                    if out is None:
                        raise RuntimeError("declined (no Triton here, or a shape it does not hold)")
                except Exception as exc:  # a backend that does not take this shape or device
                    print(f"b{rows:<4} T{width}  {name:>9}: failed ({type(exc).__name__}: {str(exc)[:120]})")
                    continue
                reference = out if reference is None else reference
                error = float((out.float() - reference.float()).norm() / reference.float().norm())
                records.append({"batch_size": rows, "width": width, "keys": keys_count, "attention": name,
                                "ms_all_layers": round(ms, 4), "us_a_layer": round(ms * 1e3 / args.layers, 2),
                                "gb_per_s": round(real_bytes / ms / 1e6, 1), "relative_error": error})
                print(f"b{rows:<4} T{width}  {name:>9}: {ms:8.3f} ms for {args.layers} layers "
                      f"({ms * 1e3 / args.layers:7.2f} us a layer, {real_bytes / ms / 1e6:7.1f} GB/s of real keys "
                      f"and values), relative error against sdpa {error:.1e}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
