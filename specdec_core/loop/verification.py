"""The one verification module: decides how much of a draft the target accepts, given ONE target forward.

Vocabulary (as in vLLM's rejection sampler):
  accepted tokens  - the draft prefix the target agrees with;
  recovered token  - drawn by the target at the first rejected position (greedy: its argmax; sampling: a draw from
                     the residual max(0, p - q), renormalised);
  bonus token      - drawn from the target after the last draft token when the whole draft is accepted.
Every verifier returns (num_accepted, next_token) where next_token is the recovered or the bonus token, so each
step emits num_accepted + 1 tokens.

Lossless: greedy verification reproduces the target's argmax sequence exactly; the sampling verifiers reproduce the
target distribution p exactly (Leviathan et al. 2023, Thm. 1), whatever the draft distribution q. Drafts without
probabilities (copying, lookup) are one-hot q: the target's own draw at each position is compared with the draft
(accepts x with probability p(x); a rejection emits a draw from p with x removed), one draw per emitted token.

Where draws come from (sampling.py): a one-hot row's draws are by position (sampling.PositionDraws), so they do not
depend on how wide the step was; a row verified against a draft's probabilities uses its torch.Generator. The
`generator` arguments below take either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .draft_tree import children_of, depths
from ..errors import BadRequestError
from .sampling import PositionDraws, SamplingParams, logits_to_probs, next_uniform, sample


@dataclass(frozen=True)
class ConditionalRule:
    """CASD's conditional verification (lossy, greedy only; CASD paper eq. 3 and 4): a draft node is accepted when
    its parent was and p(token | its path) > max(delta, p(EOS | its path)), and with top_k also when the token is
    among the top_k of that distribution. p(EOS) of a model with several EOS ids is their summed probability (the
    chance that the answer ends here). The deepest accepted node wins (the earliest on ties); the next token is the
    argmax after it."""

    delta: float = 0.1
    top_k: int | None = None
    eos_ids: tuple[int, ...] = ()


def check_rule(rule: ConditionalRule | None, sampling: SamplingParams) -> None:
    """A request verified by the conditional rule must decode greedily (BadRequestError otherwise)."""
    if rule is not None and not sampling.greedy:
        raise BadRequestError("casd and casd_mixed verify by a lossy rule defined for greedy decoding only: use "
                              "temperature 0, or casd_strict to sample")


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int  # accepted draft tokens, 0..len(draft) (a tree: the accepted path's length)
    next_token: int  # recovered token (after a rejection) or bonus token (whole draft accepted)
    path: tuple[int, ...] | None = None  # a tree: accepted draft indices, root to leaf (a chain: 0..num_accepted-1)

    def accepted_indices(self) -> list[int]:
        return list(self.path) if self.path is not None else list(range(self.num_accepted))


def accept_greedy(draft_tokens: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """Longest draft prefix equal to the target's argmax ([k + 1] ids) -> (num_accepted, next_token). The batched
    loop calls this per row after one argmax over the whole batch's [N, vocab] logits."""
    num_accepted = 0
    for drafted, wanted in zip(draft_tokens, target_argmax):
        if drafted != wanted:
            break
        num_accepted += 1
    return num_accepted, target_argmax[num_accepted]


NO_TOKEN = -1  # past the known tokens: no draft token equals it, so greedy acceptance stops there


def greedy_accepted(draft, known: Sequence[int]) -> int:
    """How many of a Draft's tokens greedy verification accepts when the target's tokens after the pending one are
    known in advance (a greedy output being replayed, or what a step committed): known[d] follows depth d of the
    path; nothing past them is accepted."""
    if not draft.tokens:
        return 0
    wanted = [*known[:draft.max_depth + 1], *[NO_TOKEN] * (draft.max_depth + 1 - len(known))]  # [depth + 1]
    if draft.parents is not None:
        return verify_tree_greedy(draft.parents, draft.tokens,
                                  [wanted[0]] + [wanted[d] for d in depths(draft.parents)]).num_accepted
    return accept_greedy(draft.tokens, wanted)[0]


def verify_greedy(draft_tokens: list[int], target_logits: torch.Tensor) -> VerifyResult:
    """Accept the longest draft prefix equal to the target's argmax; target_logits is [k + 1, vocab]."""
    return VerifyResult(*accept_greedy(draft_tokens, torch.argmax(target_logits, dim=-1).tolist()))


def verify_speculative_sampling(
    draft_tokens: list[int],
    target_probs: torch.Tensor,
    generator: torch.Generator | PositionDraws,
    draft_probs: torch.Tensor | None = None,
) -> VerifyResult:
    """Leviathan speculative sampling; names follow the paper: p = target, q = draft.

    target_probs: [k + 1, vocab] p(. | prefix, x_1..x_i) for i = 0..k.
    draft_probs:  [k, vocab] q(. | ...) the drafter sampled x_i from, or None for one-hot drafts (q = delta_x).
    """
    if draft_probs is None:
        return _verify_one_hot_chain(draft_tokens, target_probs, generator)
    if isinstance(generator, PositionDraws):  # two numbers a position here: position draws would misalign
        raise TypeError("verification against a draft's probabilities draws with the request's generator")
    vocab = target_probs.shape[-1]
    for i, x in enumerate(draft_tokens):
        p = target_probs[i]  # [vocab]
        # A drafter token the target cannot emit has p(x) = 0: always rejected, and the replacement still comes
        # from the residual max(p - q, 0) over the target's vocabulary (q's mass on x is what made x likely).
        p_x = float(p[x]) if x < vocab else 0.0
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        # accept with probability min(1, p(x) / q(x))
        if q_x > 0 and next_uniform(generator) * q_x < p_x:
            continue
        if draft_probs is None:
            residual = p.clone()
            if x < vocab:
                residual[x] = 0.0  # max(0, p - delta_x)
        else:
            q = _match_width(draft_probs[i], vocab)
            residual = torch.clamp(p - q, min=0.0)
        total = float(residual.sum())
        # total == 0 only when p == q (then rejection has probability 0): fall back to p for float safety.
        return VerifyResult(i, sample(residual / total if total > 0 else p, generator))
    return VerifyResult(len(draft_tokens), sample(target_probs[len(draft_tokens)], generator))


def _verify_one_hot_chain(draft_tokens: list[int], target_probs: torch.Tensor,
                          generator: torch.Generator | PositionDraws) -> VerifyResult:
    """One-hot drafts (copying, lookup): draw the target's token at each position and accept the draft token while
    the draws equal it. P(accept x) = p(x), and a rejected position emits a draw from p given that it is not x, i.e.
    the residual max(0, p - delta_x) renormalised: the same law as the accept-with-p(x)-then-resample rule. Unlike
    that rule it takes exactly one draw per emitted token, so a seeded row's draws line up with its positions
    whatever width the batch verified it at: where its probabilities do not change with the step (fp32, or bf16
    with --deterministic) the row samples the same tokens alone, inside any batch, and as `ar` does."""
    for i, x in enumerate(draft_tokens):
        drawn = sample(target_probs[i], generator)
        if drawn != x:
            return VerifyResult(i, drawn)
    return VerifyResult(len(draft_tokens), sample(target_probs[len(draft_tokens)], generator))


def _match_width(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """Same-tokenizer drafters may pad their embedding matrix differently from the target."""
    if q.shape[-1] == vocab:
        return q
    if q.shape[-1] > vocab:
        return q[:vocab]
    return torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))


def verify(
    draft_tokens: list[int],
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | PositionDraws,
    draft_probs: torch.Tensor | None = None,
) -> VerifyResult:
    """Dispatch on the request's sampling mode; target_logits is [k + 1, vocab] from one target forward."""
    if params.greedy:
        return verify_greedy(draft_tokens, target_logits)
    target_probs = logits_to_probs(target_logits, params)  # [k + 1, vocab]
    return verify_speculative_sampling(draft_tokens, target_probs, generator, draft_probs)


# ----------------------------------------------------------------------------------------------------- trees
# A tree's logits are per node (node 0 = the pending token, node i + 1 = draft token i; see draft_tree.py): the
# distribution of what follows that node's path.

def verify_tree_greedy(parents: list[int], draft_tokens: list[int], node_argmax: list[int]) -> VerifyResult:
    """Walk from the root, each step into the child whose token is the target's argmax; node_argmax is [k + 1]."""
    children = children_of(parents)
    node, path = 0, []
    while True:
        wanted = node_argmax[node]
        match = next((c for c in children.get(node, ()) if draft_tokens[c - 1] == wanted), None)
        if match is None:
            return VerifyResult(len(path), wanted, tuple(path))
        path.append(match - 1)
        node = match


def verify_tree_sampling(parents: list[int], draft_tokens: list[int], node_probs: torch.Tensor,
                         generator: torch.Generator | PositionDraws) -> VerifyResult:
    """Multi-candidate speculative sampling for one-hot (copied) branches, exact in distribution.

    At each node draw the target's token from p(. | node's path) and move into the child carrying it; a draw no
    child carries is emitted and ends the step. Each token x comes out with probability p(x), as the multi-draft
    rule of SpecInfer (accept x_j with r(x_j) / sum(r), r = p with rejected candidates zeroed) gives for one-hot
    branches; one draw per emitted token keeps a seeded row's draws aligned with its positions (see
    `_verify_one_hot_chain`).
    """
    children = children_of(parents)
    node, path = 0, []
    while True:
        drawn = sample(node_probs[node], generator)
        match = next((c for c in children.get(node, ()) if draft_tokens[c - 1] == drawn), None)
        if match is None:
            return VerifyResult(len(path), drawn, tuple(path))
        path.append(match - 1)
        node = match


def verify_conditional(parents: list[int] | None, draft_tokens: list[int], node_logits: torch.Tensor,
                       rule: ConditionalRule) -> VerifyResult:
    """node_logits [k + 1, vocab] (a chain is the tree whose node i's parent is i - 1)."""
    parents = parents if parents is not None else list(range(-1, len(draft_tokens) - 1))
    probs = torch.softmax(node_logits.float(), dim=-1)  # [k + 1, vocab]
    vocab = probs.shape[-1]
    eos = [i for i in rule.eos_ids if i < vocab]
    floor = probs[:, eos].sum(dim=-1).clamp(min=rule.delta) if eos else torch.full((len(probs),), rule.delta)
    accepted = [True] + [False] * len(draft_tokens)  # per node; node 0 (the pending token) is already in
    depth = [0] * (len(draft_tokens) + 1)
    for i, (token, parent) in enumerate(zip(draft_tokens, parents)):
        node, above = i + 1, parent + 1
        if not accepted[above] or token >= vocab:
            continue
        p = probs[above, token]
        ok = bool(p > floor[above])
        if ok and rule.top_k is not None:
            ok = int((probs[above] > p).sum()) < rule.top_k
        if ok:
            accepted[node], depth[node] = True, depth[above] + 1
    last = max(range(len(accepted)), key=lambda n: (accepted[n] and depth[n], -n))
    path = []
    node = last
    while node > 0:
        path.append(node - 1)
        node = parents[node - 1] + 1
    path.reverse()
    return VerifyResult(len(path), int(torch.argmax(probs[last])), tuple(path))


# ----------------------------------------------------------------------------------------------------- a batch
def accept_greedy_chains(step_ids: torch.Tensor, real: torch.Tensor, argmax: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                      torch.Tensor]:
    """accept_greedy for every row of a step at once. step_ids [B, T]: each row's pending token and draft tokens
    (padding after them), real [B, T]: which nodes are the row's, argmax [N]: the target's argmax after each real
    node, row by row -> (num_accepted [B], next_token [B]). Rows that are trees get meaningless values here."""
    grid = torch.full(step_ids.shape, -1, dtype=argmax.dtype, device=argmax.device)  # [B, T]
    grid.masked_scatter_(real.to(argmax.device), argmax)  # grid[b, t]: the argmax after node t of row b
    agrees = (step_ids[:, 1:].to(argmax.device) == grid[:, :-1]) & real[:, 1:].to(argmax.device)  # [B, T - 1]
    num_accepted = agrees.long().cumprod(dim=1).sum(dim=1)  # [B]: the longest agreeing prefix
    return num_accepted, grid.gather(1, num_accepted[:, None])[:, 0]


def accept_greedy_nodes(step_ids: torch.Tensor, visible: torch.Tensor, depth: torch.Tensor,
                        argmax: torch.Tensor) -> torch.Tensor:
    """Greedy verification of every row of a step, chains and trees alike, in tensor operations of fixed shapes (no
    device-to-host copy, no shape read from the data: a captured step runs it, graph_step.py).

    step_ids [B, T]  each row's pending token and draft nodes (padding after them)
    visible  [B, T, T] bool  node t sees node i (its ancestors and itself); a padding node sees only itself
    depth    [B, T]  each node's depth (0: the pending token)
    argmax   [B, T]  the target's argmax after each node
    -> [B, 3] int64: (accepted draft tokens, the last accepted node, the next token after it), as
    verify_tree_greedy walks it: into the first child whose token is its parent's argmax."""
    rows, width = step_ids.shape
    nodes = torch.arange(width, device=step_ids.device)
    real = visible.diagonal(dim1=1, dim2=2)  # [B, T]
    # a node's parent: the ancestor one level up (the pending token is its own)
    above = visible & (nodes[None, None, :] != nodes[None, :, None])  # [B, T, T]: strict ancestors
    parent = torch.where(above, depth[:, None, :], -1).argmax(dim=2)  # [B, T]
    matches = (step_ids == argmax.gather(1, parent)) & real  # [B, T]: the token its parent's argmax names
    matches[:, 0] = True
    # of siblings that match (the same token twice), only the first counts
    earlier = (nodes[None, :] < nodes[:, None]) & (nodes[None, :] > 0)  # [T, T]: draft node i comes before node t
    sibling = (parent[:, :, None] == parent[:, None, :]) & earlier  # [B, T, T]
    first = matches & ~(sibling & matches[:, None, :]).any(dim=2)
    accepted = first & ~(visible & ~first[:, None, :]).any(dim=2)  # [B, T]: every node on its path matches
    reach = torch.where(accepted, depth, -1)  # [B, T]
    last = reach.argmax(dim=1)  # [B]: the deepest accepted node (one per depth)
    return torch.stack([reach.gather(1, last[:, None])[:, 0], last, argmax.gather(1, last[:, None])[:, 0]], dim=1)


def verify_rows(drafts: list, logits: torch.Tensor, sampling: list[SamplingParams],
                generators: list[torch.Generator | PositionDraws], step_ids: torch.Tensor | None = None,
                rules: list[ConditionalRule | None] | None = None) -> list[VerifyResult]:
    """Verify every row of a batched step. logits [N, vocab]: row r's k_r + 1 rows, in row order (chain: after the
    pending token and each draft token; tree: per node). Greedy rows share one argmax over the whole [N, vocab];
    with step_ids ([B, T], the step's input ids before any are replaced) greedy chains are verified as one tensor
    operation, and the step copies one tensor to the host. Sampling rows use their own draws (a row's
    PositionDraws, or its generator where its draft has probabilities), so a seeded row draws the same numbers
    whatever shares its batch. rules: each row's lossy rule (None: exact; default all); a row with no draft takes
    the target's greedy token under any rule, from the shared argmax."""
    argmax = torch.argmax(logits, dim=-1)  # [N]
    chains = None
    if step_ids is not None and step_ids.shape[1] == 1:  # no row drafted: a greedy row takes its argmax
        flat = argmax.tolist()
        chains = [(0, token) for token in flat]
    elif step_ids is not None:
        counts = torch.tensor([1 + len(draft.tokens) for draft in drafts])  # [B]
        real = torch.arange(step_ids.shape[1])[None, :] < counts[:, None]  # [B, T]
        num_accepted, next_token = accept_greedy_chains(step_ids, real, argmax)
        on_host = torch.cat([argmax, num_accepted, next_token]).tolist()  # the step's one device-to-host copy
        rows = len(drafts)
        flat, chains = on_host[:len(argmax)], list(zip(on_host[-2 * rows:-rows], on_host[-rows:]))
    else:
        flat = argmax.tolist()
    results, offset = [], 0
    for row, (draft, params, generator) in enumerate(zip(drafts, sampling, generators)):
        count = 1 + len(draft.tokens)
        rule = rules[row] if rules is not None else None
        if rule is not None and draft.tokens:  # CASD's lossy conditional verification (greedy-only requests)
            result = verify_conditional(draft.parents, draft.tokens, logits[offset: offset + count], rule)
        elif params.greedy:
            if draft.parents is None:
                result = VerifyResult(*(chains[row] if chains is not None
                                        else accept_greedy(draft.tokens, flat[offset: offset + count])))
            else:
                result = verify_tree_greedy(draft.parents, draft.tokens, flat[offset: offset + count])
        elif draft.parents is None:
            result = verify(draft.tokens, logits[offset: offset + count], params, generator, draft.probs)
        else:
            probs = logits_to_probs(logits[offset: offset + count], params)  # [k + 1, vocab]
            result = verify_tree_sampling(draft.parents, draft.tokens, probs, generator)
        results.append(result)
        offset += count
    return results
