"""The run directory: the name of every file alignaudit writes, and which entries each command writes.

The one module that spells these names; writers (pipelines/runs.py, workers/, rl/, pipelines/ablate.py,
comparison/gate.py), readers (comparison/integrity.py, reports/html/) and the output-directory guard
(capture/outdir.py) import them from here, so a reader can never look for a file under a name its writer does
not use. Layout of a compare run::

    run.json                  the sealed record (comparison/integrity.py): status, settings, sha256 of every output
    summary.json, tokens.parquet, sequences.parquet
    train/, infer/            one capture per side: manifest.json, logprobs.parquet, request.json,
                              worker.log, ops/ (op store: index.parquet, fingerprints.parquet, chunk-*.safetensors),
                              vocab/ (compare --full-vocab: seq-NNNNN.safetensors, each sequence's log-softmax rows)
    train-unreplayed/         compare --replay-routing: the train engine on its own routing (train/ replays infer's)

bisect adds ops-natural.parquet / ops-forced.parquet and bisect.json; rl writes steps.parquet, steps.png,
tokens/step-NNNNN.parquet, sync/weights.safetensors and (--full-vocab --keep-vocab-rows)
vocab/step-NNNNN-SIDE.safetensors; ablate ablate.parquet, ablate.json and configs/;
gate verdict.json, junit.xml and summary.md beside the run it judges; report report.html.
"""

from __future__ import annotations

import fnmatch

SIDES = ("train", "infer")  # a comparison's two captures, as directory names and record roles

UNREPLAYED = "train-unreplayed"  # compare --replay-routing: the train engine on its own routing

# one engine's capture
MANIFEST = "manifest.json"
MANIFEST_TMP = MANIFEST + ".tmp"
LOGPROBS = "logprobs.parquet"
REQUEST = "request.json"
WORKER_LOG = "worker.log"
OPS_DIR = "ops"
INDEX = "index.parquet"
FINGERPRINTS = "fingerprints.parquet"
CHUNKS = "chunk-*.safetensors"
VOCAB_DIR = "vocab"  # full-vocabulary rows (alignaudit.capture.vocab_rows)
VOCAB_ROWS = "seq-{seq:05d}.safetensors"
VOCAB_ROWS_GLOB = "seq-[0-9][0-9][0-9][0-9][0-9].safetensors"

# results
RUN = "run.json"
SUMMARY = "summary.json"
TOKENS = "tokens.parquet"
SEQUENCES = "sequences.parquet"
BISECT = "bisect.json"
OPS_FILES = {"natural": "ops-natural.parquet", "forced": "ops-forced.parquet", "diff": "ops.parquet"}
ABLATE_PARQUET = "ablate.parquet"
ABLATE_JSON = "ablate.json"
CONFIGS = "configs"
STEPS = "steps.parquet"
PLOT = "steps.png"
TOKENS_DIR = "tokens"
STEP_TOKENS = "step-{step:05d}.parquet"
SYNC_DIR = "sync"
# rl --eval-prompts / --eval-every: one row per held-out evaluation, and each one's rows, one per prompt
EVAL = "eval.parquet"
EVAL_DIR = "eval"
EVAL_ROWS = "step-{step:05d}.parquet"
SYNC_WEIGHTS = "weights.safetensors"
# rl --full-vocab: each side's rows of the step's generated tokens, one tensor float32 [tokens, V] in the order of
# tokens/step-N.parquet; deleted once the step's measures are computed, kept (and sealed) with --keep-vocab-rows
STEP_VOCAB_DIR = "vocab"
STEP_VOCAB_ROWS = "step-{step:05d}-{side}.safetensors"
STEP_VOCAB_TENSOR = "logprobs"
TRAIN_LOG, INFER_LOG = "train.log", "infer.log"
TENSORBOARD_DIR = "tensorboard"  # rl --log-to tensorboard: event files (alignaudit.rl.export)
WANDB_DIR = "wandb"  # rl --log-to wandb: what wandb.init(mode="offline", dir=RUN) writes there
VERDICT = "verdict.json"
JUNIT = "junit.xml"
SUMMARY_MD = "summary.md"
REPORT = "report.html"

# the output-directory guard (alignaudit.capture.outdir)
MARKER = ".alignaudit-outputs"
LOCK = ".alignaudit.lock"
# the complete results --force replaced, kept until the new outputs are complete, and the two names it passes through
# (capture/outdir.py)
PREVIOUS, STAGING, DROPPING = ".alignaudit-previous", ".alignaudit-previous.staging", ".alignaudit-previous.dropping"
RESERVED = (MARKER, LOCK, PREVIOUS, STAGING, DROPPING)  # alignaudit's own names in an output directory: never an output

# Top-level entries each command writes in its output directory (alignaudit.capture.outdir claims them first).
CAPTURE_OUTPUTS = (MANIFEST, MANIFEST_TMP, LOGPROBS, OPS_DIR, VOCAB_DIR, REQUEST, WORKER_LOG)
COMPARE_OUTPUTS = (RUN, *SIDES, UNREPLAYED, TOKENS, SEQUENCES, SUMMARY)
BISECT_OUTPUTS = (
    RUN,
    *SIDES,
    "infer-forced",
    "train-as-configured",
    "infer-as-configured",
    OPS_FILES["natural"],
    OPS_FILES["forced"],
    BISECT,
)
DIFF_OUTPUTS = (TOKENS, SEQUENCES, SUMMARY, OPS_FILES["diff"])  # and RUN, written last
GATE_OUTPUTS = (VERDICT, JUNIT, SUMMARY_MD)
RL_OUTPUTS = (
    RUN,
    STEPS,
    PLOT,
    TOKENS_DIR,
    EVAL,
    EVAL_DIR,
    SYNC_DIR,
    STEP_VOCAB_DIR,
    TRAIN_LOG,
    INFER_LOG,
    "train." + REQUEST,
    "infer." + REQUEST,
    TENSORBOARD_DIR,
    WANDB_DIR,
)
ABLATE_OUTPUTS = (RUN, CONFIGS, ABLATE_PARQUET, ABLATE_JSON)


def rl_outputs(log_to: tuple[str, ...]) -> tuple[str, ...]:
    """What an rl run claims in its directory: RL_OUTPUTS, the sinks' folders only where ``--log-to`` names them (a
    claimed folder is one --force removes whole later; a run that never wrote one must not claim a user's)."""
    sinks = {"tensorboard": TENSORBOARD_DIR, "wandb": WANDB_DIR}
    return tuple(
        name for name in RL_OUTPUTS if name not in sinks.values() or any(sinks.get(sink) == name for sink in log_to)
    )


# the result files each command's run.json must list (alignaudit.comparison.integrity checks them)
RESCORE_OUTPUTS = (RUN, *SIDES, TOKENS, SEQUENCES, SUMMARY)  # the rollout file's capture plays the infer side
RESULTS = {
    "compare": (TOKENS, SEQUENCES, SUMMARY),
    "diff": (TOKENS, SEQUENCES, SUMMARY),
    "rescore": (TOKENS, SEQUENCES, SUMMARY),
    "rl": (STEPS,),
}
TOKEN_RUNS = ("compare", "diff", "rescore")  # the commands whose run compares two captures token by token
JUDGED = (*TOKEN_RUNS, "rl")  # the records gate judges

# Directories a library writes whole for alignaudit (rl --log-to): --force removes whatever they hold.
LIBRARY_DIRS = (TENSORBOARD_DIR, WANDB_DIR)
# Files alignaudit writes inside the directories it creates (captures and their op stores; rl's sync/, tokens/ and
# vocab/; the comparison of each row of ablate's configs/), each pattern with the folder it sits in: what --force may
# remove there. A file of one of these names anywhere else (a user's manifest.json in a folder of their own inside
# train/) is not alignaudit's.
CAPTURE_DIRS = (*SIDES, UNREPLAYED, "infer-forced", "train-as-configured", "infer-as-configured")
RUN_FILES = (RUN, SUMMARY, TOKENS, SEQUENCES, BISECT, OPS_FILES["natural"], REPORT, MARKER, LOCK)
INNER_LAYOUT: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    ((MANIFEST, MANIFEST_TMP, LOGPROBS, REQUEST, WORKER_LOG), CAPTURE_DIRS),
    ((INDEX, CHUNKS, FINGERPRINTS), (OPS_DIR,)),
    ((VOCAB_ROWS_GLOB, "step-[0-9][0-9][0-9][0-9][0-9]-*.safetensors"), (VOCAB_DIR,)),
    ((SYNC_WEIGHTS,), (SYNC_DIR,)),
    (("step-[0-9][0-9][0-9][0-9][0-9].parquet",), (TOKENS_DIR, EVAL_DIR)),
)


def alignaudit_wrote(parts: tuple[str, ...]) -> bool:
    """Whether a file at ``parts`` (its path from the output directory, the top-level entry first) has a name and a
    place alignaudit writes: INNER_LAYOUT's names in their folders, or RUN_FILES directly in a row of configs/."""
    name, parent = parts[-1], parts[-2] if len(parts) > 1 else ""
    if len(parts) == 3 and parts[0] == CONFIGS:
        return any(fnmatch.fnmatch(name, pattern) for pattern in RUN_FILES)
    return any(
        parent in folders and any(fnmatch.fnmatch(name, pattern) for pattern in names)
        for names, folders in INNER_LAYOUT
    )
