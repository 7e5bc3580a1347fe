"""The model: `model_runner` (loading, dtype and device, the slot forward every decoder drives), `fast_forward` (the
forward of Llama-family models over the owned cache), `grouped_attention` and `attention_masks` (which attention a
forward takes), `lm_head`, `int8_linear`, `ragged_tokens`, `target_signals` (what drafters may read of a forward),
`attention_probe`, and `model_registry` and `hardware` (which weights, which device and dtype). It calls the kernels
in `specdec_core/kernels/`."""
