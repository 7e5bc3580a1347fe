"""The compiled CPU kernels and their wrappers: numba and LLVM IR for the linears (`panel_linear`, `bf16_dot`;
`packed_linear` is oneDNN's), the attentions (`cpu_attention`, `invariant_attention`, `bf16_attention`,
`bf16_step_attention`, `amx_step_attention` on the AMX tiles), RoPE and the cache write (`rope_store`), the residual
norm (`residual_norm`), a bf16 step's whole layer in one call of those (`decode_layer`), and their shared pieces (`fast_exp`, `bf16_bits`, `amx_tiles`). The kernel plan
(`kernel_plan`, with `linear_plan`, `chain_plan` and `step_plan`) times the candidates on the machine. `numba_kernels` compiles each on first use into the disk cache and turns
off one that fails, so its caller's torch path runs. A `*_kernel.py` module holds the compiled code and imports
numba; its wrapper imports it only when the kernel is first used. Nothing here imports the loop or the drafters."""
