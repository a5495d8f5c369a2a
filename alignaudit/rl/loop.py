"""The RL experiment: N GRPO steps, the train/rollout alignment checked at every step.

Each step (both engines stay up in one long-lived worker each, alignaudit.workers.rl_session):
    1. rollout   the inference engine samples ``group_size`` completions per prompt (request i seeded with
                 seed + i, the same at every step, so that with unchanged weights every step repeats) and
                 records each sampled token's logprob while decoding; shaped as frameworks sample (vLLM: a
                 group is one request with n = G, EOS ends a completion unless --ignore-eos, no prompt
                 logprobs, so the G completions read the prompt's KV blocks from the prefix cache);
                 with ``sleep_level``, the engine then sleeps (its weights to host memory, its KV cache
                 freed) while the trainer works, and wakes before the sync;
    2. rescore   the trainer computes the same tokens' logprobs (old_logprobs), eval mode, no gradient;
    3. compare   every generated token, trainer vs rollout: bitwise, ULP, RL metrics (comparison/token_diff.py);
                 with ``full_vocab``, also each token's whole fp32 log-softmax row on both sides (the trainer's from
                 its rescoring forward, the rollout's from vLLM's sampler while decoding: engines/vllm/vocab.py
                 DecodeRows), through one file per side (capture.rundir.STEP_VOCAB_ROWS), each row checked bit for
                 bit against the logprob that side recorded for the token, then exact KL both ways, total
                 variation, top-1 / top-5 (comparison/vocab.py) per token and per step;
    4. reward    the chosen reward per completion (grpo.REWARDS, the task, or the user's MODULE:FUNCTION, given
                 the prompt file's columns), GRPO group advantages (grpo.py);
    5. update    the trainer's forward with gradient, the clipped loss with ratio exp(lp_train - lp_rollout),
                 gradient clipping, one optimizer step;
    6. sync      the trainer's weights in HF names into the running inference engine (model.load_weights),
                 through a file (CPU) or CUDA IPC handles (CUDA; alignaudit.engines.weight_transfer); first
                 what the update changed against the weights the engine held (elements, max |delta w|),
                 then the check: on the CPU the sha256 of every tensor on both sides and a probe of every
                 packed vLLM GEMM against one packed afresh from the loaded weight; on CUDA every held
                 tensor against the trainer's own memory, bit for bit on the GPU; and (a tensor-parallel
                 trainer) every replicated parameter equal on all ranks: bit-equal only if all agree.
    7. eval      (``held``: --eval-prompts / --eval-every) the held-out prompts answered greedily by the rollout engine
                 and scored, before step 1, every K steps and after the last (alignaudit.rl.evaluation).
Records (in ``out``): run.json (every setting, written first; sealed at the end with the sha256 of every
file below, alignaudit.comparison.integrity.seal), steps.parquet (one row per step, rewritten after every step, so it is
readable after a crash or Ctrl-C), tokens/step-NNNNN.parquet (every generated token of the step;
``token_rows=False`` skips them), eval.parquet and eval/ (the held-out evaluations), steps.png (the per-step series),
worker logs; with ``log_to``, the same rows as TensorBoard event files (tensorboard/) and an offline W&B run (wandb/),
alignaudit.rl.export.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import pandas as pd

from alignaudit.capture.rundir import (
    EVAL,
    EVAL_DIR,
    INFER_LOG,
    PLOT,
    RUN,
    STEP_TOKENS,
    STEP_VOCAB_DIR,
    STEP_VOCAB_ROWS,
    STEP_VOCAB_TENSOR,
    STEPS,
    SYNC_DIR,
    SYNC_WEIGHTS,
    TOKENS_DIR,
    TRAIN_LOG,
)
from alignaudit.comparison.importance import FIELDS
from alignaudit.comparison.integrity import marks_failure, seal
from alignaudit.comparison.token_diff import compare_tokens, summarize_tokens
from alignaudit.errors import EngineError
from alignaudit.inputs.request import Replay, Request
from alignaudit.rl.evaluation import Evaluations, HeldOut
from alignaudit.rl.export import StepExport
from alignaudit.rl.grpo import group_advantages
from alignaudit.rl.memory import MemoryPlan
from alignaudit.rl.reward import reward_function
from alignaudit.rl.settings import RLSettings
from alignaudit.rl.step_prompts import StepPrompts, prompts_digest
from alignaudit.rl.user_reward import UserReward, reward_name
from alignaudit.workers.job import SessionJob
from alignaudit.workers.session import Session

DIGESTS = {
    "file": "sha256 of the sorted {name: sha256 of the tensor's bytes} (trainer side)",
    "cuda_ipc": "weight_transfer.fingerprint of the rollout engine's weights after loading (GPU)",
}


@marks_failure
def run_rl(
    request: Request,
    rl: RLSettings,
    out: Path,
    on_step=None,
    on_stage=None,
    memory: MemoryPlan | None = None,
    held: HeldOut | None = None,
    on_eval=None,
) -> pd.DataFrame:
    """Run the loop into ``out`` (see the module docstring); returns the steps table. ``memory``: the
    estimate of alignaudit.rl.memory.rl_plan (CUDA), recorded, its optimizer offload given to the trainer. ``held``:
    the held-out prompts (rl.request.rl_request), scored as alignaudit.rl.evaluation says; ``on_eval(row)`` after each.

    Raises:
        InputError: a setting the engines refuse. EngineError: an engine worker died (completed steps stay
            on disk).
    """
    started = time.monotonic()
    settings = {f.name: getattr(rl, f.name) for f in fields(rl)}  # not asdict: it deep-copies a callable reward
    record = {
        **request.record("rl"),
        "rl": {**settings, "reward": reward_name(rl.reward)},
        "status": "running",
        "memory_plan": memory.record() if memory else None,
        "eval": held.record() if held else None,
    }
    (out / RUN).write_text(json.dumps(record, indent=2, default=str) + "\n")
    (out / SYNC_DIR).mkdir(exist_ok=True)
    if rl.token_rows:
        (out / TOKENS_DIR).mkdir(exist_ok=True)
    if rl.full_vocab:
        (out / STEP_VOCAB_DIR).mkdir(exist_ok=True)
    stage = on_stage or (lambda text: None)
    sessions: list[Session] = []
    export = StepExport(tuple(rl.log_to), out, record) if rl.log_to else None
    try:
        stage(f"starting {request.train.label()} (trainer) and {request.infer.label()} (rollout)")
        trainer = _session(
            sessions,
            request,
            "trainer",
            out / TRAIN_LOG,
            lr=rl.lr,
            clip_grad=rl.clip_grad,
            offload_fraction=memory.offload_fraction if memory else 0.0,
            kl_coef=rl.kl_coef,
        )
        rollout = _session(sessions, request, "rollout", out / INFER_LOG)
        draw = StepPrompts(len(request.batch.sequences), rl.prompts_per_step, request.sampling.seed)
        repeats = rl.group_size // request.sampling.group_size  # one request per prompt with n = G, or G requests
        rollout.call(
            "start", **_engine_size(request, draw.per_step, repeats, held), engine_mode=request.sampling.engine_mode
        )
        first = [list(request.batch.sequences[i]) for i in draw.peek() for _ in range(repeats)]
        replay = _replay(request, first)
        record["engines"] = {
            "train": trainer.call("settings", replay=replay)["settings"],
            "infer": rollout.call("settings")["settings"],
        }
        how = transport(request)
        record["weight_sync"] = {"transport": how, "digest": DIGESTS[how]}
        record["initial_sync"] = _sync(trainer, rollout, out, how)
        (out / RUN).write_text(json.dumps(record, indent=2, default=str) + "\n")
        rows, reward = [], reward_function(rl.reward, request.spec)
        if isinstance(reward.score, UserReward):
            record["reward_function"] = reward.score.record()
        evals = Evaluations(held, rollout, request.sampling.to_dict(), reward, out, on_eval)
        evals.after(0, rl.steps)
        for step in range(1, rl.steps + 1):
            chosen, epoch = draw.next()
            prompts, columns = _step_prompts(request, chosen, repeats)
            replay = _replay(request, prompts)
            row = _step(step, request, rl, reward, columns, trainer, rollout, prompts, replay, out, how)
            rows.append(
                {**row, "epoch": epoch, "prompts_digest": prompts_digest([request.batch.sequences[i] for i in chosen])}
            )
            steps = pd.DataFrame(rows)
            steps.to_parquet(out / STEPS, index=False)
            if export:
                export.log(rows[-1])
            if on_step:
                on_step(rows[-1])
            elapsed = time.monotonic() - started
            stop = rl.max_seconds and step < rl.steps and elapsed >= rl.max_seconds
            evals.after(step, step if stop else rl.steps)
            if stop:
                record["stopped"] = {"by": "max_seconds", "after_step": step, "elapsed_s": round(elapsed, 3)}
                break
        record["steps_run"] = len(rows)  # written with the seal: a failed run's steps are steps.parquet's rows
        record.setdefault("stopped", None)
        _remove_scratch(out, rl)
        # sealed before the engines shut down (tens of seconds for vLLM and Megatron on a GPU): a deadline that cuts
        # the shutdown leaves a finished run finished (2026-12-07: two runs cut so were recorded as interrupted)
        _seal(request, out, record, steps, evals.table)
    finally:
        _close_all(sessions)
        _remove_scratch(out, rl)
        if export:
            export.close()
    return steps


def _close_all(sessions: list[Session]) -> None:
    """Close every engine session, each even where one before it raised (Ctrl-C included); then raise the first."""
    failures = []
    for session in sessions:
        try:
            session.close()
        except BaseException as error:  # noqa: BLE001 - re-raised below, after the other workers are stopped
            failures.append(error)
    if failures:
        raise failures[0]


def _remove_scratch(out: Path, rl: RLSettings) -> None:
    """Delete what a run leaves that is not a record (idempotent): the file transport's last export (the trainer's
    whole weights, 16 GB at the Qwen3-8B shape) and, unless kept, the per-step vocabulary rows."""
    (out / SYNC_DIR / SYNC_WEIGHTS).unlink(missing_ok=True)
    if (out / SYNC_DIR).is_dir() and not any((out / SYNC_DIR).iterdir()):
        (out / SYNC_DIR).rmdir()
    if rl.full_vocab and not rl.keep_vocab_rows and (out / STEP_VOCAB_DIR).is_dir():
        for path in (out / STEP_VOCAB_DIR).glob("*"):
            path.unlink()
        (out / STEP_VOCAB_DIR).rmdir()


def _seal(request: Request, out: Path, record: dict, steps: pd.DataFrame, evals: pd.DataFrame | None) -> None:
    """steps.png, then run.json sealed over the run's records (comparison.integrity.seal)."""
    from alignaudit.rl.records import plot_steps

    title = f"{request.spec.name}: {request.train.label()} vs {request.infer.label()}"
    plot_steps(steps, out / PLOT, evals, title=title)
    (out / RUN).write_text(
        json.dumps(seal(record, out, (STEPS, TOKENS_DIR, PLOT, STEP_VOCAB_DIR, EVAL, EVAL_DIR)), indent=2, default=str)
        + "\n"
    )


def _session(sessions: list[Session], request: Request, role: str, log: Path, **extra) -> Session:
    run = request.train if role == "trainer" else request.infer
    session = Session(SessionJob(role, run.engine, request.spec, run.settings, **extra), log)
    sessions.append(session)
    return session


def transport(request: Request) -> str:
    """``cuda_ipc`` when trainer and rollout engine both run on CUDA (one GPU: the device machine's
    CUDA_VISIBLE_DEVICES), else ``file`` (alignaudit.engines.weight_transfer)."""
    return "cuda_ipc" if request.train.settings.device == request.infer.settings.device == "cuda" else "file"


def _sync(trainer: Session, rollout: Session, out: Path, how: str) -> dict:
    """Trainer weights (HF names) into the running rollout engine, checked bit for bit (see transport)."""
    path = str(out / SYNC_DIR / SYNC_WEIGHTS)
    exported = trainer.call("export", transport=how, path=path)
    loaded = rollout.call("load_weights", transport=how, path=path, handles=exported.get("handles"))
    if how == "file":
        sent, held = exported["checksums"], loaded["checksums"]
        differing = sorted(name for name in set(sent) | set(held) if sent.get(name) != held.get(name))
        tensors, digest = len(sent), hashlib.sha256(json.dumps(sent, sort_keys=True).encode()).hexdigest()
    else:
        differing, digest, tensors = loaded["differing"], loaded["digest"], loaded["tensors"]
    diverged = exported.get("replicas_diverged", [])
    update = loaded["update"]
    return {
        "bit_equal": not differing and not loaded["stale"] and not diverged,
        "transport": how,
        "tensors": tensors,
        "differing": differing,
        "stale_packed": loaded["stale"],
        "replicas_diverged": diverged,
        "weights_digest": digest,
        **update,
    }


def _step_prompts(request: Request, chosen: list[int], repeats: int) -> tuple[list[list[int]], dict[str, list]]:
    """The requests of a step that drew the prompts ``chosen`` (indices into the batch), each ``repeats`` times, and
    the prompt file's columns, one value per completion the rollout returns (a request's ``group_size`` in turn)."""
    prompts = [list(request.batch.sequences[i]) for i in chosen for _ in range(repeats)]
    per_prompt = repeats * request.sampling.group_size
    columns = {
        name: [values[i] for i in chosen for _ in range(per_prompt)] for name, values in request.batch.columns.items()
    }
    return prompts, columns


def _engine_size(request: Request, per_step: int, repeats: int, held: HeldOut | None) -> dict:
    """The rollout engine's size (Engine.start): its longest sequence, the most sequences and tokens one call runs,
    over every step's draw (the ``per_step`` longest prompts, ``repeats`` requests of ``group`` completions each)
    and the held-out evaluation (one greedy completion per prompt)."""
    new, group = request.sampling.max_new_tokens, request.sampling.group_size
    longest = sorted((len(p) for p in request.batch.sequences), reverse=True)[:per_step]
    size = {
        "max_len": longest[0] + new,
        "max_seqs": per_step * repeats * group,
        "total_tokens": group * repeats * (sum(longest) + per_step * new),
    }
    if held:
        lengths = [len(p) for p in held.batch.sequences]
        size = {
            "max_len": max(size["max_len"], max(lengths) + new),
            "max_seqs": max(size["max_seqs"], len(lengths)),
            "total_tokens": max(size["total_tokens"], sum(lengths) + len(lengths) * new),
        }
    return size


def _prompt_lengths(request: Request, prompts: list) -> list[int]:
    """Per sequence the rollout returns (a prompt's G completions in turn), its prompt's length."""
    return [len(p) for p in prompts for _ in range(request.sampling.group_size)]


def _replay(request: Request, prompts: list) -> dict | None:
    """The sampling transform the trainer replays at every step's score and update, where the rollout engine
    records processed logprobs (Replay.to_dict; computed once a run, the prompts being the same every step), else
    None."""
    from alignaudit.engines.checks import processed_logprobs

    if not processed_logprobs(request.infer):
        return None
    return Replay.of(request.sampling.to_dict(), _prompt_lengths(request, prompts)).to_dict()


def _step(
    step: int,
    request: Request,
    rl: RLSettings,
    reward,
    columns: dict,
    trainer: Session,
    rollout: Session,
    prompts: list,
    replay: dict | None,
    out: Path,
    how: str,
) -> dict:
    t0 = time.perf_counter()
    sampling = request.sampling.to_dict()
    prompt_lengths = _prompt_lengths(request, prompts)
    rows = {
        side: str(out / STEP_VOCAB_DIR / STEP_VOCAB_ROWS.format(step=step, side=side)) for side in ("train", "infer")
    }

    def spec(side: str) -> dict | None:  # where a worker writes its rows (rl --full-vocab)
        if not rl.full_vocab:
            return None
        return {"path": rows[side], "tensor": STEP_VOCAB_TENSOR, "prompt_lengths": prompt_lengths}

    rolled = rollout.call("rollout", prompts=prompts, sampling=sampling, vocab_rows=spec("infer"))
    rollout_s = time.perf_counter() - t0
    sleep = rollout.call("sleep", level=rl.sleep_level) if rl.sleep_level else None  # timed apart: sleep_s
    t1 = time.perf_counter()
    sequences = rolled["sequences"]
    scored = trainer.call("score", sequences=sequences, replay=replay, vocab_rows=spec("train"))["logprobs"]
    t2 = time.perf_counter()
    tokens = _generated_tokens(step, sequences, prompt_lengths, scored, rolled["logprobs"])
    vocab: dict = {}
    if rl.full_vocab:
        tokens, vocab = _vocab(step, tokens, rows, request.spec.vocab_size, rl.keep_vocab_rows)
        vocab["vocab_s"] = round(time.perf_counter() - t2, 3)  # reading and measuring the rows, apart from update_s
        t2 = time.perf_counter()
    summary = summarize_tokens(tokens, request.clip_eps, request.importance)
    rewards = reward(
        [s[:p] for s, p in zip(sequences, prompt_lengths, strict=True)],
        [s[p:] for s, p in zip(sequences, prompt_lengths, strict=True)],
        step,
        columns,
        f"step {step}",
    )
    advantages = group_advantages(rewards, rl.group_size)
    rollout_gen = [lp[p - 1 :] for lp, p in zip(rolled["logprobs"], prompt_lengths, strict=True)]
    update = trainer.call(
        "train_step",
        sequences=sequences,
        prompt_lengths=prompt_lengths,
        advantages=advantages,
        rollout_logprobs=rollout_gen,
        clip_eps=request.clip_eps,
        replay=replay,
    )
    t3 = time.perf_counter()
    wake = rollout.call("wake_up") if rl.sleep_level else None  # timed apart: wake_s
    sync_started = time.perf_counter()
    sync = _sync(trainer, rollout, out, how)
    t4 = time.perf_counter()
    forward = np.array([x for seq in update["forward_logprobs"] for x in seq], dtype=np.float32)
    if rl.token_rows:
        tokens.to_parquet(out / TOKENS_DIR / STEP_TOKENS.format(step=step), index=False)
    rl_stats = summary["rl"]
    return {
        "step": step,
        "tokens": summary["tokens_compared"],
        "mismatches": summary["mismatches"],
        "mismatch_fraction": summary["mismatch_fraction"],
        "nan_tokens": summary["nan_tokens"]["train"] + summary["nan_tokens"]["infer"],
        "positive_tokens": summary["positive_tokens"]["train"] + summary["positive_tokens"]["infer"],
        "ulp_max": summary["ulp_max"],
        "max_abs_diff": summary["max_abs_diff"],
        "mean_diff": summary["mean_diff"],
        "ratio_min": rl_stats["ratio_min"],
        "ratio_max": rl_stats["ratio_max"],
        "clip_fraction": rl_stats["clip_fraction"],
        "token_mult_prob_error": rl_stats["token_mult_prob_error"],
        "kl_k3": rl_stats["kl_k3_mean"],
        "prob_diff_max": rl_stats["prob_diff_max"],
        "prob_diff_mean": rl_stats["prob_diff_mean"],
        **importance_columns(summary["importance"]),
        **vocab,
        "reward_mean": float(np.mean(rewards)),
        **_shape_columns(
            sequences,
            prompt_lengths,
            request.sampling.max_new_tokens,
            rolled["prefix_cache_hits"],
            rolled.get("arrivals"),
        ),
        **_sleep_columns(sleep, wake),
        "loss": update["loss"],
        **({"kl_ref": update["kl_ref"]} if update["kl_ref"] is not None else {}),
        "grad_norm": update["grad_norm"],
        "train_clip_fraction": update["clip_fraction"],
        "train_forward_equal": bool(
            np.array_equal(forward.view(np.int32), tokens["lp_train"].to_numpy(dtype=np.float32).view(np.int32))
        ),
        "sync_bit_equal": sync["bit_equal"],
        "sync_tensors_differing": len(sync["differing"]),
        "sync_stale_packed": len(sync["stale_packed"]),
        "sync_replicas_diverged": len(sync["replicas_diverged"]),
        "weights_digest": sync["weights_digest"],
        "weights_changed": sync["changed"],
        "weights_changed_fraction": sync["changed"] / sync["elements"] if sync["elements"] else 0.0,
        "max_abs_dw": sync["max_abs_dw"],
        "seconds": round(t4 - t0, 3),
        "rollout_s": round(rollout_s, 3),
        "rescore_s": round(t2 - t1, 3),
        "update_s": round(t3 - t2, 3),
        "optimizer_s": update["optimizer_s"],
        "sync_s": round(t4 - sync_started, 3),
    }


def _shape_columns(
    sequences: list, prompt_lengths: list, max_new_tokens: int, prefix_cache_hits, arrivals: dict | None
) -> dict:
    """The rollout's shape, measured: completion lengths (tokens), how many completions ended before
    ``max_new_tokens`` (at EOS or a stop token), the prompt tokens the engine read from its prefix cache (vLLM's
    count; None where the engine reports none) and, in --engine-mode async, how the requests arrived
    (async_rollout.Arrivals: those submitted while an earlier one was still running, the most running at once;
    None offline)."""
    lengths = [len(s) - p for s, p in zip(sequences, prompt_lengths, strict=True)]
    return {
        "completion_len_mean": float(np.mean(lengths)),
        "completion_len_min": int(min(lengths)),
        "completions_ended_early": sum(n < max_new_tokens for n in lengths),
        "prefix_cache_hits": prefix_cache_hits,
        "arrived_while_running": arrivals["arrived_while_running"] if arrivals else None,
        "max_running_requests": arrivals["max_running"] if arrivals else None,
    }


def _sleep_columns(sleep: dict | None, wake: dict | None) -> dict:
    """What sleeping gave back and waking took (GiB of device memory, measured by the rollout worker), and how long
    each took; nothing when the engine does not sleep."""
    if sleep is None or wake is None:  # both or neither: rl.sleep_level
        return {}
    return {
        "sleep_freed_gib": sleep["freed_bytes"] / 2**30,
        "sleep_s": sleep["seconds"],
        "wake_taken_gib": wake["taken_bytes"] / 2**30,
        "wake_s": wake["seconds"],
    }


def _vocab(step: int, tokens: pd.DataFrame, rows: dict, vocab_size: int, keep: bool) -> tuple[pd.DataFrame, dict]:
    """The step's tokens with the per-token vocab columns (comparison.vocab.row_columns) and the step's
    comparison.vocab.step_columns, from the rows each worker wrote to ``rows[side]`` (deleted here unless ``keep``).

    Raises:
        EngineError: a file does not hold one row per generated token, or a row's entry at its token is not bit
            for bit the logprob that engine recorded for it (the row belongs to another token or formula).
    """
    from alignaudit.capture.vocab_rows import read_step_rows
    from alignaudit.comparison.vocab import row_columns, step_columns, summarize_vocab

    train, infer = (read_step_rows(rows[side], len(tokens), vocab_size) for side in ("train", "infer"))
    tokens = row_columns(tokens, train, infer)
    del train, infer
    if not keep:
        for path in rows.values():
            Path(path).unlink()
    record = summarize_vocab(tokens)
    for side, engine in (("infer", "rollout"), ("train", "trainer")):
        bad = record["row_token_mismatches"][side]
        if bad:
            first = tokens.loc[~tokens[f"vocab_row_matches_{side}"]].iloc[0]
            raise EngineError(
                f"step {step}: {bad} of the {engine}'s full-vocabulary rows do not hold the logprob it "
                f"recorded for their token (first: seq {first['seq']}, pos {first['pos']}); the rows "
                "are not the ones its logprobs were computed from"
            )
    return tokens, step_columns(record)


def importance_columns(importance: dict) -> dict:
    """The step record's IS diagnostics: every number of summary["importance"] (importance.FIELDS) as
    ``is_<name>``; the thresholds they used are run.json's ``importance``."""
    return {f"is_{name}": importance[name] for name in FIELDS}


def _generated_tokens(step: int, sequences: list, prompt_lengths: list, train: list, infer: list) -> pd.DataFrame:
    """One row per generated token: the compare_tokens columns, with ``step``."""
    rows: dict[str, list] = {"seq": [], "pos": [], "token_id": [], "lp_train": [], "lp_infer": []}
    for i, (seq, p, lt, li) in enumerate(zip(sequences, prompt_lengths, train, infer, strict=True)):
        for pos in range(p, len(seq)):
            rows["seq"].append(i)
            rows["pos"].append(pos)
            rows["token_id"].append(seq[pos])
            rows["lp_train"].append(lt[pos - 1])
            rows["lp_infer"].append(li[pos - 1])
    frame = pd.DataFrame(
        {
            "seq": np.asarray(rows["seq"], dtype=np.int32),
            "pos": np.asarray(rows["pos"], dtype=np.int32),
            "token_id": np.asarray(rows["token_id"], dtype=np.int32),
            "generated": True,
            "lp_train": np.asarray(rows["lp_train"], dtype=np.float32),
            "lp_infer": np.asarray(rows["lp_infer"], dtype=np.float32),
        }
    )
    return compare_tokens(frame).assign(step=step)
