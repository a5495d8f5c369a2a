"""RL frameworks' own rollout dumps, read as rescore's rollout rows (alignaudit.inputs.rollouts: token_ids,
prompt_length, logprobs), each where the framework writes the rollout engine's logprob of every sampled token.

    NeMo-RL   ``train_data_step{N}.jsonl`` (nemo_rl/algorithms/grpo.py, written through
              Logger.log_batched_dict_as_jsonl in nemo_rl/utils/logger.py): one JSON line per sample, each value a
              batch of one (``"token_ids": [[...]]``, ``"input_lengths": [n]``), token_ids right-padded to the
              step's longest; ``token_loss_mask`` 1 on the tokens the engine generated, ``generation_logprobs`` the
              engine's logprob of token t at index t (0 elsewhere); ``prev_logprobs`` the trainer's, aligned the
              same way (NeMo-RL's token_mult_prob_error compares the two from index 1 on). Read at NeMo-RL
              7ea279ab (2026-08-22).
    slime     ``--save-debug-rollout-data`` files (slime/observability/rollout_data_utils.py
              save_debug_rollout_data): ``torch.save({"rollout_id", "samples": [Sample.to_dict()]})``; a sample's
              ``tokens`` are prompt then response, the last ``response_length`` of them the response, with
              ``rollout_log_probs`` and ``loss_mask`` one per response token (slime/utils/types.py Sample). Read at
              slime 624b824a (2026-08-21). Loaded with ``torch.load(weights_only=True)``: plain values and tensors
              only, no code runs.
One prompt then one response per row: a loss mask with holes (multi-turn rollouts, where tool or environment
tokens sit between generated ones and were not sampled) is refused with the reason, not guessed at. What the
frameworks do not write (how the engine sampled: temperature, top-k, top-p, raw or processed logprobs) is not in
these rows; rescore's sampling options give it.
"""

from __future__ import annotations

from pathlib import Path

from alignaudit.errors import InputError

NEMO_RL_KEYS = ("token_ids", "input_lengths", "token_loss_mask", "generation_logprobs")


def is_nemo_rl(row: dict) -> bool:
    """Whether a JSON row is one of NeMo-RL's train_data_step lines."""
    return all(key in row for key in NEMO_RL_KEYS)


def nemo_rl_rows(path: Path, rows: list[dict], where: list[str]) -> list[dict]:
    """NeMo-RL train_data_step rows as rollout rows; ``where``: each row's line ("line N"). Raises InputError naming
    the line and the problem."""
    out = []
    for i, row in enumerate(rows):
        missing = [key for key in NEMO_RL_KEYS if key not in row]
        if missing:
            raise InputError(
                f"{path}: {where[i]} has no {', '.join(missing)}, which NeMo-RL's train_data_step lines "
                f"hold ({', '.join(NEMO_RL_KEYS)}); the file is damaged or mixes formats"
            )
        ids, length = _one(row["token_ids"]), _one(row["input_lengths"])
        mask, logprobs = _one(row["token_loss_mask"]), _one(row["generation_logprobs"])
        if (
            not all(isinstance(v, list) for v in (ids, mask, logprobs))
            or isinstance(length, bool)
            or not isinstance(length, int)
            or not 1 < length <= min(len(ids), len(mask), len(logprobs))
        ):
            raise InputError(
                f"{path}: {where[i]} is not a NeMo-RL train_data_step sample (token_ids, "
                "token_loss_mask and generation_logprobs as lists at least input_lengths long)"
            )
        start = _response_start(path, where[i], mask[:length])
        out.append({"token_ids": ids[:length], "prompt_length": start, "logprobs": logprobs[start:length]})
    return out


def slime_rows(path: Path) -> list[dict]:
    """A slime debug rollout file's samples as rollout rows. Raises InputError for a file of another kind."""
    import pickle

    import torch

    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise InputError(
            f"{path} is a torch.save file but not one alignaudit reads safely "
            f"({str(e).splitlines()[0][:160]}); rescore reads slime's --save-debug-rollout-data files "
            "(a dict of rollout_id and samples)"
        ) from None
    samples = data.get("samples") if isinstance(data, dict) else None
    if not isinstance(samples, list) or not all(isinstance(s, dict) for s in samples):
        raise InputError(
            f"{path} holds no slime samples (a dict with a list of sample dicts under 'samples'); "
            "rescore reads slime's --save-debug-rollout-data files"
        )
    out = []
    for i, sample in enumerate(samples):
        tokens, n = _plain(sample.get("tokens")), sample.get("response_length")
        logprobs, mask = _plain(sample.get("rollout_log_probs")), _plain(sample.get("loss_mask"))
        if not isinstance(tokens, list) or isinstance(n, bool) or not isinstance(n, int) or not 0 < n < len(tokens):
            raise InputError(f"{path}: sample {i} has no tokens with a response_length inside them")
        if logprobs is None:
            raise InputError(
                f"{path}: sample {i} has no rollout_log_probs (slime records them when the rollout "
                "engine returns logprobs); nothing to rescore"
            )
        if mask is not None and (not isinstance(mask, list) or len(mask) != n):
            raise InputError(
                f"{path}: sample {i}: loss_mask has {len(mask) if isinstance(mask, list) else mask!r} "
                f"entries for {n} response tokens"
            )
        if not isinstance(logprobs, list) or len(logprobs) != n:
            raise InputError(
                f"{path}: sample {i}: rollout_log_probs has "
                f"{len(logprobs) if isinstance(logprobs, list) else logprobs!r} entries for {n} response "
                "tokens"
            )
        # leading response tokens outside the loss mask were not sampled by the engine (a hole in the middle is
        # refused): they are scored as context, their logprobs dropped
        first = _response_start(path, f"sample {i}", [0] + list(mask)) - 1 if mask is not None else 0
        out.append({"token_ids": tokens, "prompt_length": len(tokens) - n + first, "logprobs": logprobs[first:]})
    return out


def _one(value):
    """A NeMo-RL value, written as a batch of one (``[x]``), unwrapped."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _plain(value):
    """Tensors (torch.save may hold them) as lists."""
    return value.tolist() if hasattr(value, "tolist") else value


def _response_start(path: Path, where: str, mask: list) -> int:
    """Index of the first generated token of a loss mask that is 0 on the prompt and 1 on one response after it.

    Raises:
        InputError: no generated token, a generated first token, or holes (multi-turn).
    """
    ones = [j for j, m in enumerate(mask) if m]
    if not ones:
        raise InputError(f"{path}: {where} has no generated token (its loss mask is all 0)")
    start = ones[0]
    if start == 0:
        raise InputError(
            f"{path}: {where}: the loss mask marks the first token as generated; a rollout starts with a prompt token"
        )
    if len(ones) != len(mask) - start:
        raise InputError(
            f"{path}: {where}: the loss mask has holes (multi-turn: tool or environment tokens between "
            "generated ones, which the engine did not sample); rescore takes one prompt then one "
            "response: split such rollouts into one row per generated span"
        )
    return start
