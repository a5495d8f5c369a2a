"""Model resolution: ``--model`` -> a local Hugging Face checkpoint directory and its ModelSpec.

``--model`` accepts, in this order:
1. a local directory holding ``config.json`` and ``*.safetensors`` (Hugging Face layout);
2. a preset name of a real architecture (``Qwen3-8B`` or ``Qwen/Qwen3-8B``): with ``--random-weights`` a
   checkpoint of that exact shape is synthesized once (seeded) under the alignaudit cache and reused;
   without it, the hub id is looked up in the local Hugging Face cache;
3. any other hub id (``org/name``) found in the local Hugging Face cache (never downloaded here).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from alignaudit.arch import PRESETS, Architecture, architecture, find_preset
from alignaudit.errors import InputError
from alignaudit.inputs.capabilities import check_checkpoint_config
from alignaudit.inputs.values import parse_json


@dataclass(frozen=True)
class ModelSpec:
    """Shape and numerics-relevant hyperparameters of one decoder-only checkpoint.

    Read from the checkpoint's ``config.json`` through ``transformers.AutoConfig``. ``path`` is the local
    directory every engine loads. ``dtype`` is the storage dtype the checkpoint declares.
    """

    name: str
    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    dtype: str
    has_tokenizer: bool
    attention_bias: bool = False  # q/k/v projections carry biases
    rope_llama3: tuple[float, float, float, int] | None = None  # llama3 rope scaling: (factor, low_freq_factor,
    # high_freq_factor, original_max_position_embeddings), alignaudit.arch.llama
    tensors: int = 0  # tensors in the checkpoint, each loaded by every engine (models.check_weights)
    num_experts: int = 0  # mixture of experts (alignaudit.arch.qwen3_moe); 0 for a dense MLP
    experts_per_token: int = 0  # top-k experts each token is routed to
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    norm_topk_prob: bool = False  # the chosen experts' probabilities renormalized to sum to 1

    def __post_init__(self):
        if self.rope_llama3 is not None:  # a list after a JSON round trip (worker requests, manifests)
            object.__setattr__(self, "rope_llama3", tuple(self.rope_llama3))

    @property
    def num_query_groups(self) -> int:
        """Number of KV heads; each serves ``num_heads // num_kv_heads`` query heads (GQA)."""
        return self.num_kv_heads

    def to_dict(self) -> dict:
        return asdict(self)


def cache_root() -> Path:
    """Where synthesized checkpoints live: ``$ALIGNAUDIT_CACHE`` or ``~/.cache/alignaudit``."""
    return Path(os.environ.get("ALIGNAUDIT_CACHE", Path.home() / ".cache" / "alignaudit"))


def load_spec(path: Path, name: str | None = None) -> ModelSpec:
    """Read ``path/config.json`` into a ModelSpec.

    Raises:
        InputError: no config.json or no weights, an architecture outside alignaudit.arch, or a config field
            that architecture's engines do not all implement.
    """
    path = Path(path)
    config_file = path / "config.json"
    raw, arch = _config_and_architecture(path)
    for field, why in arch.refused:
        if raw.get(field):
            raise InputError(f"{config_file}: {field}={raw[field]!r} is not supported for {arch.name}: {why}")
    if arch.moe and not 1 <= raw.get("num_experts_per_tok", 0) <= raw.get("num_experts", 0):
        raise InputError(
            f"{config_file}: num_experts_per_tok {raw.get('num_experts_per_tok')!r} must be between 1 and "
            f"num_experts {raw.get('num_experts')!r}"
        )
    for field, value, why in arch.required:
        if raw.get(field, value) != value:
            raise InputError(
                f"{config_file}: {field}={raw[field]!r} is not supported for {arch.name} (only {value!r}): {why}"
            )
    if not any(path.glob("*.safetensors")):
        raise InputError(f"model directory {path} has no *.safetensors weights")
    check_json_files(path)

    raw_rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    rope_type = raw_rope.get("rope_type", raw_rope.get("type", "default")) if isinstance(raw_rope, dict) else raw_rope
    if rope_type not in arch.rope_types:
        raise InputError(
            f"rope_type {rope_type!r} in {config_file} is not supported for {arch.name}; supported: "
            f"{', '.join(arch.rope_types)}"
        )

    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its config warnings would break alignaudit's one-line errors
    try:
        cfg = AutoConfig.from_pretrained(str(path))
    except Exception as e:  # transformers raises many types for a malformed config
        raise InputError(f"cannot parse {config_file}: {e}") from e
    finally:
        hf_logging.set_verbosity(verbosity)
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope_theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
    if rope_theta is None:  # transformers fills in a missing one, not an explicit null
        raise InputError(f"{config_file}: rope_theta is null; give rope's base (the model card's config.json has it)")
    llama3 = None
    if rope_type == "llama3":
        llama3 = (
            float(rope["factor"]),
            float(rope["low_freq_factor"]),
            float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]),
        )
    dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    if not (isinstance(heads, int) and isinstance(kv_heads, int) and 0 < kv_heads <= heads and heads % kv_heads == 0):
        raise InputError(
            f"{config_file}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
            f"{kv_heads}; grouped-query attention needs whole query groups"
        )
    check_checkpoint_config(raw, str(config_file))
    tensors = check_weights(path, raw, arch)
    return ModelSpec(
        name=name or path.name,
        path=str(path.resolve()),
        architecture=arch.name,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        rms_norm_eps=float(cfg.rms_norm_eps),
        rope_theta=float(rope_theta),
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(cfg.tie_word_embeddings),
        qk_norm=arch.qk_norm,
        attention_bias=arch.qkv_bias(raw),
        rope_llama3=llama3,
        tensors=tensors,
        num_experts=int(raw.get("num_experts", 0)) if arch.moe else 0,
        experts_per_token=int(raw.get("num_experts_per_tok", 0)) if arch.moe else 0,
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 0)) if arch.moe else 0,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)) if arch.moe else False,
        dtype=str(dtype),
        has_tokenizer=(path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file(),
    )


def check_json_files(path: Path) -> None:
    """Every JSON file of a checkpoint directory (tokenizer.json, tokenizer_config.json, generation_config.json,
    a safetensors index, ...) parses: engines read them at start, where a broken one surfaced as an engine
    failure that named no file.

    Raises:
        InputError: naming the first file that is not valid JSON.
    """
    for file in sorted(path.glob("*.json")):
        try:
            json.loads(file.read_bytes())
        except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise InputError(f"{file} is not valid JSON ({e}); re-download the checkpoint or remove the file") from e


def check_weights(path: Path, config: dict, arch) -> int:
    """Read the safetensors headers (not the data) and check that the checkpoint holds exactly the tensors the
    config implies (``arch.weight_shapes``), with the implied shapes: every engine adapter loads that schema,
    so a tensor outside it would be silently ignored. Returns the number of tensors.

    Raises:
        InputError: naming the first unreadable file, missing or unused tensor, or wrong shape.
    """
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                shapes.update({name: list(f.get_slice(name).get_shape()) for name in f.keys()})
        except Exception as e:  # safetensors raises its own error type for truncated or foreign files
            raise InputError(f"{file} is not a readable safetensors file ({e}); re-download or re-save it") from e
    try:
        expected = list(arch.weight_shapes(config))
    except (KeyError, TypeError) as e:
        raise InputError(f"{path / 'config.json'} lacks a field {arch.name} needs: {e}") from e
    for name, shape, _ in expected:
        if name not in shapes:
            raise InputError(f"checkpoint {path} has no tensor {name}, which its config.json implies")
        if shapes[name] != list(shape):
            raise InputError(
                f"checkpoint tensor {name} has shape {shapes[name]}, but config.json implies {list(shape)}"
            )
    unused = sorted(set(shapes) - {name for name, _, _ in expected})
    if unused:
        raise InputError(
            f"checkpoint {path} holds {len(unused)} tensor(s) its config.json does not account for "
            f"({unused[0]}{', ...' if len(unused) > 1 else ''}); an engine would ignore them, so the run "
            "would not measure this checkpoint"
        )
    return len(shapes)


def _config_and_architecture(path: Path) -> tuple[dict, Architecture]:
    """``path/config.json`` read (parse_json) and its alignaudit.arch architecture. Raises InputError: no such file,
    not readable, not a JSON object, or an architecture alignaudit does not run, naming the file."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise InputError(
            f"model directory {path} has no config.json; point --model at a Hugging Face checkpoint directory"
        )
    try:
        raw = parse_json(config_file.read_text(), str(config_file))
    except (OSError, ValueError) as e:  # ValueError: not UTF-8 text
        raise InputError(f"cannot read {config_file}: {e}") from e
    if not isinstance(raw, dict):
        raise InputError(f"{config_file} is not a JSON object; it must be a Hugging Face config")
    architectures = raw.get("architectures") or [raw.get("model_type", "?")]
    try:
        return raw, architecture(architectures[0])
    except InputError as e:
        raise InputError(f"{config_file}: {e}") from None


def weight_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor the checkpoint at ``model_dir`` holds by its config.json (its
    architecture's alignaudit.arch weight_shapes): the schema a weight sync into an engine of it must follow.

    Raises:
        InputError: as load_spec's config checks (no readable config.json, an architecture alignaudit does not run).
    """
    raw, arch = _config_and_architecture(Path(model_dir))
    return {name: tuple(shape) for name, shape, _ in arch.weight_shapes(raw)}


def eos_ids(model_dir: str | Path) -> frozenset[int]:
    """The token ids that end a completion of the checkpoint at ``model_dir``: ``eos_token_id`` (an id or a list) of
    its config.json and of its generation_config.json where it has one (vLLM stops at both: its EOS and the
    generation config's stop ids)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        file = Path(model_dir) / name
        if not file.is_file():
            continue
        eos = parse_json(file.read_text(), str(file)).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(i for i in ids if isinstance(i, int) and not isinstance(i, bool))


def fixtures_dir() -> Path:
    """The embedded fixtures (packaged as alignaudit_fixtures; the repository's fixtures/ folder)."""
    import alignaudit_fixtures

    return Path(alignaudit_fixtures.__file__).resolve().parent


def resolve_model(model: str, random_weights: bool = False, seed: int = 0) -> ModelSpec:
    """Turn the ``--model`` argument into a ModelSpec of a local checkpoint directory: a directory, an
    embedded fixture's name (qwen3-tiny, qwen2-tiny, llama-tiny, qwen3-moe-tiny: fixtures/), a preset with
    ``random_weights``, or a hub id in the local Hugging Face cache.

    Raises:
        InputError: with the reason and the fix (not a directory, not cached, unknown preset, random weights
            asked of a fixture, ...).
    """
    local = Path(model).expanduser()
    if local.exists():
        if not local.is_dir():
            raise InputError(f"--model {model} is a file; pass the checkpoint directory that holds config.json")
        if random_weights:
            raise InputError("--random-weights applies to preset names, not to a local directory")
        return load_spec(local)
    fixture = fixtures_dir() / model
    if "/" not in model and (fixture / "config.json").is_file():
        if random_weights:
            raise InputError(
                f"--random-weights needs --model PRESET, e.g. --model Qwen3-0.6B --random-weights; "
                f"{model} is an embedded fixture with weights of its own"
            )
        return load_spec(fixture)

    preset = find_preset(model)
    if preset is not None and random_weights:
        from alignaudit.inputs.synth import synthesize_checkpoint

        target = cache_root() / "random" / f"{preset.name}-seed{seed}"
        synthesize_checkpoint(preset.config, target, seed=seed)
        return load_spec(target, name=f"{preset.name} (random weights, seed {seed})")
    if random_weights:
        import difflib

        close = difflib.get_close_matches(model, list(PRESETS), n=2, cutoff=0.6)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise InputError(f"--random-weights: {model!r} is not a preset; {hint}presets: {', '.join(PRESETS)}")

    hub_id = preset.hub_id if preset is not None else model
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise InputError(
            f"--model {model}: no such directory; pass a checkpoint directory, a hub id in the local "
            "Hugging Face cache, or a preset name with --random-weights"
        )
    if "/" not in hub_id:
        raise InputError(
            f"--model {model} is not a directory, a preset or a hub id; presets (with --random-weights): "
            f"{', '.join(PRESETS)}"
        )
    return load_spec(_from_hf_cache(hub_id), name=hub_id)


def _from_hf_cache(hub_id: str) -> Path:
    """Local snapshot of ``hub_id`` from the Hugging Face cache; never downloads."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(hub_id, local_files_only=True))
    except Exception as e:  # LocalEntryNotFoundError, RepositoryNotFoundError, HFValidationError, ...
        raise InputError(
            f"{hub_id} is not in the local Hugging Face cache; download it with "
            f"`hf download {hub_id}` or use a preset with --random-weights"
        ) from e


def checkpoint_sha256(spec: ModelSpec) -> str:
    """sha256 over config.json and every safetensors file of the checkpoint, in name order.

    Cached per (path, size, mtime) under the alignaudit cache, since hashing a 16 GB checkpoint takes
    tens of seconds.
    """
    import hashlib

    files = [Path(spec.path) / "config.json", *sorted(Path(spec.path).glob("*.safetensors"))]
    key = json.dumps([[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files])
    cache_file = cache_root() / "checkpoint-sha256.json"
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return cache[key]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as stream:
            while chunk := stream.read(16 << 20):
                h.update(chunk)
    digest = h.hexdigest()
    cache[key] = digest
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(json.dumps(cache))
    except OSError:
        pass  # a read-only cache only costs the next run a rehash
    return digest
