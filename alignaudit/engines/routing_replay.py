"""MoE routing replay (R3, "rollout routing replay"): the trainer's router sends each token to the experts the
rollout engine chose, and weights them with the trainer's own router logits.

The rollout engine's routing arrives as canonical ``routing`` rows (alignaudit.capture.ops: per layer and sequence,
int64 [tokens, top_k], ascending: the set of experts). For each forward pass the adapter lays them out the way its
router flattens tokens (``batch_routing``) and hands them to its router:

- Megatron-Core: its own router replay (megatron/core/transformer/moe/router_replay.py, ``RouterReplay`` with
  ``REPLAY_FORWARD``, enabled by ``TransformerConfig.moe_enable_routing_replay``; Megatron-LM #4256). In
  ``topk_routing_with_score_function`` (moe_utils.py) the replayed ids replace ``torch.topk``'s; for softmax
  routing without pre-softmax (Qwen3's norm_topk_prob) the weights are ``softmax(logits.gather(ids))``: the
  trainer's logits at the replayed experts, softmaxed over those k.
- transformers: ``Qwen3MoeTopKRouter.forward`` (modeling_qwen3_moe.py) with its ``torch.topk`` replaced by the
  replayed ids (``replayed_router_forward``): ``softmax(logits, fp32)`` over every expert, gathered at the
  replayed ids, renormalized to sum 1 when ``norm_topk_prob``; the same formula as transformers' own, with the
  selection taken from the rollout.

Both are the weights R3 uses (arXiv 2510.11370, "Stabilizing MoE Reinforcement Learning by Aligning Training and
Inference Routers": the rollout's routing mask applied to the training logits before the softmax). With top-k
renormalization the two formulas are equal in exact arithmetic (softmax over the k logits = the full softmax's k
probabilities renormalized); they round differently. Both trainers add the chosen experts' outputs in expert
order whatever order the ids come in (Megatron's token dispatcher sorts by expert; transformers' experts loop over
expert indices), so the set is all a replay needs.
"""

from __future__ import annotations

import torch

from alignaudit.errors import InputError

# what each adapter reports in its settings record
MEGATRON_MECHANISM = (
    "megatron.core.transformer.moe.router_replay.RouterReplay (REPLAY_FORWARD): "
    "weights softmax(router logits at the replayed experts)"
)
HF_MECHANISM = (
    "Qwen3MoeTopKRouter with topk replaced by the replayed experts: softmax(router logits, fp32) "
    "gathered at them, renormalized when norm_topk_prob"
)


def check_routing(
    routing: dict[int, dict[int, torch.Tensor]], num_layers: int, top_k: int, num_experts: int, lengths: list[int]
) -> None:
    """Refuse replay data that does not fit the model and batch: ``routing[layer][seq]`` must exist for every
    MoE layer and sequence, int [len(seq), top_k], ids in [0, num_experts), distinct per token.

    Raises:
        InputError: naming the layer and sequence.
    """
    if sorted(routing) != list(range(num_layers)):
        raise InputError(f"routing replay holds layers {sorted(routing)}, the model has {num_layers}")
    for layer, seqs in routing.items():
        for seq, n in enumerate(lengths):
            ids = seqs.get(seq)
            if ids is None or tuple(ids.shape) != (n, top_k):
                raise InputError(
                    f"routing replay layer {layer} sequence {seq}: expected [{n}, {top_k}] expert ids, "
                    f"got {None if ids is None else tuple(ids.shape)}"
                )
            if n and (ids.min() < 0 or ids.max() >= num_experts or (ids.sort(-1).values.diff(dim=-1) == 0).any()):
                raise InputError(
                    f"routing replay layer {layer} sequence {seq}: expert ids outside "
                    f"0..{num_experts - 1} or repeated within a token"
                )


def batch_routing(routing: dict[int, torch.Tensor], rows: list[int], width: int, seq_first: bool) -> torch.Tensor:
    """One layer's replayed experts for one forward pass: int64 [batch * width, top_k] in the order the router
    flattens tokens (batch-major, row j then position t at j * width + t; or ``seq_first``, Megatron's
    [seq, batch]: t * batch + j). ``routing``: sequence -> [len, top_k]; ``rows``: the sequences of the batch,
    right-padded to ``width``. Padding positions get experts 0..top_k-1 (their outputs reach no real token:
    right padding, causal attention, and the MoE routes each token on its own)."""
    top_k = next(iter(routing.values())).shape[1]
    out = torch.arange(top_k, dtype=torch.int64).repeat(len(rows), width, 1)  # [batch, width, top_k]
    for j, r in enumerate(rows):
        ids = routing[r]
        out[j, : ids.shape[0]] = ids.to(torch.int64)
    if seq_first:
        out = out.transpose(0, 1)
    return out.reshape(-1, top_k).contiguous()


def replayed_router_forward(router, targets: dict):
    """A forward for transformers' Qwen3MoeTopKRouter (``router``: weight [E, H], top_k, norm_topk_prob) that
    routes to ``targets["ids"]`` (int64 [tokens, top_k], set per forward pass by the adapter) and returns
    (router logits [tokens, E], weights [tokens, top_k] in the logits' dtype, expert ids), as the original does."""

    def forward(hidden_states):
        hidden_states = hidden_states.reshape(-1, router.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, router.weight)
        ids = targets["ids"].to(logits.device)
        if ids.shape[0] != logits.shape[0]:
            raise RuntimeError(f"routing replay: {ids.shape[0]} rows of expert ids for {logits.shape[0]} tokens")
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        weights = probs.gather(-1, ids)
        if router.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), ids

    return forward
