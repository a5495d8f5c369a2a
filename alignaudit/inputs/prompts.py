"""Prompt sources -> TokenBatch: token ids tokenized once, so every engine gets the same ids.

Sources: built-in prompts, ``--prompts FILE`` (JSONL with "text" or "token_ids" per line, and any other keys as
columns, as a Hugging Face dataset's JSONL holds them; or plain text, one prompt per non-empty line), and
``--random-prompts N --prompt-len L`` (uniform ids, seeded).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from alignaudit.errors import InputError
from alignaudit.inputs.checkpoint import ModelSpec
from alignaudit.inputs.values import parse_json

BUILTIN_PROMPTS = (
    "The importance ratio between the training engine and the rollout engine should be exactly one.",
    "What is two plus two?",
    "Reinforcement learning from verifiable rewards trains a language model on its own samples. The "
    "rollout engine records the log-probability of every sampled token, and the training engine "
    "recomputes them; a mismatch of one unit in the last place is small, but the ratio amplifies it.",
    "def log_softmax(x): return x - max(x) - log(sum(exp(x - max(x))))",
)


@dataclass(frozen=True)
class TokenBatch:
    """The token ids every engine receives.

    Attributes:
        sequences: one tuple of int token ids per sequence (each of length >= 2, so it has a logprob).
        texts: the source text of each sequence, or None for id prompts.
        source: where the prompts came from ("builtin", a file path, "random(...)").
        columns: a JSONL file's other keys, each a tuple of one JSON value per sequence (None where a line lacks the
            key, as ``datasets`` reads JSONL); what rl gives a user's reward function by name, as TRL passes dataset
            columns. Not part of the engines' input: ``digest`` and ``to_dict`` leave them out.
    """

    sequences: tuple[tuple[int, ...], ...]
    texts: tuple[str | None, ...] = field(default=())
    source: str = ""
    columns: dict[str, tuple] = field(default_factory=dict, compare=False)

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    def digest(self) -> str:
        """sha256 over the token ids (not the texts): equal digests mean identical engine inputs."""
        h = hashlib.sha256()
        for seq in self.sequences:
            h.update(json.dumps(list(seq)).encode())
            h.update(b"\n")
        return h.hexdigest()

    def to_dict(self) -> dict:
        return {"sequences": [list(s) for s in self.sequences], "texts": list(self.texts), "source": self.source}

    @classmethod
    def from_dict(cls, d: dict) -> TokenBatch:
        return cls(tuple(tuple(s) for s in d["sequences"]), tuple(d.get("texts", ())), d.get("source", ""))


def load_prompts(
    spec: ModelSpec,
    prompts_file: Path | None = None,
    random_prompts: int | None = None,
    prompt_len: int = 64,
    seed: int = 0,
    reserve: int = 0,
) -> TokenBatch:
    """Build the TokenBatch for ``spec`` from exactly one source (built-in when none is given).

    Raises:
        InputError: both a file and random prompts given; unreadable or empty file; a malformed line;
            text prompts for a checkpoint without a tokenizer; a token id >= vocab size; a sequence
            shorter than 2 tokens or longer than the model's max_position_embeddings minus ``reserve``
            (positions the engines need after the prompt: rollout tokens, or vLLM's one sampled token).
    """
    if prompts_file is not None and random_prompts is not None:
        raise InputError("give either --prompts or --random-prompts, not both")
    if random_prompts is not None:
        batch = _random_batch(spec, random_prompts, prompt_len, seed)
    elif prompts_file is not None:
        batch = _file_batch(spec, Path(prompts_file))
    else:
        if not spec.has_tokenizer:
            raise InputError(
                f"{spec.name} has no tokenizer for the built-in text prompts; use --random-prompts N "
                "or a --prompts file with token_ids"
            )
        batch = _tokenize(spec, list(BUILTIN_PROMPTS), source="builtin")
    validate_batch(spec, batch, reserve)
    return batch


def text_batch(spec: ModelSpec, texts: list[str], source: str, reserve: int = 0) -> TokenBatch:
    """``texts`` tokenized with the checkpoint's tokenizer as every text prompt is, then validated (validate_batch).
    Raises InputError (no tokenizer; a sequence too short or too long)."""
    batch = _tokenize(spec, texts, source)
    validate_batch(spec, batch, reserve)
    return batch


def validate_batch(spec: ModelSpec, batch: TokenBatch, reserve: int = 0) -> None:
    """Check ids and lengths against the model. Raises InputError naming the sequence and the fix."""
    if not batch.sequences:
        raise InputError(f"no prompts in {batch.source}")
    for i, seq in enumerate(batch.sequences):
        if len(seq) < 2:
            raise InputError(f"prompt {i} has {len(seq)} token(s); a logprob needs at least 2 tokens")
        if len(seq) + reserve > spec.max_position_embeddings:
            extra = f" plus {reserve} generated" if reserve else ""
            raise InputError(
                f"prompt {i} has {len(seq)} tokens{extra}, longer than the model's max length "
                f"{spec.max_position_embeddings}; shorten it"
            )
        bad = [t for t in seq if not 0 <= t < spec.vocab_size]
        if bad:
            raise InputError(
                f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {spec.vocab_size}) of {spec.name}"
            )


def _random_batch(spec: ModelSpec, n: int, length: int, seed: int) -> TokenBatch:
    import torch

    if n < 1 or length < 2:
        raise InputError("--random-prompts needs N >= 1 and --prompt-len >= 2")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec.vocab_size, (n, length), generator=gen)
    return TokenBatch(
        tuple(tuple(row) for row in ids.tolist()),
        (None,) * n,
        source=f"random(n={n}, len={length}, seed={seed})",
    )


def _file_batch(spec: ModelSpec, path: Path) -> TokenBatch:
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read prompt file {path}: {e}") from e
    if not lines:
        raise InputError(f"prompt file {path} is empty; put one prompt per line (text or JSONL)")
    if path.suffix != ".jsonl" and not lines[0].lstrip().startswith("{"):
        return _tokenize(spec, lines, source=str(path))

    texts: list[str | None] = []
    sequences: list[tuple[int, ...] | None] = []
    records: list[dict] = []
    for n, line in enumerate(lines, 1):
        record = parse_json(line, f"{path}:{n}")
        records.append(record if isinstance(record, dict) else {})
        if isinstance(record, dict) and "token_ids" in record and "text" in record:
            raise InputError(f'{path}:{n}: give "text" or "token_ids", not both')
        if isinstance(record, dict) and isinstance(record.get("token_ids"), list):
            ids = record["token_ids"]
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InputError(f"{path}:{n}: token_ids must be a list of integers")
            sequences.append(tuple(ids))
            texts.append(None)
        elif isinstance(record, dict) and isinstance(record.get("text"), str):
            sequences.append(None)
            texts.append(record["text"])
        else:
            raise InputError(f'{path}:{n}: expected {{"text": "..."}} or {{"token_ids": [...]}}')
    pending = [t for t, s in zip(texts, sequences, strict=True) if s is None and t is not None]  # the text lines
    tokenized = iter(_tokenize(spec, pending, source=str(path)).sequences if pending else ())
    filled = tuple(s if s is not None else next(tokenized) for s in sequences)
    names = dict.fromkeys(k for r in records for k in r if k not in ("text", "token_ids"))  # first-seen order
    columns = {name: tuple(r.get(name) for r in records) for name in names}
    return TokenBatch(filled, tuple(texts), source=str(path), columns=columns)


def _tokenize(spec: ModelSpec, texts: list[str], source: str) -> TokenBatch:
    if not spec.has_tokenizer:
        raise InputError(
            f"{spec.name} has no tokenizer, so text prompts cannot be tokenized; give token_ids in a JSONL "
            "--prompts file or use --random-prompts N"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec.path)
    ids = [tuple(tokenizer(t, add_special_tokens=True)["input_ids"]) for t in texts]
    return TokenBatch(tuple(ids), tuple(texts), source=source)
