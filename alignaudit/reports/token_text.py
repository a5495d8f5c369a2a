"""Token ids as text, with the checkpoint's own tokenizer (transformers.AutoTokenizer of the model directory a
run records), for the report's worst-tokens table. A missing tokenizer is a note on the page, never a failure."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@lru_cache(maxsize=4)
def _load(path: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_tokenizer(model_path: str | Path | None) -> tuple[PreTrainedTokenizerBase | None, str]:
    """The tokenizer of the checkpoint at ``model_path``, read from disk only (never the network).

    Returns:
        (tokenizer, note): the tokenizer, or None and a one-line reason (no path recorded, the directory is
        gone, it holds no tokenizer.json / tokenizer.model, or transformers could not read it).
    """
    if not model_path:
        return None, "the run records no model directory, so token ids are shown without their text"
    path = Path(model_path)
    if not path.is_dir():
        return None, f"the model directory {path} no longer exists, so token ids are shown without their text"
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()):
        return None, f"{path} holds no tokenizer (tokenizer.json or tokenizer.model): token ids are shown as ids"
    try:
        return _load(str(path.resolve())), ""
    except Exception as e:  # noqa: BLE001 - transformers raises many types for an unreadable tokenizer
        return None, f"the tokenizer in {path} could not be read ({type(e).__name__}): token ids are shown as ids"


def decode(tokenizer, ids) -> str:
    """``tokenizer.decode(ids)`` of a list of ints, special tokens kept (what the engines scored)."""
    return tokenizer.decode([int(i) for i in ids])


def visible(text: str) -> str:
    """Whitespace made visible for a table cell: the text in quotes with newlines, tabs and carriage returns
    escaped (Python's repr of a str, without its choice of quote)."""
    return '"' + text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r") + '"'
