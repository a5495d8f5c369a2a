"""Strict MoE expert work vs vLLM's fused MoE on one GPU, at the Qwen3-30B-A3B layer shape (issue [27]).

    python3 bench/moe_gpu.py [--tokens 8,64,512,4096] [--tiles] [--json OUT.json]

For each token count, one strict routing (alignaudit_kernels.route on random bf16 tokens and router) and then
the expert part of the layer (alignaudit_kernels.combine_experts) by each dispatch: "gathered" eager (it reads the
routing on the host, so it cannot be replayed), "grouped" and "every_expert" eager and as CUDA-graph replays;
each dispatch's output against the gathered one bit for bit; and vLLM's fused_experts (its default unquantized
Triton MoE, needs the bundle packed with --moe) on the same routing and weights, eager and replayed, with its
largest difference from the strict output (a sanity check of the call: same layout, [gate | up]). The ratio
strict grouped / vLLM (graph replays) is the target's (<= 1.3). The floor: the touched experts' weight bytes over
the device-to-device copy bandwidth measured in the same run. Timings: bench/timing.py (medians, ms).
--tiles: also the grouped products at each of grouped_linear.SWEEP_TILES (graph replays, bits against the default
tile's), the data for choosing the tile from the rows an expert gets. Every size also times the grouped dispatch's
plan by plan_experts (torch) and by plan_experts_triton (one launch), graph replays, and checks them equal.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from alignaudit_kernels import grouped_linear, moe  # noqa: E402
from bench.timing import graph_ms, ms  # noqa: E402

DT = torch.bfloat16
SHAPE = {"experts": 128, "top_k": 8, "hidden": 2048, "width": 768}  # alignaudit.arch.qwen3_moe, Qwen3-30B-A3B


def copy_gbps() -> float:
    """Device-to-device copy bandwidth (read + write bytes per second / 1e9) of 1 GiB."""
    src = torch.empty(1 << 29, dtype=DT, device="cuda").normal_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / (ms(lambda: dst.copy_(src)) * 1e-3) / 1e9


def vllm_fused_experts():
    """vLLM's fused_experts, or the reason it cannot be called here (str)."""
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
    except Exception as e:  # noqa: BLE001 - any import failure is reported in the table, not fatal
        return f"{type(e).__name__}: {e}"[:200]
    return fused_experts


def tile_sweep(x, chosen, gate_up, down) -> dict:
    """Graph-replay ms and bit equality with the default tile of the grouped products at each SWEEP_TILES tile."""
    default = moe._grouped(x, chosen, gate_up, down)
    swept = {}
    for tile in grouped_linear.SWEEP_TILES:
        run = lambda tile=tile: moe._grouped(x, chosen, gate_up, down, tile=tile)  # noqa: E731
        try:
            swept[str(tile)] = {"bit_equal": bool(torch.equal(run(), default)), "graph_ms": round(graph_ms(run), 4)}
        except Exception as e:  # noqa: BLE001 - a tile that does not build is a row of the sweep, not its end
            swept[str(tile)] = {"error": f"{type(e).__name__}: {e}"[:200]}
    return swept


def plan_rows(chosen) -> dict:
    """The grouped dispatch's plan by plan_experts (torch) and by plan_experts_triton (one launch): graph-replay ms
    of each and whether every field is equal (a candidate that fails to build is a row, not the bench's end)."""
    block_m = grouped_linear.block_m_for(chosen.numel(), SHAPE["experts"], DT)
    row = {}
    try:
        planned = [
            plan(chosen, SHAPE["experts"], block_m)
            for plan in (grouped_linear.plan_experts, grouped_linear.plan_experts_triton)
        ]
        row["plan_one_launch_equal"] = all(
            torch.equal(getattr(planned[0], f), getattr(planned[1], f))
            for f in ("pair", "token", "starts", "tile_expert", "tile_row")
        )
        for name, plan in (
            ("plan", grouped_linear.plan_experts),
            ("plan_one_launch", grouped_linear.plan_experts_triton),
        ):
            row[f"{name}_graph_ms"] = round(graph_ms(lambda plan=plan: plan(chosen, SHAPE["experts"], block_m)), 4)
    except Exception as e:  # noqa: BLE001 - recorded in the row
        row["plan_one_launch"] = f"{type(e).__name__}: {e}"[:300]
    return row


def one_size(tokens: int, weights, bandwidth: float, fused, tiles: bool = False) -> dict:
    router, gate_up, down = weights
    x = torch.randn(tokens, SHAPE["hidden"], device="cuda").to(DT)
    _, chosen, routing_weights = moe.route(x, router, SHAPE["top_k"], True)
    touched = int(torch.unique(chosen).numel())
    bytes_touched = touched * (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    row = {"tokens": tokens, "experts_touched": touched, "floor_ms": round(bytes_touched / (bandwidth * 1e9) * 1e3, 4)}

    def run(dispatch):
        return lambda: moe.combine_experts(x, chosen, routing_weights, gate_up, down, dispatch=dispatch)

    gathered = run("gathered")()
    row["gathered_ms"] = ms(run("gathered"))
    for dispatch in ("grouped", "every_expert"):
        if dispatch == "every_expert" and tokens > 512:
            continue  # E / top_k times the work: minutes of timing at 4096 tokens for a known-slow path
        row[f"{dispatch}_bit_equal"] = bool(torch.equal(run(dispatch)(), gathered))
        row[f"{dispatch}_ms"] = ms(run(dispatch))
        row[f"{dispatch}_graph_ms"] = graph_ms(run(dispatch))
    row.update(plan_rows(chosen))
    if tiles:
        row["grouped_default_tile"] = str(grouped_linear.grouped_tile(chosen.numel(), SHAPE["experts"], DT))
        row["tiles"] = tile_sweep(x, chosen, gate_up, down)
    if isinstance(fused, str):
        row["vllm"] = fused
        return row
    ids = chosen.to(torch.int32)
    call = lambda: fused(x, gate_up, down, routing_weights, ids)  # noqa: E731
    try:
        theirs = call()
        row["vllm_max_abs_diff"] = float((theirs.float() - gathered.float()).abs().max())
        row["vllm_ms"] = ms(call)
        row["vllm_graph_ms"] = graph_ms(call)
        row["grouped_over_vllm_graph"] = round(row["grouped_graph_ms"] / row["vllm_graph_ms"], 3)
    except Exception as e:  # noqa: BLE001 - recorded in the row: the strict columns still count
        row["vllm"] = f"{type(e).__name__}: {e}"[:300]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="8,64,512,4096")
    ap.add_argument("--tiles", action="store_true", help="also sweep the grouped products' launch tiles")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    e, h, i = SHAPE["experts"], SHAPE["hidden"], SHAPE["width"]
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = (
        torch.randn(e, h, device="cuda", generator=g).mul_(h**-0.5).to(DT),
        torch.randn(e, 2 * i, h, device="cuda", generator=g).mul_(h**-0.5).to(DT),
        torch.randn(e, h, i, device="cuda", generator=g).mul_(i**-0.5).to(DT),
    )
    bandwidth = copy_gbps()
    fused = vllm_fused_experts()
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        rows.append(one_size(tokens, weights, bandwidth, fused, args.tiles))
        print(json.dumps(rows[-1]), flush=True)
    record = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": SHAPE,
        "copy_gbps": round(bandwidth, 1),
        "rows": rows,
    }
    try:
        import vllm

        record["vllm"] = vllm.__version__
    except ImportError:
        record["vllm"] = None
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
