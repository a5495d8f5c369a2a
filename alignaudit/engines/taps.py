"""Engine-independent hook machinery: engine tensors at hook points -> canonical per-sequence chunks.

An engine adapter describes *where* its values live (``HookPoint``: a module, before or after it runs,
which tuple element or argument, which axes hold batch rows and tokens) and *how* its fused tensors
split into canonical ops (``View``). The ``Tap`` does the rest:

- natural mode: record each selected op's rows for every sequence of the current forward pass;
- forced mode (a reference capture given): after recording the engine's own value, overwrite it with
  the reference engine's value for the same op (every op the reference holds, selected or not), so every
  downstream op computes on the reference's inputs and each op's recorded difference is its local
  difference.

The engine adapter keeps ``tap.spans`` current: one ``RowSpan`` per sequence (chunk) in the forward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from alignaudit.capture.op_store import OpRecorder, OpStore
from alignaudit.capture.ops import OP_DEFS, OpGraph, Selection, op_id, replaceable
from alignaudit.engines.layouts import fuse_qkv_grouped, split_qkv_grouped
from alignaudit.inputs.checkpoint import ModelSpec


@dataclass(frozen=True)
class RowSpan:
    """Where one sequence's tokens sit in the engine tensors of the current forward pass.

    ``batch_row`` indexes the batch axis (None when tokens of all sequences are flattened, as in vLLM);
    ``row_start`` is the index of the sequence's first row along the token axis; the rows hold positions
    ``pos_start .. pos_start + length`` of sequence ``seq``.
    """

    seq: int
    pos_start: int
    length: int
    batch_row: int | None = None
    row_start: int = 0


@dataclass(frozen=True)
class Axes:
    """Which axes of an engine tensor are the batch (None: flattened) and the token axis."""

    batch: int | None
    token: int


BATCH_FIRST = Axes(0, 1)  # [batch, tokens, ...]: HF
SEQ_FIRST = Axes(1, 0)  # [tokens, batch, ...]: Megatron
FLAT = Axes(None, 0)  # [tokens of all sequences, ...]: vLLM


def _rows_view(x: torch.Tensor, span: RowSpan, axes: Axes) -> torch.Tensor:
    """A view of ``x`` holding the span's rows, token axis first."""
    token = axes.token
    if axes.batch is not None:
        assert span.batch_row is not None, "a tensor with a batch axis needs each span's batch row"
        x = x.select(axes.batch, span.batch_row)
        token = token if token < axes.batch else token - 1
    return x.narrow(token, span.row_start, span.length).movedim(token, 0)


def take_rows(x: torch.Tensor, span: RowSpan, axes: Axes) -> torch.Tensor:
    return _rows_view(x, span, axes)


def put_rows(x: torch.Tensor, span: RowSpan, axes: Axes, value: torch.Tensor) -> None:
    """Write ``value`` (token axis first) into the span's rows of ``x``, in place."""
    _rows_view(x, span, axes).copy_(value.reshape(_rows_view(x, span, axes).shape))


class View:
    """How engine rows [tokens, ...] split into canonical op tensors, and back."""

    names: tuple[str, ...]

    def split(self, rows: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def join(self, parts: Sequence[torch.Tensor], like: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
        raise NotImplementedError


def canonical(rows: torch.Tensor, layout: str, spec: ModelSpec) -> torch.Tensor:
    """Reshape rows [tokens, ...] to the canonical layout of ``layout`` (see capture/ops.py)."""
    n = rows.shape[0]
    if layout == "q_heads":
        return rows.reshape(n, spec.num_heads, spec.head_dim)
    if layout == "kv_heads":
        return rows.reshape(n, spec.num_kv_heads, spec.head_dim)
    return rows.reshape(n, -1)


@dataclass(frozen=True)
class Same(View):
    """One canonical op, possibly in another shape (e.g. [tokens, heads * head_dim] for q_heads)."""

    name: str

    @property
    def names(self) -> tuple[str, ...]:  # type: ignore[override]  # View's plain attribute, read-only here
        return (self.name,)

    def split(self, rows, spec):
        return (canonical(rows, OP_DEFS[self.name].layout, spec),)

    def join(self, parts, like, spec):
        return parts[0].reshape(like.shape)


@dataclass(frozen=True)
class Blocks(View):
    """Concatenated blocks along the last axis: vLLM's [q | k | v] and [gate | up], Megatron's fc1."""

    names: tuple[str, ...]

    def _sizes(self, spec: ModelSpec) -> list[int]:
        width = {
            "q_heads": spec.num_heads * spec.head_dim,
            "kv_heads": spec.num_kv_heads * spec.head_dim,
            "ffn": spec.intermediate_size,
            "hidden": spec.hidden_size,
        }
        return [width[OP_DEFS[n].layout] for n in self.names]

    def split(self, rows, spec):
        flat = rows.reshape(rows.shape[0], -1)
        return tuple(
            canonical(p, OP_DEFS[n].layout, spec)
            for n, p in zip(self.names, flat.split(self._sizes(spec), -1), strict=True)
        )

    def join(self, parts, like, spec):
        return torch.cat([p.reshape(p.shape[0], -1) for p in parts], dim=-1).reshape(like.shape)


@dataclass(frozen=True)
class GroupedQKV(View):
    """Megatron's linear_qkv output, grouped per query group (layouts.split_qkv_grouped)."""

    names: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")

    def split(self, rows, spec):
        q, k, v = split_qkv_grouped(
            rows.reshape(rows.shape[0], -1), spec.num_heads, spec.num_query_groups, spec.head_dim
        )
        return canonical(q, "q_heads", spec), canonical(k, "kv_heads", spec), canonical(v, "kv_heads", spec)

    def join(self, parts, like, spec):
        q, k, v = (p.reshape(p.shape[0], -1) for p in parts)
        return fuse_qkv_grouped(q, k, v, spec.num_query_groups, dim=-1).reshape(like.shape)


class Routing(View):
    """The experts each token is sent to, as canonical ``routing`` rows (int64, ascending: the set, whatever
    order the engine keeps), from expert ids [tokens, top_k] or a boolean routing map [tokens, num_experts]
    (Megatron's). Read only: no engine takes its routing from a value a hook can replace."""

    names = ("routing",)

    def split(self, rows, spec):
        if rows.dtype == torch.bool:
            rows = rows.nonzero(as_tuple=True)[1].view(rows.shape[0], -1)  # row-major: ascending per token
        return (rows.to(torch.int64).sort(dim=-1).values,)

    def join(self, parts, like, spec):
        raise NotImplementedError("routing is read only (OpDef.replaceable)")


CURRENT_LAYER = "current"  # a HookPoint on a module shared by all layers: use Tap.layer


@dataclass
class Tap:
    """Records (and in forced mode substitutes) canonical ops at hook points."""

    spec: ModelSpec
    selection: Selection
    recorder: OpRecorder | None = None
    reference: OpStore | None = None
    spans: list[RowSpan] = field(default_factory=list)
    layer: int | None = None
    substituted: set[str] = field(default_factory=set)
    # op id -> the canonical ops whose values the engine really computes it from (fused ops differ from
    # the canonical graph, e.g. vLLM's add+RMSNorm); None: OpGraph.inputs.
    real_inputs: Callable[[str], list[str]] | None = None
    # Tensor parallelism: every rank taps (gathering a sharded tensor is collective), so ranks without a
    # recorder act as if they recorded (``record_all``); ``gather(x, sharded)`` returns the unsharded tensor.
    record_all: bool = False
    gather: Callable[[torch.Tensor, str], torch.Tensor] | None = None

    def unforced_ops(self) -> list[str]:
        """Forced mode: recorded ops whose real inputs are not all replaced by the reference's values (absent
        from the reference, or read-only like the routing), so they ran on the engine's own values and their
        difference is not their own."""
        if self.reference is None or self.recorder is None:
            return []
        inputs = self.real_inputs or OpGraph.of(self.spec).inputs
        recorded = dict.fromkeys(r["op"] for r in self.recorder.rows + self.recorder.pending_rows)
        return [op for op in recorded if not all(self.reference.has(i) and replaceable(i) for i in inputs(op))]

    def __call__(
        self,
        x: torch.Tensor,
        view: View,
        layer: int | str | None,
        axes: Axes,
        spans: list[RowSpan] | None = None,
        sharded: str | None = None,
    ) -> torch.Tensor | None:
        """Record the selected ops of ``view`` found in ``x``; return x's replacement in forced mode.
        ``sharded``: how ``x`` is split over tensor-parallel ranks (HookPoint.sharded), None if whole."""
        if isinstance(layer, str):  # CURRENT_LAYER, the only str a hook point holds
            layer = self.layer
        ids = [op_id(n, layer) for n in view.names]
        record = [(self.recorder is not None or self.record_all) and self.selection.wants(i) for i in ids]
        substitute = [self.reference is not None and replaceable(i) and self.reference.has(i) for i in ids]
        if not any(record) and not any(substitute):
            return None
        if sharded is not None and self.gather is not None:
            if any(substitute):
                from alignaudit.errors import InputError

                raise InputError("forced mode at tensor parallel size > 1 is not implemented; bisect in natural mode")
            x = self.gather(x, sharded)
        if self.recorder is None:
            return None
        replaced = None
        for span in self.spans if spans is None else spans:
            rows = take_rows(x, span, axes)
            parts = view.split(rows, self.spec)
            for op, want, part in zip(ids, record, parts, strict=True):
                if want:
                    self.recorder.record(op, span.seq, span.pos_start, part)
            if not any(substitute) or self.reference is None:  # substitute holds True only with a reference
                continue
            new_parts = list(parts)
            for k, op in enumerate(ids):
                ref = self.reference.rows(op, span.seq, span.pos_start, span.length) if substitute[k] else None
                if ref is not None:
                    new_parts[k] = ref.to(dtype=parts[k].dtype, device=parts[k].device)
                    self.substituted.add(op)
            if replaced is None:
                replaced = x.clone()
            put_rows(replaced, span, axes, view.join(new_parts, rows, self.spec))
        return replaced


@dataclass
class HookPoint:
    """One place a canonical value can be read (and replaced) in an engine's module tree.

    ``when`` is "post" (the module's output) or "pre" (its positional input ``index``); for "post",
    ``index`` picks a tuple element of the output (None: the output itself).
    """

    module: torch.nn.Module
    view: View
    layer: int | str | None
    axes: Axes
    when: str = "post"
    index: int | None = None
    sharded: str | None = None  # tensor parallelism: "heads" or "features" (split along axis 2), "glu", None


class Hooks:
    """Registered hooks and attribute patches, undone together by ``close()`` (also on error, via ``with``)."""

    def __init__(self) -> None:
        self.handles: list = []
        self.patches: list[tuple[object, str, object]] = []
        self.deferred: list[Callable[[], object]] = []

    def __enter__(self) -> Hooks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        while self.patches:
            owner, name, original = self.patches.pop()
            setattr(owner, name, original)
        while self.deferred:
            self.deferred.pop()()

    def defer(self, undo: Callable[[], object]) -> None:
        """Call ``undo`` on close() (what it returns is dropped)."""
        self.deferred.append(undo)

    def patch(self, owner: object, name: str, value: object) -> None:
        """Replace ``owner.name`` until close() (for ops that are functions, not modules)."""
        self.patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def add(self, tap: Tap, point: HookPoint) -> None:
        if point.when == "post":
            self.handles.append(point.module.register_forward_hook(_post_hook(tap, point)))
        else:
            self.handles.append(point.module.register_forward_pre_hook(_pre_hook(tap, point)))

    def raw(self, module: torch.nn.Module, fn: Callable, pre: bool = False, with_kwargs: bool = False) -> None:
        """A hook that is not a canonical op (span bookkeeping, current layer)."""
        if pre:
            self.handles.append(module.register_forward_pre_hook(fn, with_kwargs=with_kwargs))
        else:
            self.handles.append(module.register_forward_hook(fn, with_kwargs=with_kwargs))


def _post_hook(tap: Tap, p: HookPoint):
    def hook(module, args, output):
        index = p.index
        if index is None and isinstance(output, (tuple, list)):
            index = 0  # modules that return (hidden, extras...) in some versions
        x = output if index is None else output[index]
        new = tap(x, p.view, p.layer, p.axes, sharded=p.sharded)
        if new is None:
            return None
        if index is None:
            return new
        return (*output[:index], new, *output[index + 1 :])

    return hook


def _pre_hook(tap: Tap, p: HookPoint):
    def hook(module, args):
        new = tap(args[p.index or 0], p.view, p.layer, p.axes, sharded=p.sharded)
        if new is None:
            return None
        i = p.index or 0
        return (*args[:i], new, *args[i + 1 :])

    return hook


def read_flattened(
    hooks: Hooks,
    tap: Tap,
    block: torch.nn.Module,
    module: torch.nn.Module,
    layer: int,
    axes: Axes,
    views: dict[int, View],
) -> None:
    """Read-only ops of ``module``, a router inside the MoE ``block``: ``block`` takes [*lead, hidden] and
    hands ``module`` its tokens flattened to [prod(lead), hidden]; each output element ``index`` of
    ``views`` is viewed back as [*lead, ...] (``axes`` then apply) before ``tap`` records it."""
    lead: dict = {}
    hooks.raw(block, lambda m, args: lead.__setitem__("shape", args[0].shape[:-1]), pre=True)

    def hook(m, args, output):
        for index, view in views.items():
            tap(output[index].reshape(*lead["shape"], -1), view, layer, axes)

    hooks.raw(module, hook)
