"""Strict path for transformers dense decoders (Qwen3, Qwen2, Llama: alignaudit/arch), by module swap (for
FSDP-style trainers).

``make_strict(model, ops)`` changes the classes of the model's modules in place to subclasses whose
forward calls the strict kernels; parameters, names and state dicts are unchanged. ``<P>`` is the
architecture's class prefix (Qwen3, Qwen2, Llama):
    linear     every nn.Linear (projections with their biases, and lm_head) -> alignaudit_kernels.linear;
               o_proj and down_proj (row-parallel under tensor parallelism) with K in ROW_PARALLEL_SEGMENTS
               segments
    rmsnorm    every <P>RMSNorm -> alignaudit_kernels.rms_norm (the residual adds stay HF's
               ``residual + x`` in the storage dtype, which is the kernels' rounding point 1)
    silu       <P>MLP -> silu_mul(gate_proj(x), up_proj(x))
    moe        with "linear": <P>SparseMoeBlock (Qwen3 MoE) -> alignaudit_kernels.mixture_of_experts, the whole
               layer (fp32 router, fixed top-k tie-break, strict expert linears and silu_mul, fp32 combine)
    rope       <P>Attention applies alignaudit_kernels rope (tables of its own from position_ids, llama3
               scaling included)
    attention  <P>Attention computes alignaudit_kernels attention (KV cache supported, one sequence per
               batch row: right or left padding, from the attention mask; rope at the given position_ids)
Logprobs are not a module in HF: the engine calls alignaudit_kernels.token_logprobs when "logprobs"
is strict.

``compute_in(model, dtype)`` makes a strict model compute in ``dtype`` whatever dtype its parameters are stored in:
each strict module rounds its parameters to ``dtype`` where it uses them (round to nearest even, ``Tensor.to``), and
the input embedding rounds the rows it reads. That is mixed precision as trainers run it (fp32 master weights, a
bf16 forward): the forward gets the bits of a model stored in ``dtype``, which is what vLLM holds after a weight
sync (its loader copies the fp32 tensors into its bf16 parameters, ``Tensor.copy_``, the same rounding), and the
gradients reach the fp32 parameters through the casts.
"""

from __future__ import annotations

import sys

import torch

import alignaudit_kernels as K
from alignaudit.engines.strict_modules import RopeOp, StrictRouter


class StrictModule(torch.nn.Module):
    """Base of the swapped-in classes. ``strict_compute_dtype``: the dtype the module computes in (``compute_in``);
    None: its parameters' own."""

    strict_compute_dtype: torch.dtype | None = None

    def computed(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """``tensor`` (a parameter) in the compute dtype: rounded once (nearest even) where it is stored wider."""
        dtype = self.strict_compute_dtype
        return tensor if tensor is None or dtype is None or tensor.dtype == dtype else tensor.to(dtype)


class StrictLinear(StrictModule, torch.nn.Linear):
    def forward(self, x):
        return K.linear(x, self.computed(self.weight), self.computed(self.bias))


class StrictRowLinear(StrictModule, torch.nn.Linear):
    """A projection that is row-parallel under tensor parallelism (o_proj, down_proj): K reduced in
    alignaudit_kernels.ROW_PARALLEL_SEGMENTS segments, as every engine's strict path does."""

    def forward(self, x):
        return K.linear(x, self.computed(self.weight), self.computed(self.bias), K.ROW_PARALLEL_SEGMENTS)


class StrictEmbedding(StrictModule, torch.nn.Embedding):
    """The input embedding under ``compute_in``: the rows read, rounded to the compute dtype (the bits of a lookup
    in a table stored in that dtype)."""

    def forward(self, ids):
        return self.computed(torch.nn.Embedding.forward(self, ids))


class StrictRMSNorm(StrictModule):
    """Stands in for <P>RMSNorm (attributes ``weight``, ``variance_epsilon``)."""

    def forward(self, x):
        return K.rms_norm(x, self.computed(self.weight), self.variance_epsilon)


class StrictMLP(StrictModule):
    """Stands in for <P>MLP (attributes gate_proj, up_proj, down_proj)."""

    def forward(self, x):
        return self.down_proj(K.silu_mul(self.gate_proj(x), self.up_proj(x)))


class StrictMoeBlock(StrictModule):
    """Stands in for <P>SparseMoeBlock (attributes gate: the router with weight; experts: gate_up_proj
    [E, 2I, H], down_proj [E, H, I]; strict_router: a StrictRouter)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        _, chosen, weights = self.strict_router(x, self.computed(self.gate.weight))
        out = K.combine_experts(
            x, chosen, weights, self.computed(self.experts.gate_up_proj), self.computed(self.experts.down_proj)
        )
        return out.view(hidden_states.shape)


def _require(ok: torch.Tensor, message: str, compiled: bool = False) -> None:
    """ValueError(message) unless ``ok`` (a bool tensor) holds; ``compiled``: a device-side assert with the
    same message instead (a RuntimeError on the CPU; a host check would synchronize)."""
    if compiled:
        torch._assert_async(ok, message)
    elif not bool(ok):
        raise ValueError(message)


_MASK_MESSAGE = (
    "strict attention (HF): attention_mask must be causal over one contiguous run of keys per row "
    "(left or right padding); a holed or bidirectional mask would be computed otherwise"
)


def _attend(attention_mask: torch.Tensor, b: int, t: int, keys: int, compiled: bool) -> torch.Tensor:
    """HF's processed mask as bool [b, t, keys] (True = attend), the unfilled slots of a static cache checked."""
    attend = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    if attend.shape[-1] > keys:  # a static cache's unfilled slots must stay masked
        _require(
            ~attend[..., keys:].any(),
            "strict attention (HF): attention_mask lets a query attend a key slot past the cache's filled length",
            compiled,
        )
    return attend[..., :keys].expand(b, 1, t, keys)[:, 0]


def _causal(keys: int, t: int, device) -> torch.Tensor:
    """[t, keys] bool: query i (key index keys - t + i) may attend key j <= its index."""
    key = torch.arange(keys, device=device)
    return key[None, :] <= key[keys - t :, None]


def row_starts(attention_mask, b: int, t: int, keys: int) -> list[int] | None:
    """The first key of each row's run of tokens (a left-padded row's pads come before it), or None where no
    row has left padding: what strict attention computes, from HF's processed mask (None, or [b, 1, t, keys]:
    bool True = attend, or additive with 0 = attend; the queries are the last t of the keys). Each row must
    attend causally over one contiguous run of keys [start, end): its real tokens; a left pad's query row is
    ignored (its output is zeros), a right pad's may attend its pads too (it belongs to no token). One device
    synchronization (torch.compile calls ``mask_checked_index`` instead).

    Raises:
        ValueError: a mask that is not a 4D tensor, or not causal over one run of keys per row.
    """
    if attention_mask is None:
        return None
    _require_4d(attention_mask)
    attend = _attend(attention_mask, b, t, keys, compiled=False)
    valid = attend[:, -1]  # the last query row attends every key of its row's run (a right pad's: all before it)
    start = torch.where(valid.any(1), valid.int().argmax(1), 0)
    between = valid.int().cummax(1).values.bool() & valid.flip(1).int().cummax(1).values.flip(1).bool()
    index = torch.arange(keys - t, keys, device=attend.device)
    real_query = index[None, :] >= start[:, None]  # [b, t]: a left pad's query row is not checked
    layout = attend == (_causal(keys, t, attend.device)[None] & valid[:, None, :])
    ok = (valid == between).all() & (layout | ~real_query[:, :, None]).all()
    ok = ok & valid.any(1).all()  # a row that attends no key (e.g. an additive mask of ones, not zeros) is no run
    _require(ok, _MASK_MESSAGE)
    starts = start.tolist()
    return starts if any(starts) else None


def _require_4d(attention_mask) -> None:
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        raise ValueError(
            "strict attention (HF) reads a 4D tensor attention_mask, not "
            f"{type(attention_mask).__name__}; use attn_implementation eager or sdpa"
        )


@torch.library.custom_op("alignaudit::hf_mask_checked_index", mutates_args=())
def mask_checked_index(index: torch.Tensor, attention_mask: torch.Tensor, t: int, keys: int) -> torch.Tensor:
    """``row_starts``'s check under torch.compile, as one opaque op: a copy of ``index`` [b, t] (each query's
    key index, int64), returned once HF's mask [b, 1, t, keys'] has passed device-side asserts (no host read).
    Only runs that start at key 0 pass (every query row real): left padding, which needs a per-row cut on
    the host, is refused. Opaque because Inductor's GPU code generation failed on the check's reductions
    (a sympy TypeError compiling the Qwen3-8B-shape forward on an H200, torch 2.11, docs/log/gpu-sessions.md
    2026-12-02); the index feeds the attention, so the check cannot be dropped from the graph."""
    b = index.shape[0]
    attend = _attend(attention_mask, b, t, keys, compiled=True)
    valid = attend[:, -1]
    prefix = (valid[:, 1:] <= valid[:, :-1]).all() & valid[:, 0].all()
    ok = prefix & (attend == (_causal(keys, t, attend.device)[None] & valid[:, None, :])).all()
    _require(ok, _MASK_MESSAGE + "; left padding is computed out of torch.compile only", compiled=True)
    return index.clone()


@mask_checked_index.register_fake
def _(index, attention_mask, t, keys):
    return torch.empty_like(index)


_LAST_LAYOUT: list = [None, None]  # (the mask and shape of the last forward, its row starts): one check a forward


def _row_starts_once(attention_mask, b: int, t: int, keys: int) -> list[int] | None:
    """``row_starts`` once per forward: every layer is handed the same mask object."""
    if attention_mask is None:
        return None
    if _LAST_LAYOUT[0] is not None and _LAST_LAYOUT[0][0] is attention_mask and _LAST_LAYOUT[0][1] == (b, t, keys):
        return _LAST_LAYOUT[1]
    starts = row_starts(attention_mask, b, t, keys)
    _LAST_LAYOUT[:] = [(attention_mask, (b, t, keys)), starts]
    return starts


def _whole_sequences(q, k, v, starts: list[int] | None, scale: float, exp: str, kernel: str) -> torch.Tensor:
    """Strict attention of a batch with no cached keys (a training or scoring forward), q [b, t, H, D] and k/v
    [b, t, KVH, D], as one ragged prefill (varlen_attention): row r's sequence is its tokens from its first real one
    (``starts[r]``, 0 without left padding). Each row's bits are those of causal_attention over that run (one
    algorithm per row, kernels/alignaudit_kernels/attention), in one launch where left-padded rows took one each, and
    its fused backward is FlashAttention-2's varlen one (kernels/alignaudit_kernels/attention/flash_gradients.py). A
    left pad's output row is zeros."""
    b, t, h, d = q.shape
    fq, fk, fv = (x.reshape(b * t, *x.shape[2:]) for x in (q, k, v))
    if starts is None:
        cu = torch.arange(0, b * t + 1, t)
        return K.varlen_attention(fq, fk, fv, cu, scale, exp=exp, kernel=kernel).view(b, t, h, d)
    runs = [(r * t + s, (r + 1) * t) for r, s in enumerate(starts) if s < t]
    cu = torch.tensor([0, *(end - first for first, end in runs)]).cumsum(0)
    rows = torch.cat([torch.arange(first, end) for first, end in runs]).to(q.device)
    out = q.new_zeros(b * t, h, d)
    out[rows] = K.varlen_attention(fq[rows], fk[rows], fv[rows], cu, scale, exp=exp, kernel=kernel)
    return out.view(b, t, h, d)


def packed_runs(position_ids: torch.Tensor, attention_mask, b: int, t: int) -> torch.Tensor | None:
    """cu_seqlens (int64 [n + 1], over the b * t flattened tokens) of the sequences packed in the rows, where
    position_ids [b, t] restart at 0 inside a row (TRL's padding_free and verl's remove-padding batches: transformers
    then builds a block-causal mask, or, with FlashAttention-2, reads the boundaries from the positions); None where
    no row restarts. One device synchronization.

    Raises:
        ValueError: positions that do not count 0, 1, 2, ... within each sequence, or a mask (HF's processed one, 4D)
            other than block-causal over those sequences.
    """
    restart = position_ids[:, 1:] == 0
    if not bool(restart.any()):
        return None
    first = torch.cat([torch.ones(b, 1, dtype=torch.bool, device=restart.device), restart], 1)  # [b, t]
    index = torch.arange(t, device=first.device).expand(b, t)
    start = torch.where(first, index, 0).cummax(1).values  # each token's sequence start
    if not torch.equal(position_ids, (index - start).to(position_ids.dtype)):
        raise ValueError(
            "strict attention (HF): position_ids restart at 0 inside a row but do not count 0, 1, 2, ... "
            "within each packed sequence"
        )
    if attention_mask is not None:
        _require_4d(attention_mask)
        sequence = first.long().cumsum(1)
        expected = (sequence[:, :, None] == sequence[:, None, :]) & _causal(t, t, first.device)[None]
        if not torch.equal(_attend(attention_mask, b, t, t, compiled=False), expected):
            raise ValueError(_MASK_MESSAGE + ", or block-causal over the sequences packed by position_ids")
    boundaries = first.flatten().nonzero().flatten().cpu()
    return torch.cat([boundaries, torch.tensor([b * t])])


_LAST_PACKED: list = [None, None]  # (the mask and positions of the last forward, their cu_seqlens): one check a forward


def _packed_runs_once(attention_mask, position_ids, b: int, t: int) -> torch.Tensor | None:
    """``packed_runs`` once per forward (every layer is handed the same mask and position objects); with a mask, a
    layout that is not packed (a left-padded row's pads also restart at 0) gives None: the caller reads the mask as
    one run per row. Raises ValueError as packed_runs where no mask tells another layout."""
    last = _LAST_PACKED[0]
    if last is not None and last[0] is attention_mask and last[1] is position_ids and last[2] == (b, t):
        return _LAST_PACKED[1]
    try:
        cu = packed_runs(position_ids.expand(b, t), attention_mask, b, t)
    except ValueError:
        if attention_mask is None:
            raise
        cu = None
    _LAST_PACKED[:] = [(attention_mask, position_ids, (b, t)), cu]
    return cu


class StrictAttention(StrictModule):
    """Stands in for <P>Attention (QK-norm where the module has q_norm/k_norm); ``strict_rope`` /
    ``strict_attention`` say which parts are strict, ``strict_exp`` the exp and ``strict_kernel`` the kernel of the
    strict attention (alignaudit_kernels.attention)."""

    def forward(
        self,
        hidden_states,
        position_embeddings=None,
        attention_mask=None,
        past_key_values=None,
        position_ids=None,
        **kwargs,
    ):
        b, t, _ = hidden_states.shape
        d = self.head_dim
        q = self.q_proj(hidden_states).view(b, t, -1, d)
        k = self.k_proj(hidden_states).view(b, t, -1, d)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(hidden_states).view(b, t, -1, d)
        if position_ids is None:
            position_ids = torch.arange(t, device=hidden_states.device)[None]
        given_positions = position_ids  # the object every layer gets (a layout is read once a forward)
        position_ids = position_ids.expand(b, t)  # HF passes [1, t] for a batch without padding
        if self.strict_rope:
            past = past_key_values.get_seq_length(self.layer_idx) if past_key_values is not None else 0
            limit = past + t if isinstance(past, (int, torch.SymInt)) else None  # a cache of past + t keys
            q, k = self.q_rope(q, position_ids, limit), self.k_rope(k, position_ids, limit)
        else:
            cos, sin = position_embeddings
            q, k = sys.modules[self._hf_module].apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        if past_key_values is not None:
            kc, vc = past_key_values.update(k.transpose(1, 2), v.transpose(1, 2), self.layer_idx)
            k, v = kc.transpose(1, 2), vc.transpose(1, 2)
        if self.strict_attention:
            keys = k.shape[1]
            index = torch.arange(keys - t, keys, device=q.device)  # each query's key index
            if torch.compiler.is_compiling():
                starts, packed, index = None, None, index.expand(b, t).contiguous()
                if attention_mask is not None:
                    _require_4d(attention_mask)
                    index = mask_checked_index(index, attention_mask, t, keys)
            else:
                starts, packed = self._layout(attention_mask, given_positions, b, t, keys)
            if keys == t and not torch.compiler.is_compiling() and packed is not None:
                flat = [x.reshape(b * t, *x.shape[2:]) for x in (q, k, v)]
                out = K.varlen_attention(
                    *flat, packed, self.scaling, exp=self.strict_exp, kernel=self.strict_kernel
                ).view(q.shape)
            elif keys == t and not torch.compiler.is_compiling():
                out = _whole_sequences(q, k, v, starts, self.scaling, self.strict_exp, self.strict_kernel)
            elif starts is None:
                out = K.causal_attention(
                    q, k, v, index.expand(b, t), self.scaling, exp=self.strict_exp, kernel=self.strict_kernel
                )
            else:  # left padding: each row attends its own run of keys, its pads' queries stay zero
                out = torch.zeros_like(q)
                for r, start in enumerate(starts):
                    first = max(0, start - (keys - t))
                    out[r, first:] = K.causal_attention(
                        q[r, first:],
                        k[r, start:],
                        v[r, start:],
                        index[first:] - start,
                        self.scaling,
                        exp=self.strict_exp,
                        kernel=self.strict_kernel,
                    )
        else:
            interface = self._stock_attention
            out, _ = interface(
                self,
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attention_mask,
                dropout=0.0,
                scaling=self.scaling,
                **kwargs,
            )
        return self.o_proj(out.reshape(b, t, -1)), None

    @staticmethod
    def _layout(attention_mask, position_ids, b: int, t: int, keys: int):
        """(row starts, packed cu_seqlens) of a forward out of torch.compile: with no cache, sequences packed in the
        rows by position_ids restarting at 0 (packed_runs; the mask block-causal over them, or absent); else one run
        of tokens per row (row_starts). Raises ValueError for any other layout."""
        if keys == t and (packed := _packed_runs_once(attention_mask, position_ids, b, t)) is not None:
            return None, packed  # before row_starts, which would read a block-causal mask as left padding
        return _row_starts_once(attention_mask, b, t, keys), None


_SWAPPED: dict[tuple[type, type], type] = {}


def _swap(module: torch.nn.Module, cls: type) -> None:
    """Give ``module`` a class deriving from ``cls`` (whose forward wins) and its own class."""
    key = (cls, type(module))
    if key not in _SWAPPED:
        _SWAPPED[key] = type(f"Strict{type(module).__name__}", key, {})
    module.__class__ = _SWAPPED[key]


def make_strict(
    model, ops: frozenset[str], llama3: tuple | None = None, exp: str = "portable", kernel: str = "portable"
) -> list[str]:
    """Swap the strict ops into a model of an alignaudit.arch architecture in place; return what was swapped
    (for the manifest). ``llama3``: the spec's llama3 rope scaling (ModelSpec.rope_llama3), or None. ``exp``:
    the strict attention's exp (alignaudit_kernels.attention.EXP_CHOICES), ``kernel`` its kernel
    (alignaudit_kernels.attention.KERNELS; "flash" needs a Hopper GPU and vLLM's FA3 build at the first forward).

    Raises:
        alignaudit.errors.InputError: the model's architecture is not one alignaudit runs; strict ops on ROCm
            (alignaudit.inputs.strict_ops.check_platform).
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from alignaudit.arch import architecture
    from alignaudit.errors import InputError
    from alignaudit.inputs.strict_ops import guard_platform

    guard_platform(ops, "make_strict")

    prefix = architecture(type(model).__name__).hf_prefix
    config = model.config
    rope_theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", None))
    if rope_theta is None:  # load_spec refuses such a checkpoint before any engine loads it
        raise InputError(f"{type(model).__name__}'s config has no rope_theta")
    swapped = []
    for name, m in list(model.named_modules()):
        kind = type(m).__name__
        if "linear" in ops and isinstance(m, torch.nn.Linear):
            _swap(m, StrictRowLinear if name.endswith((".o_proj", ".down_proj")) else StrictLinear)
        elif "rmsnorm" in ops and kind == f"{prefix}RMSNorm":
            _swap(m, StrictRMSNorm)
        elif "silu" in ops and kind == f"{prefix}MLP":
            _swap(m, StrictMLP)
        elif "linear" in ops and kind == f"{prefix}SparseMoeBlock":
            m.strict_router = StrictRouter(m.gate.top_k, m.gate.norm_topk_prob)
            _swap(m, StrictMoeBlock)
        elif ({"rope", "attention"} & ops) and kind == f"{prefix}Attention":
            m._hf_module = type(m).__module__
            m._stock_attention = ALL_ATTENTION_FUNCTIONS.get_interface(
                config._attn_implementation, sys.modules[type(m).__module__].eager_attention_forward
            )
            m.strict_rope, m.strict_attention, m.strict_exp = "rope" in ops, "attention" in ops, exp
            m.strict_kernel = kernel
            m.q_rope = RopeOp(m.head_dim, rope_theta, config.max_position_embeddings, llama3)
            m.k_rope = RopeOp(m.head_dim, rope_theta, config.max_position_embeddings, llama3)
            _swap(m, StrictAttention)
        else:
            continue
        swapped.append(name)
    return swapped


def compute_in(model, dtype: torch.dtype) -> None:
    """Make a model that ``make_strict`` swapped compute in ``dtype`` (the module docstring), its parameters left in
    their own dtype: every strict module rounds its parameters where it uses them, the input embedding (swapped to
    StrictEmbedding here) the rows it reads. Idempotent; a later call changes the dtype.

    Raises:
        alignaudit.errors.InputError: a module holding parameters that no strict module rounds (an op left
            default: it would compute in its parameters' dtype and change the activations' dtype), naming it.
    """
    from alignaudit.errors import InputError

    embedding = model.get_input_embeddings()
    if not isinstance(embedding, StrictModule):
        _swap(embedding, StrictEmbedding)
    rounded = {id(m) for m in model.modules() if isinstance(m, StrictModule)}
    for m in model.modules():
        if isinstance(m, StrictMoeBlock):  # its router and experts' parameters are read (and rounded) by the block
            rounded |= {id(m.gate), id(m.experts)}
    for name, m in model.named_modules():
        if id(m) not in rounded and any(True for _ in m.parameters(recurse=False)):
            raise InputError(
                f"compute in {str(dtype).removeprefix('torch.')}: module {name} "
                f"({type(m).__name__}) is not strict and would compute in its parameters' dtype; make "
                "every op strict (ops='all') or keep the parameters in the compute dtype"
            )
    for m in model.modules():
        if isinstance(m, StrictModule):
            m.strict_compute_dtype = dtype
