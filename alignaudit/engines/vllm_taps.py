"""Where the canonical ops live in vLLM's Qwen3ForCausalLM (vllm/model_executor/models/qwen3.py, qwen2.py).

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

from alignaudit.taps import CURRENT_LAYER, FLAT, Blocks, HookPoint, Hooks, RowSpan, Same, Tap


class StepRows:
    """Maps the flattened rows of each vLLM step to (sequence, position), by token ids and positions."""

    def __init__(self, sequences: tuple[tuple[int, ...], ...]):
        self.sequences = sequences
        self.next_pos = [0] * len(sequences)

    def spans(self, input_ids, positions) -> list[RowSpan]:
        ids, pos = input_ids.tolist(), positions.tolist()
        spans: list[RowSpan] = []
        current = None
        for row, (p, t) in enumerate(zip(pos, ids)):
            if current is not None and self._continues(current.seq, p, t):
                current = RowSpan(current.seq, current.pos_start, current.length + 1, None, current.row_start)
            else:
                seq = next((s for s in range(len(self.sequences)) if self._continues(s, p, t)), None)
                if seq is None:
                    raise RuntimeError(f"vLLM row {row} (position {p}, token {t}) matches no prompt")
                if current is not None:
                    spans.append(current)
                current = RowSpan(seq, p, 1, None, row)
            self.next_pos[current.seq] = p + 1
        return spans + ([current] if current is not None else [])

    def _continues(self, seq: int, p: int, t: int) -> bool:
        ids = self.sequences[seq]
        return self.next_pos[seq] == p and p < len(ids) and ids[p] == t


def install(model, tap: Tap, sequences: tuple[tuple[int, ...], ...]) -> Hooks:
    """Register every canonical op of ``model`` (vLLM's Qwen3ForCausalLM) on ``tap``."""
    hooks = Hooks()
    core = model.model
    rows = StepRows(sequences)
    state = {}

    def begin_step(module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        tap.spans = rows.spans(input_ids, positions)

    def end_step(module, args, kwargs, output):
        state["base"] = output  # the hidden states compute_logits slices per request

    # Qwen3Model's __call__ is replaced by vLLM's torch.compile wrapper (support_torch_compile), which
    # skips module hooks; the outer Qwen3ForCausalLM takes the same inputs and returns the same tensor.
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
            HookPoint(attn.q_norm, Same("q_norm"), i, FLAT),
            HookPoint(attn.k_norm, Same("k_norm"), i, FLAT),
            HookPoint(attn.o_proj, Same("attn"), i, FLAT, when="pre"),
            HookPoint(attn.o_proj, Same("o_proj"), i, FLAT, index=0),
            HookPoint(layer.post_attention_layernorm, Same("post_attn_norm"), i, FLAT, index=0),
            HookPoint(layer.post_attention_layernorm, Same("attn_residual"), i, FLAT, index=1),
            HookPoint(mlp.gate_up_proj, Blocks(("gate_proj", "up_proj")), i, FLAT, index=0),
            HookPoint(mlp.down_proj, Same("act"), i, FLAT, when="pre"),
            HookPoint(mlp.down_proj, Same("down_proj"), i, FLAT, index=0),
        ]
        rotaries[id(attn.rotary_emb)] = attn.rotary_emb
    for rotary in rotaries.values():
        points += [HookPoint(rotary, Same("q_rope"), CURRENT_LAYER, FLAT, index=0),
                   HookPoint(rotary, Same("k_rope"), CURRENT_LAYER, FLAT, index=1)]
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
