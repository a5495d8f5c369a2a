"""vLLM generation throughput, side by side in one run: default, VLLM_BATCH_INVARIANT=1, alignaudit strict
(portable and native exp).

Each configuration runs in its own process (the environment variables act at import and at engine start):
the same model config with vLLM's dummy weights (load_format="dummy": the shape is what costs, not the
values), the same token-id prompts, ``LLM.generate`` with CUDA graphs and torch.compile as vLLM defaults
them. One warm-up request, then (with --prefill-batches N) N batches of prompts of their own with one new token
each, then --batches batches of every prompt at once, each of new token ids (the same prompts again would hit
vLLM's prefix cache and skip the prefill), each timed on the host (generate returns when done), then N one-token
batches again. The first batches include one-time work (JIT builds of launch shapes not seen before: a strict
kernel specializes on its integer arguments; strict_builds_per_batch counts them); the rate is that of the median
batch after the first (steady state; the last batch's alone, the rate before 2026-12-05, is kept as
last_batch_tokens_per_s: at the RL rollout shape one batch of four ran 15% slower than the others), and
batch_seconds lists them all, host_events_per_batch what in each could stall the host outside the kernels (the
garbage collector's seconds and collections, CUDA allocator calls and retries: HostEvents; the host seconds
of the eager attention calls and their max_seq_len: AttentionTrace).
Prints one line per configuration and the ratios to the default; --json writes the records.

--capture-size N sets vLLM's max_cudagraph_capture_size for every configuration of the run (its default is 512 and,
below that, what max_num_seqs allows): a prefill step of up to N rows then replays piecewise graphs, where a larger
one runs eagerly. The strict ops are opaque custom ops, so an eager step costs strict far more host time than
the default's compiled code (docs/log/findings.md, 2026-12-05); this measures how much of that graphs remove.

    python bench/vllm_generate.py --model Qwen3-8B --prompts 64 --prompt-len 512 --new-tokens 256
    python bench/vllm_generate.py --configs default,strict --json out.json

Needs a CUDA vLLM (bench/gpu_run.sh vllm-bench) and a preset name (alignaudit.arch.PRESETS) or a directory
holding a config.json.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CONFIGS = {  # name -> environment added for that process
    "default": {},
    "batch-invariant": {"VLLM_BATCH_INVARIANT": "1"},
    "strict": {"ALIGNAUDIT_STRICT": "all"},
    "strict-native-exp": {"ALIGNAUDIT_STRICT": "all", "ALIGNAUDIT_STRICT_EXP": "native"},
    # [30]: FlashAttention-3 at one key split as the strict attention (alignaudit_kernels.attention.flash)
    "strict-flash": {"ALIGNAUDIT_STRICT": "all", "ALIGNAUDIT_STRICT_ATTENTION": "flash"},
    "strict+batch-invariant": {"ALIGNAUDIT_STRICT": "all", "VLLM_BATCH_INVARIANT": "1"},
}


def config_dir(model: str) -> str:
    """A directory with the model's config.json: ``model`` itself, or a preset's config written once."""
    if Path(model, "config.json").is_file():
        return model
    from alignaudit.arch import find_preset

    preset = find_preset(model)
    if preset is None:
        raise SystemExit(f"{model!r}: not a directory with config.json nor a preset")
    target = Path(tempfile.gettempdir(), f"aa-config-{preset.name}")
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text(json.dumps(preset.config, indent=2))
    return str(target)


def worker(args) -> dict:
    """One configuration, in this process: start, warm up, time the batch."""
    import torch
    from vllm import LLM, SamplingParams

    if os.environ.get("ALIGNAUDIT_STRICT"):
        from alignaudit.engines.vllm import plugin as vllm_plugin

        vllm_plugin.register()
    started = time.perf_counter()
    capture = {"compilation_config": {"max_cudagraph_capture_size": args.capture_size}} if args.capture_size else {}
    llm = LLM(
        model=args.model,
        load_format="dummy",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        seed=0,
        max_model_len=args.max_model_len or args.prompt_len + args.new_tokens + 64,
        max_num_seqs=args.prompts * args.n,
        gpu_memory_utilization=0.85,
        **capture,
    )
    startup = time.perf_counter() - started
    g = torch.Generator().manual_seed(0)
    prompts = new_prompts(g, args)
    params = [
        SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, temperature=1.0, seed=i, n=args.n, detokenize=False)
        for i in range(args.prompts)
    ]
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False), use_tqdm=False)
    torch.cuda.synchronize()
    # batches of the same shape with one new token each: the prefill, one sampling step and generate's fixed cost, so
    # that a batch's time splits roughly into that and the decode steps without the profiler's host overhead (roughly:
    # in the full batch vLLM may schedule prefill chunks beside decode rows); timed in the fresh engine and again after
    # the full batches (on an H100, 2026-12-06, at the RL rollout shape with graphs up to 2048 rows, strict took
    # 0.028 s in an engine that had run only one-token batches and 0.057 s after batches of 64 new tokens; in the next
    # session's run on an H100 0.027-0.030 s after them, with the slow steps elsewhere: docs/log/gpu-sessions.md)
    one = [
        SamplingParams(max_tokens=1, ignore_eos=True, temperature=1.0, seed=i, n=args.n, detokenize=False)
        for i in range(args.prompts)
    ]
    events = HostEvents(AttentionTrace(attention_impl_class()))
    gc.callbacks.append(events.gc_callback)
    # their own prompts, so that the timed batches get the token ids they got before these batches existed (the first
    # timed batch no longer pays the first prefills' one-time work, though: these do)
    fresh_seconds, fresh_builds, fresh_events = one_token_batches(
        llm, torch.Generator().manual_seed(1), args, one, events
    )
    batch_seconds, generated, builds, batch_events = [], 0, [strict_kernel_builds()], []
    for i in range(args.batches):
        seconds, outputs, happened = timed_generate(llm, prompts if i == 0 else new_prompts(g, args), params, events)
        batch_seconds.append(seconds)
        batch_events.append(happened)
        generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        builds.append(strict_kernel_builds())
    prefill_seconds, prefill_builds, prefill_events = one_token_batches(llm, g, args, one, events)
    gc.callbacks.remove(events.gc_callback)
    # one more batch under torch.profiler: after the timed ones, so it pays neither prefix-cache hits nor builds
    profiled = one if args.profile_batch == "one-token" else params
    profile = profile_generate(llm, new_prompts(g, args), profiled) if args.profile else None
    config = llm.llm_engine.vllm_config
    from alignaudit.engines.vllm.attention_cpu import attention_impls

    return {
        "generated_tokens": generated,
        "batch_seconds": batch_seconds,
        "output_tokens_per_s": round(generated / statistics.median(batch_seconds[1:] or batch_seconds), 1),
        "last_batch_tokens_per_s": round(generated / batch_seconds[-1], 1),
        "first_batch_tokens_per_s": round(generated / batch_seconds[0], 1),
        "startup_s": round(startup, 1),
        **(
            {
                "one_token_batch_seconds": prefill_seconds,
                "one_token_median_s": statistics.median(prefill_seconds[1:] or prefill_seconds),
                "strict_builds_per_one_token_batch": prefill_builds,
                "host_events_per_one_token_batch": prefill_events,
                "one_token_fresh_batch_seconds": fresh_seconds,
                "one_token_fresh_median_s": statistics.median(fresh_seconds[1:] or fresh_seconds),
                "strict_builds_per_one_token_fresh_batch": fresh_builds,
                "host_events_per_one_token_fresh_batch": fresh_events,
            }
            if prefill_seconds
            else {}
        ),
        "host_events_per_batch": batch_events,
        **({"profiled_batch": args.profile_batch} if profile else {}),
        "strict_builds_at_start": sum(builds[0].values()),
        "strict_builds_per_batch": builds_between(builds),
        "max_model_len": config.model_config.max_model_len,  # read back: what the engine was built with
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "max_cudagraph_capture_size": config.compilation_config.max_cudagraph_capture_size,  # read back
        "attention_impl": sorted(llm.apply_model(attention_impls)[0]),
        # threads that could take the GIL from the engine's loop between (or inside) its host calls
        "python_threads": sorted(t.name for t in threading.enumerate()),
        **({"profile": profile} if profile else {}),
    }


class HostEvents:
    """What could stall the host between two ``take()`` calls outside the kernels: Python's cyclic garbage collector
    (seconds collecting and collections by generation, through ``gc.callbacks`` while ``gc_callback`` is installed;
    a full collection walks every tracked object vLLM has not frozen) and the CUDA caching allocator (calls to
    cudaMalloc and cudaFree, and retries: a cudaMalloc that failed, after which the allocator synchronizes and
    frees its cached blocks; torch.cuda.memory_stats). https://docs.python.org/3/library/gc.html#gc.callbacks"""

    ALLOCATOR = {
        "cuda_mallocs": "num_device_alloc",
        "cuda_frees": "num_device_free",
        "cuda_malloc_retries": "num_alloc_retries",
        "allocator_stream_syncs": "num_sync_all_streams",
    }
    # the pinned host allocator (torch.cuda.host_memory_stats): strict attention copies its step plan from pinned
    # memory, and a pinned block the pool lacks is a cudaHostAlloc
    HOST_ALLOCATOR = {"pinned_allocs": "num_host_alloc", "pinned_alloc_us": "host_alloc_time.total"}

    def __init__(self, attention: AttentionTrace | None = None):
        self.gc_seconds, self.collections, self._gc_start = 0.0, [0, 0, 0], None
        self._allocator = self._allocator_counts()
        self.attention = attention

    def gc_callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self.gc_seconds += time.perf_counter() - self._gc_start
            self.collections[info["generation"]] += 1
            self._gc_start = None

    @classmethod
    def _allocator_counts(cls) -> dict:
        import torch

        stats = torch.cuda.memory_stats()  # {} before CUDA is initialized; a backend may leave keys out
        # host_memory_stats is already flat, nested keys dotted ("host_alloc_time.total"; torch 2.11 and 2.13)
        host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
        return {
            **{name: stats.get(key) for name, key in cls.ALLOCATOR.items()},
            **{name: host.get(key) for name, key in cls.HOST_ALLOCATOR.items()},
        }

    def take(self) -> dict:
        """{"gc_s", "gc_collections" [generation 0, 1, 2], "cuda_mallocs", "cuda_frees", "cuda_malloc_retries",
        "allocator_stream_syncs", "pinned_allocs", "pinned_alloc_us"} (and AttentionTrace.take's keys, with a trace)
        since the last take, then start counting again; an allocator count is None where torch.cuda.memory_stats or
        host_memory_stats does not report it (never 0 for "not known")."""
        now = self._allocator_counts()
        before = self._allocator
        taken = {
            "gc_s": round(self.gc_seconds, 4),
            "gc_collections": self.collections,
            **{name: None if now[name] is None or before[name] is None else now[name] - before[name] for name in now},
            **(self.attention.take() if self.attention else {}),
        }
        self.gc_seconds, self.collections, self._allocator = 0.0, [0, 0, 0], now
        return taken


class AttentionTrace:
    """Host seconds of every eager call of an attention impl's ``forward`` (vLLM runs attention outside its
    piecewise CUDA graphs: every layer of a step that is not a FULL graph replay), by wrapping the class's method in
    this process (the engine core runs in it: VLLM_ENABLE_V1_MULTIPROCESSING=0). No device synchronization is added:
    a call's seconds are its host work, plus any wait for a full launch queue, for the GIL or for the device where
    the call synchronizes. Calls with metadata are split into steps with a single query row per request (decode;
    vLLM replays FULL graphs for most of them) and the others (prefill, chunked or mixed): of those, each step's
    total, the slowest call with its place among the step's calls (a step: the calls that share one metadata
    object, every layer of a KV-cache group; the first plans the step's query tiles) and the max_seq_len values (the
    key bound the attention plans with) are kept."""

    def __init__(self, impl_cls: type):
        self.forward = impl_cls.forward
        self._reset()
        trace = self

        def traced(impl, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
            t0 = time.perf_counter()
            out = trace.forward(impl, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
            took = time.perf_counter() - t0
            if attn_metadata is not None:
                trace.record(attn_metadata, took)
            return out

        impl_cls.forward = traced

    def record(self, meta, seconds: float) -> None:
        kind = "decode" if meta.max_query_len == 1 else "other"
        self.calls[kind] += 1
        self.seconds[kind] += seconds
        if kind == "decode":
            return
        if meta is not self._step:
            self._step, self._call = meta, 0
            self.step_ms.append(0.0)
        self.step_ms[-1] += 1e3 * seconds
        if 1e3 * seconds > self.slowest[0]:
            self.slowest = (1e3 * seconds, self._call)
        self._call += 1
        self.max_seq_lens.add(int(meta.max_seq_len))

    def _reset(self) -> None:
        self.calls, self.seconds, self.max_seq_lens = {"decode": 0, "other": 0}, {"decode": 0.0, "other": 0.0}, set()
        self.step_ms, self.slowest, self._step, self._call = [], (0.0, None), None, 0

    def take(self) -> dict:
        """{"attention_calls" {"decode", "other"}, "attention_host_ms" {"decode", "other"}, and of the non-decode
        calls: "attention_step_host_ms" (one total a step), "attention_slowest"
        {"ms", "call_in_step"} and "attention_max_seq_lens"} since the last take, then start again."""
        taken = {
            "attention_calls": self.calls,
            "attention_host_ms": {k: round(1e3 * v, 2) for k, v in self.seconds.items()},
            "attention_step_host_ms": [round(ms, 2) for ms in self.step_ms],
            "attention_slowest": {"ms": round(self.slowest[0], 3), "call_in_step": self.slowest[1]},
            "attention_max_seq_lens": sorted(self.max_seq_lens),
        }
        self._reset()
        return taken


def attention_impl_class() -> type:
    """The attention impl class this process's engine runs on CUDA: strict's (ALIGNAUDIT_STRICT) or vLLM's
    FlashAttention (the default on Hopper; the result's attention_impl says what the model really holds)."""
    if os.environ.get("ALIGNAUDIT_STRICT"):
        from alignaudit.engines.vllm.attention_cuda import StrictFlashAttentionImpl

        return StrictFlashAttentionImpl
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    return FlashAttentionImpl


def timed_generate(llm, prompts, params, events: HostEvents) -> tuple[float, list, dict]:
    """One ``llm.generate``: its host seconds (generate returns when done), its outputs, and the host events in it."""
    events.take()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = round(time.perf_counter() - t0, 3)
    return seconds, outputs, events.take()


def one_token_batches(llm, generator, args, one, events: HostEvents) -> tuple[list[float], list[dict], list[dict]]:
    """args.prefill_batches batches of new prompts, sampling ``one`` (one new token each): their seconds, the
    strict kernels built during each (builds_between) and the host events in each (HostEvents.take)."""
    seconds, builds, collected = [], [strict_kernel_builds()], []
    for _ in range(args.prefill_batches):
        took, _, happened = timed_generate(llm, new_prompts(generator, args), one, events)
        seconds.append(took)
        collected.append(happened)
        builds.append(strict_kernel_builds())
    return seconds, builds_between(builds), collected


def strict_kernel_builds() -> dict:
    """Kernel name -> compiled variants held by each Triton kernel of alignaudit_kernels in this process (a
    new launch shape that Triton specializes on, e.g. an integer argument that turns divisible by 16, is a
    build). Counted before and after each batch: builds inside a timed batch are one-time work in it."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    import alignaudit_kernels

    counts = {}
    for info in pkgutil.iter_modules(alignaudit_kernels.__path__):
        module = importlib.import_module(f"alignaudit_kernels.{info.name}")
        for name, fn in vars(module).items():
            if isinstance(fn, JITFunction) and fn.device_caches:
                counts[name] = sum(len(entry[0]) for entry in fn.device_caches.values())
    return counts


def builds_between(snapshots: list[dict]) -> list[dict]:
    """For consecutive strict_kernel_builds() snapshots, the kernels that gained compiled variants in between, and
    how many: one dict per interval."""
    return [
        {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}
        for before, after in itertools.pairwise(snapshots)
    ]


def new_prompts(generator, args) -> list:
    """args.prompts prompts of args.prompt_len random token ids below 32000 (inside every preset's vocabulary)."""
    import torch
    from vllm.inputs import TokensPrompt

    return [
        TokensPrompt(prompt_token_ids=torch.randint(0, 32000, (args.prompt_len,), generator=generator).tolist())
        for _ in range(args.prompts)
    ]


def profile_generate(llm, prompts, params, top: int = 14) -> dict:
    """The same generate again under torch.profiler (after the timed one): GPU kernel time by kernel name,
    CUDA-graph replays included, the largest ``top`` and the total, the number of GPU events (kernels, copies,
    memsets), and the GPU's busy time
    and idle gaps by length (bench/timing.gpu_timeline), the host's waits and busiest ops (bench/timing.host_table);
    where a configuration's time goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.timing import host_table, kernel_table

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return {**kernel_table(prof, top), **host_table(prof.key_averages(), top), "profiled_wall_s": round(wall, 3)}


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """parser.error (exit 2) for a setting the run cannot honour."""
    if args.batches < 1:
        parser.error("--batches must be at least 1 (the rate is the median batch's after the first)")
    if args.n < 1:
        parser.error("--n must be at least 1 (completions per prompt)")
    for flag, value in (
        ("--prompts", args.prompts),
        ("--prompt-len", args.prompt_len),
        ("--new-tokens", args.new_tokens),
    ):
        if value < 1:
            parser.error(f"{flag} must be at least 1")
    unprofiled = [name for name in args.profile.split(",") if name and name not in args.configs.split(",")]
    if unprofiled and not args.worker:
        parser.error(
            f"--profile {','.join(unprofiled)}: not among --configs {args.configs}; a configuration that "
            "does not run cannot be profiled"
        )
    if args.prefill_batches < 0:
        parser.error("--prefill-batches must be 0 or more")
    if args.profile_batch != "full" and not args.profile:
        parser.error(f"--profile-batch {args.profile_batch} needs --profile (the configurations to profile)")
    if args.capture_size < 0:
        parser.error("--capture-size must be 0 (vLLM's default) or a number of rows")
    if args.max_model_len and args.max_model_len < args.prompt_len + args.new_tokens:
        parser.error(
            f"--max-model-len {args.max_model_len} cannot hold a prompt of {args.prompt_len} tokens and "
            f"{args.new_tokens} new ones; give at least {args.prompt_len + args.new_tokens}, or 0 for the "
            "default"
        )
    unknown = [name for name in args.configs.split(",") if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")


def attention_line(events: dict) -> str:
    """AttentionTrace's counts of one batch, in words."""
    if "attention_calls" not in events:
        return "attention not traced"
    calls, ms = events["attention_calls"], events["attention_host_ms"]
    if not calls["decode"] + calls["other"]:
        return "attention not traced: no eager call of the traced impl"
    slowest = events["attention_slowest"]
    other = (
        f" (steps {events['attention_step_host_ms']} ms, slowest call {slowest['ms']:.2f} ms, the step's call "
        f"{slowest['call_in_step']}, max_seq_len {events['attention_max_seq_lens']})"
        if calls["other"]
        else ""
    )
    return (
        f"attention host {ms['other']:.1f} ms in {calls['other']} non-decode calls{other}, {ms['decode']:.1f} ms "
        f"in {calls['decode']} decode calls"
    )


def print_profiles(results: dict) -> None:
    """The profiled configurations' GPU kernel time, timeline and host side."""
    for name, r in results.items():
        if "profile" in r:
            p = r["profile"]
            print(
                f"{name}: GPU kernel time {p['gpu_kernel_ms']} ms in one profiled generate "
                f"({r['profiled_batch']} batch; "
                f"{p.get('profiled_wall_s')} s wall under the profiler; {p['gpu_events']} GPU events; "
                f"timeline {p['timeline']}); largest:"
            )
            for t in p["top"]:
                print(f"   {t['ms']:9.1f} ms {t['calls']:7d} calls  {t['kernel']}")
            print(f"   host: synchronizing calls {p['synchronizing_calls']}; self CPU time:")
            for t in p["host_top"][:8]:
                print(f"   {t['self_cpu_ms']:9.1f} ms {t['calls']:7d} calls  {t['name']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="Qwen3-8B")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument(
        "--n",
        type=int,
        default=1,
        help="completions per prompt (SamplingParams.n), as RL rollouts sample a group per prompt: "
        "the prompt's prefill is shared through the prefix cache",
    )
    parser.add_argument(
        "--batches", type=int, default=4, help="timed batches of new prompts; the rate is the median's after the first"
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="vLLM's max_model_len (default: prompt + new tokens + 64); it sets the width of the block "
        "table, which Triton specializes on: the strict warm-up must cover it",
    )
    parser.add_argument("--configs", default="default,batch-invariant,strict,strict-native-exp")
    parser.add_argument(
        "--capture-size",
        type=int,
        default=0,
        help="vLLM's max_cudagraph_capture_size for every configuration (0: vLLM's default)",
    )
    parser.add_argument(
        "--prefill-batches",
        type=int,
        default=0,
        help="this many batches of new prompts with one new token each, before the timed batches "
        "(one_token_fresh_median_s) and after them (one_token_median_s; medians after the "
        "first): roughly the prefill's share of a batch, without the profiler",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--profile",
        default="",
        help="comma list of configurations to run once more under "
        "torch.profiler (GPU kernel time by kernel, printed after the timings)",
    )
    parser.add_argument(
        "--profile-batch",
        choices=("full", "one-token"),
        default="full",
        help="what --profile runs under the profiler after the timed batches: a full batch, or a "
        "batch of new prompts with one new token each (the prefill step)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    check_args(parser, args)
    if args.worker:
        args.model = config_dir(args.model)
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    results, failed = {}, []
    for name in args.configs.split(","):
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0", **CONFIGS[name]}
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            name,
            "--model",
            args.model,
            "--prompts",
            str(args.prompts),
            "--prompt-len",
            str(args.prompt_len),
            "--new-tokens",
            str(args.new_tokens),
            "--n",
            str(args.n),
            "--batches",
            str(args.batches),
            "--max-model-len",
            str(args.max_model_len),
            "--capture-size",
            str(args.capture_size),
            "--prefill-batches",
            str(args.prefill_batches),
        ]
        if name in args.profile.split(","):
            cmd += ["--profile", name, "--profile-batch", args.profile_batch]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"{name}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            failed.append(name)
            continue
        results[name] = json.loads(lines[-1][len("RESULT ") :])
        print(f"{name:24s} {json.dumps(results[name])}", flush=True)
    base = results.get("default", {}).get("output_tokens_per_s")
    for name, r in results.items():
        if base:
            print(
                f"{name:24s} {r['output_tokens_per_s']:9.1f} tokens/s  "
                f"{r['output_tokens_per_s'] / base:.3f}x of default"
            )
        if "one_token_median_s" in r:
            batch, one = statistics.median(r["batch_seconds"][1:] or r["batch_seconds"]), r["one_token_median_s"]
            print(
                f"{name:24s} batch {batch:.3f} s ~ one-token batch (prefill, a sampling step, generate's fixed "
                f"cost) {one:.3f} s + the rest {batch - one:.3f} s (medians after the first); a one-token batch "
                f"in the fresh engine {r['one_token_fresh_median_s']:.3f} s"
            )
            for when, label in (("one_token_fresh_batch", "fresh"), ("one_token_batch", "after the batches")):
                print(
                    f"{name:24s} one-token batches, {label}: "
                    + "; ".join(
                        f"{s:.3f} s (gc {e['gc_s']:.3f} s, {e['gc_collections'][2]} full; "
                        f"cudaMalloc {e['cuda_mallocs']}, "
                        f"cudaFree {e['cuda_frees']}, retries {e['cuda_malloc_retries']}, "
                        f"stream syncs {e['allocator_stream_syncs']}; pinned allocs {e.get('pinned_allocs')}, "
                        f"{e.get('pinned_alloc_us')} us; {attention_line(e)})"
                        for s, e in zip(r[f"{when}_seconds"], r[f"host_events_per_{when}"], strict=True)
                    )
                )
    print_profiles(results)
    if args.json:
        record = {"args": vars(args) | {"json": str(args.json)}, "results": results, "failed": failed}
        args.json.write_text(json.dumps(record, indent=2))
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (each one's error above)")


if __name__ == "__main__":
    main()
