"""Where the canonical ops live in vLLM's dense decoders (vllm/model_executor/models/qwen3.py, qwen2.py,
llama.py: the same module names in each; q_norm/k_norm in Qwen3 only; qwen3_moe.py, whose MLP is a
Qwen3MoeSparseMoeBlock: ``gate`` returns (router logits, None), the fused MoE's router reports the expert
ids it chose to ``capture_fn`` (the hook vLLM's routed-experts capture uses), the block returns the moe op;
under --strict its ``strict_router`` returns (logits, expert ids, weights)).

All requests of a step are flattened into [tokens, ...]; the rows of each request are found from the
step's ``input_ids`` and ``positions`` (``StepRows``). Linears return (output, None); ``qkv_proj`` is
[q | k | v] and ``gate_up_proj`` [gate | up]. RMSNorm with a residual is fused: it returns
(normed, x + residual) and writes into its inputs, so the residual stream is read from its second
output: layer i's ``post_attention_layernorm`` gives attn_residual of layer i, layer i+1's
``input_layernorm`` (or the final ``norm``) gives mlp_residual of layer i. One rotary_emb module is
shared by all layers and works in place. Logits are read from the per-request ``compute_logits`` calls
of the prompt-logprob path, whose inputs are row slices of the model output.
"""

from __future__ import annotations

from alignaudit.capture.ops import OpGraph, op_id, split_op_id
from alignaudit.engines.taps import CURRENT_LAYER, FLAT, Blocks, HookPoint, Hooks, Routing, RowSpan, Same, Tap


def real_inputs(op: str, graph: OpGraph) -> list[str]:
    """The ops vLLM really computes ``op`` from. Its fused add+RMSNorm takes the sublayer output and the
    previous residual and normalizes their sum internally, so a norm that follows a residual add reads
    (o_proj or down_proj, previous residual), not the canonical residual op, and forcing the residual op
    (an output of the same fused call) does not reach it."""
    name, layer = split_op_id(op)
    if name == "final_norm":
        return graph.inputs(op_id("mlp_residual", graph.num_layers - 1))
    if layer is None:  # embed and the ops after the last layer
        return graph.inputs(op)
    if name == "post_attn_norm":
        return graph.inputs(op_id("attn_residual", layer))
    if name == "input_norm" and layer > 0:
        return graph.inputs(op_id("mlp_residual", layer - 1))
    return graph.inputs(op)


class StepRows:
    """Maps the flattened rows of each vLLM step to (sequence, position), by token ids and positions.

    A step holds, in scheduler order, a run of consecutive positions per request (all of a prompt, or a
    chunk of it under chunked prefill). At each run start, the request whose next expected position is the
    row's position and whose ids match the most upcoming rows wins, so prompts sharing a prefix are told
    apart by where they stop matching.
    """

    def __init__(self, sequences: tuple[tuple[int, ...], ...]):
        self.sequences = sequences
        self.next_pos = [0] * len(sequences)

    def spans(self, input_ids, positions) -> list[RowSpan]:
        ids, pos = input_ids.tolist(), positions.tolist()
        spans: list[RowSpan] = []
        row = 0
        while row < len(ids):
            lengths = [self._match_length(s, ids, pos, row) for s in range(len(self.sequences))]
            best = max(range(len(lengths)), key=lengths.__getitem__, default=None)
            if best is None or lengths[best] == 0:
                raise RuntimeError(f"vLLM row {row} (position {pos[row]}, token {ids[row]}) matches no prompt")
            spans.append(RowSpan(best, pos[row], lengths[best], None, row))
            self.next_pos[best] = pos[row] + lengths[best]
            row += lengths[best]
        return spans

    def _match_length(self, seq: int, ids: list[int], pos: list[int], row: int) -> int:
        prompt, start = self.sequences[seq], pos[row]
        if self.next_pos[seq] != start:
            return 0
        k = 0
        while (
            row + k < len(ids)
            and pos[row + k] == start + k
            and start + k < len(prompt)
            and prompt[start + k] == ids[row + k]
        ):
            k += 1
        return k


def install(model, tap: Tap, sequences: tuple[tuple[int, ...], ...]) -> Hooks:
    """Register every canonical op of ``model`` (a vLLM dense decoder) on ``tap``."""
    hooks = Hooks()
    graph = OpGraph.of(tap.spec)
    tap.real_inputs = lambda op: real_inputs(op, graph)
    core = model.model
    rows = StepRows(sequences)
    state = {}

    def begin_step(module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        tap.spans = rows.spans(input_ids, positions)

    def end_step(module, args, kwargs, output):
        state["base"] = output  # the hidden states compute_logits slices per request

    # The inner model's __call__ is replaced by vLLM's torch.compile wrapper (support_torch_compile), which
    # skips module hooks; the outer *ForCausalLM takes the same inputs and returns the same tensor.
    hooks.raw(model, begin_step, pre=True, with_kwargs=True)
    hooks.raw(model, end_step, with_kwargs=True)

    layers = list(core.layers)
    last = len(layers) - 1
    points = [HookPoint(core.embed_tokens, Same("embed"), None, FLAT)]
    rotaries = {}
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        hooks.raw(layer, lambda module, args, i=i: setattr(tap, "layer", i), pre=True)
        points.append(HookPoint(layer.input_layernorm, Same("input_norm"), i, FLAT, index=None if i == 0 else 0))
        if i > 0:
            points.append(HookPoint(layer.input_layernorm, Same("mlp_residual"), i - 1, FLAT, index=1))
        points += [
            HookPoint(attn.qkv_proj, Blocks(("q_proj", "k_proj", "v_proj")), i, FLAT, index=0),
            *(
                [HookPoint(attn.q_norm, Same("q_norm"), i, FLAT), HookPoint(attn.k_norm, Same("k_norm"), i, FLAT)]
                if hasattr(attn, "q_norm")
                else []
            ),
            HookPoint(attn.o_proj, Same("attn"), i, FLAT, when="pre"),
            HookPoint(attn.o_proj, Same("o_proj"), i, FLAT, index=0),
            HookPoint(layer.post_attention_layernorm, Same("post_attn_norm"), i, FLAT, index=0),
            HookPoint(layer.post_attention_layernorm, Same("attn_residual"), i, FLAT, index=1),
            *_mlp_points(hooks, tap, mlp, i),
        ]
        rotaries[id(attn.rotary_emb)] = attn.rotary_emb
    for rotary in rotaries.values():
        points += [
            HookPoint(rotary, Same("q_rope"), CURRENT_LAYER, FLAT, index=0),
            HookPoint(rotary, Same("k_rope"), CURRENT_LAYER, FLAT, index=1),
        ]
    points += [
        HookPoint(core.norm, Same("final_norm"), None, FLAT, index=0),
        HookPoint(core.norm, Same("mlp_residual"), last, FLAT, index=1),
    ]
    for p in points:
        hooks.add(tap, p)

    def logits(module, args, output):
        spans = _slice_spans(tap.spans, state.get("base"), args[1])
        if not spans:
            return None  # the sampling call: rows gathered from the model output, not a slice of it
        return tap(output, Same("logits"), None, FLAT, spans=spans)

    hooks.raw(model.logits_processor, logits)
    return hooks


def _mlp_points(hooks: Hooks, tap: Tap, mlp, layer: int) -> list[HookPoint]:
    """The dense MLP's hook points, or an MoE block's (router and routing read, the output replaceable)."""
    if not hasattr(mlp, "experts"):
        return [
            HookPoint(mlp.gate_up_proj, Blocks(("gate_proj", "up_proj")), layer, FLAT, index=0),
            HookPoint(mlp.down_proj, Same("act"), layer, FLAT, when="pre"),
            HookPoint(mlp.down_proj, Same("down_proj"), layer, FLAT, index=0),
        ]
    if getattr(mlp, "strict_router", None) is not None:
        from alignaudit.engines.custom_ops import ROUTING_OBSERVERS

        def observe(logits, chosen):  # read only: the tap returns no replacement for router and routing
            tap(logits, Same("router"), layer, FLAT)
            tap(chosen, Routing(), layer, FLAT)

        ROUTING_OBSERVERS[layer] = observe
        hooks.defer(lambda: ROUTING_OBSERVERS.pop(layer, None))
    else:
        hooks.raw(mlp.gate, lambda module, args, output: _read(tap, output[0], Same("router"), layer))
        hooks.patch(mlp.experts.router, "capture_fn", lambda ids: _read(tap, ids, Routing(), layer))
    return [HookPoint(mlp, Same("moe"), layer, FLAT)]


def _read(tap: Tap, x, view, layer: int) -> None:
    tap(x, view, layer, FLAT)  # a read-only op: the tap returns no replacement


def _slice_spans(step_spans: list[RowSpan], base, hidden) -> list[RowSpan]:
    """The step spans restricted to ``hidden``, a row slice of ``base``; [] if it is not such a slice."""
    if base is None or hidden.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
        return []
    offset = (hidden.storage_offset() - base.storage_offset()) // base.stride(0)
    end = offset + hidden.shape[0]
    spans = []
    for s in step_spans:
        lo, hi = max(s.row_start, offset), min(s.row_start + s.length, end)
        if lo < hi:
            spans.append(RowSpan(s.seq, s.pos_start + lo - s.row_start, hi - lo, None, lo - offset))
    return spans
