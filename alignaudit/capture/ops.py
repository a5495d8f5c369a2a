"""The canonical ops that bisect walks, in topological order, and the ``--layers`` / ``--ops`` selection.

Every engine's hook points are mapped onto these names (engines/*_taps.py). Each captured tensor is stored
per sequence in a canonical layout, whatever the engine's own layout:
    hidden   [tokens, hidden_size]
    q_heads  [tokens, num_heads, head_dim]
    kv_heads [tokens, num_kv_heads, head_dim]
    ffn      [tokens, intermediate_size]
    experts  [tokens, num_experts]       router logits
    routing  [tokens, experts_per_token] the chosen experts, int64, ascending (the set, not the order)
    vocab    [tokens, vocab_size]
Op ids are ``embed``, ``layers.{i}.{name}`` for per-layer ops, ``final_norm``, ``logits``; ``logprobs``
(fp32, [tokens - 1]) comes from the capture's logprob table. A model's op list (``OpGraph``) drops
q_norm/k_norm without QK-norm and, in a mixture-of-experts model, has router/routing/moe where a dense
layer has gate_proj/up_proj/act/down_proj.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from alignaudit.errors import InputError


@dataclass(frozen=True)
class OpDef:
    name: str
    layout: str
    inputs: tuple[str, ...]  # canonical ops (same layer unless prefixed) whose outputs this op consumes
    what: str
    # Forced mode may replace the engine's value by the reference's. The router's logits and the routing
    # decision are read only: every engine routes inside the call that computes the logits (or from a
    # value no hook can replace), so replacing either would claim a substitution that did not happen.
    replaceable: bool = True


LAYER_OPS: tuple[OpDef, ...] = (
    OpDef("input_norm", "hidden", ("residual_in",), "RMSNorm before attention"),
    OpDef("q_proj", "q_heads", ("input_norm",), "query projection"),
    OpDef("k_proj", "kv_heads", ("input_norm",), "key projection"),
    OpDef("v_proj", "kv_heads", ("input_norm",), "value projection"),
    OpDef("q_norm", "q_heads", ("q_proj",), "per-head RMSNorm of queries (QK-norm)"),
    OpDef("k_norm", "kv_heads", ("k_proj",), "per-head RMSNorm of keys (QK-norm)"),
    OpDef("q_rope", "q_heads", ("q_norm",), "rotary embedding of queries"),
    OpDef("k_rope", "kv_heads", ("k_norm",), "rotary embedding of keys"),
    OpDef("attn", "q_heads", ("q_rope", "k_rope", "v_proj"), "core attention (softmax(qk^T)v), before o_proj"),
    OpDef("o_proj", "hidden", ("attn",), "attention output projection"),
    OpDef("attn_residual", "hidden", ("residual_in", "o_proj"), "residual add after attention"),
    OpDef("post_attn_norm", "hidden", ("attn_residual",), "RMSNorm before the MLP"),
    OpDef("gate_proj", "ffn", ("post_attn_norm",), "gate projection"),
    OpDef("up_proj", "ffn", ("post_attn_norm",), "up projection"),
    OpDef("act", "ffn", ("gate_proj", "up_proj"), "silu(gate) * up"),
    OpDef("down_proj", "hidden", ("act",), "down projection"),
    OpDef("mlp_residual", "hidden", ("attn_residual", "down_proj"), "residual add after the MLP (layer output)"),
)
DENSE_MLP_OPS = frozenset({"gate_proj", "up_proj", "act", "down_proj"})
# A mixture-of-experts layer (Qwen3 MoE): these stand where the dense MLP ops stand.
MOE_OPS: tuple[OpDef, ...] = (
    OpDef("router", "experts", ("post_attn_norm",), "router logits (x @ W_router^T)", replaceable=False),
    OpDef(
        "routing", "routing", ("router",), "the experts each token is sent to (top-k of the router)", replaceable=False
    ),
    # The whole layer, routing included, computes from post_attn_norm: forced mode gives every engine the
    # reference's input there, and moe's difference is the layer's own (routing flips included).
    OpDef(
        "moe",
        "hidden",
        ("post_attn_norm",),
        "the MoE layer output (the chosen experts' SwiGLU MLPs, weighted and summed)",
    ),
)
PRE_OPS: tuple[OpDef, ...] = (OpDef("embed", "hidden", (), "token embedding"),)
POST_OPS: tuple[OpDef, ...] = (
    OpDef("final_norm", "hidden", ("mlp_residual",), "final RMSNorm"),
    OpDef("logits", "vocab", ("final_norm",), "lm_head"),
)
LOGPROBS = "logprobs"
OP_NAMES: tuple[str, ...] = tuple(o.name for o in (*PRE_OPS, *LAYER_OPS, *MOE_OPS, *POST_OPS)) + (LOGPROBS,)
OP_DEFS: dict[str, OpDef] = {o.name: o for o in (*PRE_OPS, *LAYER_OPS, *MOE_OPS, *POST_OPS)}


def op_id(name: str, layer: int | None = None) -> str:
    return name if layer is None else f"layers.{layer}.{name}"


def split_op_id(op: str) -> tuple[str, int | None]:
    """``"layers.3.q_proj"`` -> ``("q_proj", 3)``; ``"embed"`` -> ``("embed", None)``."""
    if op.startswith("layers."):
        _, layer, name = op.split(".", 2)
        return name, int(layer)
    return op, None


QK_NORM_OPS = frozenset({"q_norm", "k_norm"})


@dataclass(frozen=True)
class OpGraph:
    """The canonical ops of one model, in topological order, and what each consumes.

    ``qk_norm``: q_norm/k_norm exist (Qwen3); without them rope reads q_proj/k_proj. ``moe``: every layer's
    MLP is a mixture of experts (router, routing, moe instead of gate_proj, up_proj, act, down_proj).
    """

    num_layers: int
    qk_norm: bool = True
    moe: bool = False

    @classmethod
    def of(cls, spec) -> OpGraph:
        """The graph of a ModelSpec (or its to_dict() record, as stored in a capture's manifest)."""

        def get(name: str, default: object = None) -> Any:
            return spec.get(name, default) if isinstance(spec, dict) else getattr(spec, name, default)

        return cls(get("num_layers"), bool(get("qk_norm", True)), bool(get("num_experts", 0)))

    def layer_ops(self) -> tuple[OpDef, ...]:
        ops = [o for o in LAYER_OPS if self.qk_norm or o.name not in QK_NORM_OPS]
        if self.moe:
            at = next(i for i, o in enumerate(ops) if o.name in DENSE_MLP_OPS)
            ops = ops[:at] + list(MOE_OPS) + [o for o in ops[at:] if o.name not in DENSE_MLP_OPS]
        return tuple(ops)

    def names(self) -> tuple[str, ...]:
        """The op names this model has (for --ops)."""
        return tuple(o.name for o in (*PRE_OPS, *self.layer_ops(), *POST_OPS)) + (LOGPROBS,)

    def op_ids(self) -> list[str]:
        """Every op id, in topological order, logprobs last."""
        ids = [o.name for o in PRE_OPS]
        for i in range(self.num_layers):
            ids += [op_id(o.name, i) for o in self.layer_ops()]
        return ids + [o.name for o in POST_OPS] + [LOGPROBS]

    def inputs(self, op: str) -> list[str]:
        """Op ids whose outputs ``op`` consumes (``residual_in`` is the previous layer's output or embed;
        without QK-norm rope reads the projection; in an MoE layer the residual add reads ``moe``)."""
        if op == LOGPROBS:
            return ["logits"]
        name, layer = split_op_id(op)
        inputs = []
        for source in OP_DEFS[name].inputs:
            if source in QK_NORM_OPS and not self.qk_norm:
                source = OP_DEFS[source].inputs[0]
            if source == "down_proj" and self.moe:
                source = "moe"
            if source == "residual_in":
                assert layer is not None, f"{op}: residual_in feeds layer ops only"
                inputs.append("embed" if layer == 0 else op_id("mlp_residual", layer - 1))
            elif name == "final_norm":
                inputs.append(op_id(source, self.num_layers - 1))
            else:
                inputs.append(op_id(source, layer))
        return inputs


def replaceable(op: str) -> bool:
    """Whether forced mode replaces ``op``'s value in the engine (OpDef.replaceable); logprobs: no."""
    name, _ = split_op_id(op)
    return name in OP_DEFS and OP_DEFS[name].replaceable


@dataclass(frozen=True)
class Selection:
    """Which ops to capture: ``layers`` x ``names`` (None = all), plus explicit op ids in ``extra``."""

    layers: frozenset[int] | None = None
    names: frozenset[str] | None = None
    extra: frozenset[str] = frozenset()

    def wants(self, op: str) -> bool:
        if op in self.extra:
            return True
        name, layer = split_op_id(op)
        if self.names is not None and name not in self.names:
            return False
        return layer is None or self.layers is None or layer in self.layers

    def op_ids(self, graph: OpGraph) -> list[str]:
        return [op for op in graph.op_ids() if self.wants(op)]

    def with_inputs(self, graph: OpGraph) -> Selection:
        """This selection plus the ops that feed each selected op (what forced mode must substitute)."""
        extra = set(self.extra)
        for op in self.op_ids(graph):
            extra.update(graph.inputs(op))
        return Selection(self.layers, self.names, frozenset(extra))

    def to_dict(self) -> dict:
        return {
            "layers": sorted(self.layers) if self.layers is not None else None,
            "names": sorted(self.names) if self.names is not None else None,
            "extra": sorted(self.extra),
        }

    @classmethod
    def from_dict(cls, d: dict | None) -> Selection:
        d = d or {}
        layers, names = d.get("layers"), d.get("names")
        return cls(
            frozenset(layers) if layers is not None else None,
            frozenset(names) if names is not None else None,
            frozenset(d.get("extra", ())),
        )


def parse_selection(layers: str | None, ops: str | None, graph: OpGraph) -> Selection:
    """Parse ``--layers 0-3,7`` and ``--ops attn,o_proj`` against a model's ``graph``.

    Raises:
        InputError: malformed ranges, layers outside [0, num_layers), unknown op names, ops the model does
            not have (q_norm/k_norm without QK-norm, the dense MLP ops in an MoE model and the reverse).
    """
    num_layers = graph.num_layers
    chosen_layers = None
    if layers:
        chosen: set[int] = set()
        for part in layers.split(","):
            lo, sep, hi = part.strip().partition("-")
            try:
                start, end = int(lo), int(hi) if sep else int(lo)
            except ValueError:
                raise InputError(f"--layers {layers!r}: expected a list of layers and ranges such as 0-3,7") from None
            if start > end:
                raise InputError(f"--layers {layers!r}: range {part.strip()} runs backwards; write {end}-{start}")
            if not 0 <= start <= end < num_layers:
                raise InputError(f"--layers {layers!r}: the model has layers 0-{num_layers - 1}")
            chosen.update(range(start, end + 1))
        chosen_layers = frozenset(chosen)
    chosen_names = None
    if ops:
        names = {n.strip() for n in ops.split(",") if n.strip()}
        unknown = sorted(names - set(OP_NAMES))
        if unknown:
            raise InputError(f"--ops: unknown op(s) {', '.join(unknown)}; this model's ops: {', '.join(graph.names())}")
        absent = sorted(names & QK_NORM_OPS) if not graph.qk_norm else []
        if absent:
            raise InputError(
                f"--ops {', '.join(absent)}: this model has no QK-norm (Qwen3 has); its rope reads "
                "q_proj/k_proj directly"
            )
        absent = sorted(names - set(graph.names()))
        if absent:
            kind = "a mixture of experts" if graph.moe else "a dense MLP"
            raise InputError(
                f"--ops {', '.join(absent)}: this model's layers have {kind}; its ops: {', '.join(graph.names())}"
            )
        chosen_names = frozenset(names)
    return Selection(chosen_layers, chosen_names)
