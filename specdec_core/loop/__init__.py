"""The decode loop: `batch_decode` (the one continuous-batching loop: admit, prefill, propose, verify, commit),
`kv_cache` (the engine-owned cache), `prefill_plan` and `prefix_cache` (how prompts are fed), `speculation_budget`
(how much of each draft a step verifies), `verification` (the one verifier), `draft_tree`, `sampling` and
`metrics`. It drives the model (`specdec_core/model/`) and the drafters (`specdec_core/drafters/`)."""
