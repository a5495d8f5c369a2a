"""What the tests share: paths, real engine captures of the fixture, bit-level assertions, the CLI as a user runs
it, a run's record sealed again after an edit, and headless Chromium for the report pages. The fixtures that build
on these live in conftest.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

from alignaudit.capture.ops import Selection
from alignaudit.commands import cli
from alignaudit.inputs.request import EngineSettings, Sampling
from alignaudit.pipelines.runs import EngineRun, capture

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "qwen3-tiny"
MOE = ROOT / "fixtures" / "qwen3-moe-tiny"


class CaptureCache:
    """Real engine captures of the fixture on the built-in prompts, keyed by (engine, dtype, options)."""

    def __init__(self, root: Path, spec, batch):
        self.root, self.spec, self.batch = root, spec, batch
        self.done = {}

    def get(
        self,
        engine: str,
        dtype: str,
        ops: bool | Selection = False,
        reference=None,
        strict: str = "",
        rollout=None,
        batch=None,
        full_vocab: bool | None = None,
        **options,
    ):
        """A capture; ``ops`` adds every canonical op (or those of a Selection); ``reference`` (a capture) runs
        forced mode; ``strict`` swaps in strict kernels; ``rollout`` samples; ``batch`` (a capture) scores its
        tokens. ``full_vocab`` writes full-vocabulary rows; by default the plain prompt captures (no ops, rollout,
        batch or options) write them, so the rows' tests reuse the engine runs every other test makes."""
        selection = ops if isinstance(ops, Selection) else Selection() if ops or reference else None
        if full_vocab is None:
            full_vocab = not (ops or reference or rollout or batch or options)
        key = (
            engine,
            dtype,
            json.dumps(selection.to_dict(), sort_keys=True) if isinstance(ops, Selection) else ops,
            reference.path.name if reference else None,
            strict or None,
            json.dumps(rollout, sort_keys=True) if rollout else None,
            batch.path.name if batch else None,
            json.dumps(options, sort_keys=True),
            "vocab" if full_vocab else None,
        )
        if key not in self.done:
            name = "-".join(str(k) for k in key if k not in (None, False, "{}")).replace("/", "_").replace(" ", "")
            run = EngineRun(engine, EngineSettings(dtype=dtype, device="cpu", options=options, strict=strict))
            tokens = batch.token_batch() if batch is not None else self.batch
            self.done[key] = capture(
                self.spec,
                tokens,
                run,
                self.root / name,
                ops=selection,
                reference=reference.path if reference else None,
                rollout=Sampling(**rollout) if rollout else None,
                full_vocab=full_vocab,
            )
        return self.done[key]


def assert_bitwise_equal(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """Assert identical bit patterns; on failure report count, max ULP, max |diff| and first indices."""
    from alignaudit import numerics

    assert a.dtype == b.dtype and a.shape == b.shape, f"{name}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    same = numerics.bitwise_equal(a, b)
    if bool(same.all()):
        return
    ulp = numerics.ulp_distance(a, b)
    where = (~same).nonzero()[:5].tolist()
    raise AssertionError(
        f"{name}: {int((~same).sum())} of {same.numel()} elements differ; max ULP {int(ulp.max())}, "
        f"max |diff| {float((a.double() - b.double()).abs().max()):.3e}; first at {where}"
    )


def vocab_reference(a32, b32, k: int = 5) -> dict:
    """comparison/vocab.py's measures per row pair, written again in numpy float64 (no torch, no alignaudit): rows
    renormalized, KL both ways over p > 0, TV, top-1 and top-k by a stable descending sort (ties: lower id)."""
    import numpy as np

    def normalized(x):
        x = np.asarray(x, dtype=np.float64)
        m = x.max(-1, keepdims=True)
        return x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))

    a32, b32 = np.asarray(a32, dtype=np.float32), np.asarray(b32, dtype=np.float32)
    la, lb = normalized(a32), normalized(b32)
    p, q = np.exp(la), np.exp(lb)
    with np.errstate(invalid="ignore"):
        kl_pq = np.where(p > 0, p * (la - lb), 0.0).sum(-1)
        kl_qp = np.where(q > 0, q * (lb - la), 0.0).sum(-1)
    top_a = np.argsort(-a32, axis=-1, kind="stable")[:, :k]
    top_b = np.argsort(-b32, axis=-1, kind="stable")[:, :k]
    return {
        "kl_train_infer": kl_pq,
        "kl_infer_train": kl_qp,
        "tv": 0.5 * np.abs(p - q).sum(-1),
        "top1_agree": top_a[:, 0] == top_b[:, 0],
        "topk_overlap": np.array([len(set(x) & set(y)) / k for x, y in zip(top_a, top_b, strict=True)]),
    }


def saved_vocab_rows(capture, seq: int) -> torch.Tensor:
    """A capture's rows of sequence ``seq`` read straight from its file (safetensors), not through alignaudit."""
    from safetensors.torch import load_file

    return load_file(str(capture.path / "vocab" / f"seq-{seq:05d}.safetensors"))["logprobs"]


def importance_by_hand(tokens, tis=2.0, mask_low=0.5, mask_high=5.0, geo_low=0.999, geo_high=1.001) -> dict:
    """The IS fractions and KL of a tokens table (a run's tokens.parquet or tokens/step-N.parquet), recomputed
    here with pandas from the definitions (verl rollout_corr_helper.py, NeMo-RL loss_functions.py), independently of
    alignaudit.comparison.importance: over the generated tokens when there are any."""
    import numpy as np
    import pandas as pd

    t = tokens[tokens["generated"]] if "generated" in tokens and tokens["generated"].any() else tokens
    d = t["lp_train"].to_numpy(np.float64) - t["lp_infer"].to_numpy(np.float64)
    frame = pd.DataFrame({"seq": t["seq"].to_numpy(), "d": d, "r": np.exp(d)})
    by = frame.groupby("seq")
    prod, geo, size = np.exp(by["d"].sum()), np.exp(by["d"].mean()), by.size()
    r = frame["r"]
    out_token = (r < mask_low) | (r > mask_high)
    geo_out = (geo < geo_low) | (geo > geo_high)
    return {
        "tokens": len(t),
        "sequences": len(size),
        "token_tis_fraction": float((r > tis).mean()),
        "token_tis_seq_fraction": float((by["r"].max() > tis).mean()),
        "token_mask_fraction": float(out_token.mean()),
        "token_mask_seq_fraction": float(out_token.groupby(frame["seq"]).any().mean()),
        "seq_tis_fraction": float((prod > tis).mean()),
        "seq_mask_fraction": float(((prod < mask_low) | (prod > mask_high)).mean()),
        "geo_mask_fraction": float(geo_out.mean()),
        "geo_mask_token_fraction": float(size[geo_out].sum() / len(t)),
        "kl_k3": float(np.mean(r - 1 - d)),
        "token_ratio_max": float(r.max()),
        "token_ratio_min": float(r.min()),
    }


# --- the CLI as a user runs it ---


def run_cli(*args, cwd=None):
    """The command in a fresh interpreter, its workers fresh too (nothing forked from the test session)."""
    env = {**os.environ, "COLUMNS": "120"}
    return subprocess.run([sys.executable, "-m", "alignaudit", *args], capture_output=True, text=True, cwd=cwd, env=env)


def run_in_process(capsys, monkeypatch, *args) -> subprocess.CompletedProcess:
    """The command through cli.main in this process, printed 120 columns wide as run_cli prints it, its engine
    workers forked from the session's preloaded servers (tests/conftest.py): what run_cli returns, without a
    fresh interpreter and fresh workers per call."""
    monkeypatch.setattr(cli.console, "width", 120)
    monkeypatch.setattr(cli.err_console, "width", 120)
    code = cli.main(list(args))
    printed = capsys.readouterr()
    return subprocess.CompletedProcess(["alignaudit", *args], code, printed.out, printed.err)


def one_line_error(capsys, argv, code):
    assert cli.main(argv) == code
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "Traceback" not in err, err
    return err


# --- a run's record, edited and sealed again ---


def reseal(run, record):
    """Write an edited run.json with its seal recomputed (what someone who knows the format could do), so a
    test reaches the checks behind the seal."""
    from alignaudit.comparison.integrity import RECORD_SHA256, record_digest

    (run / "run.json").write_text(json.dumps({**record, RECORD_SHA256: record_digest(record)}))


# --- report pages in headless Chromium ---


def _find_chromium() -> str | None:
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


CHROMIUM = _find_chromium()
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium found (apt-get install -y chromium, or set CHROMIUM=/path/to/chrome)"
)

# Appended to a copy of the page (never to the report itself): after load, optionally click table headers,
# then write what the page holds into <pre id="probe">, which --dump-dom serializes.
PROBE = """<script>
function plain(v) { if (v == null) return v; if (ArrayBuffer.isView(v)) return Array.from(v);
  if (Array.isArray(v)) return v.map(plain); return v; }
window.addEventListener("load", function () {
  var out = {plots: {}, tables: {}, clicks: CLICKS};
  document.querySelectorAll(".js-plotly-plot").forEach(function (gd) {
    out.plots[gd.id] = {rendered: gd.querySelector(".plot-container .main-svg") !== null,
      traces: gd._fullData.map(function (t) { return {name: t.name, x: plain(t.x), y: plain(t.y), z: plain(t.z),
        text: plain(t.text), symbol: t.marker ? plain(t.marker.symbol) : null}; }),
      shapes: (gd._fullLayout.shapes || []).map(function (s) { return {name: s.name, x0: s.x0, x1: s.x1}; }),
      drawn_shapes: gd.querySelectorAll(".shapelayer path").length};
  });
  CLICKS.forEach(function (c) { document.querySelector("#" + c[0] + " th[data-key='" + c[1] + "']").click(); });
  document.querySelectorAll("table[id]").forEach(function (t) {
    out.tables[t.id] = Array.from(t.querySelectorAll("tbody tr")).map(function (r) {
      var row = {};
      Array.from(r.cells).forEach(function (c) {
        row[c.dataset.key || c.dataset.field] = c.dataset.v !== undefined ? c.dataset.v : c.textContent; });
      return row; });
  });
  var pre = document.createElement("pre"); pre.id = "probe"; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def open_in_chromium(page: Path, tmp: Path, clicks=()) -> tuple[dict, str, list[str]]:
    """Load a copy of ``page`` with the probe in headless Chromium; returns (probe, DOM, console lines)."""
    probed = tmp / f"probed-{page.stem}.html"
    text = page.read_text(encoding="utf-8")
    probed.write_text(
        text.replace("</body>", PROBE.replace("CLICKS", json.dumps(list(clicks))) + "</body>"), encoding="utf-8"
    )
    dom, console = run_chromium(probed, tmp)
    match = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert match, f"the probe did not run: {console or dom[-500:]}"
    import html

    return json.loads(html.unescape(match.group(1))), dom, console


def run_chromium(page: Path, tmp: Path, *extra: str) -> tuple[str, list[str]]:
    """Headless Chromium on ``page``: (the DOM after load, every console line it logged)."""
    proc = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            f"--user-data-dir={tmp / 'chromium-profile'}",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=5000",
            *(extra or ("--dump-dom",)),
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    return proc.stdout, console


# --- the strict kernels' tests (tests/kernels/): shapes that straddle block thresholds, random inputs, bounds ---

BATCHES = (1, 2, 33, 255, 257, 300)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
EXAMPLES = settings(
    max_examples=1 if INTERPRET else 4,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
needs_hardware_dot = pytest.mark.skipif(
    INTERPRET,
    reason="the interpreter's tl.dot is numpy BLAS, whose result for a row depends on its place in the "
    "tile; tensor-core dot invariance is tested on the GPU",
)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype, device, seed, scale=1.0):
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(dtype).to(device)


def rows_everywhere(fn, row, make_others, device):
    """Evaluate fn on batches holding ``row`` at the first, a middle and the last position; return the
    outputs for the row, and the output for the row alone."""
    alone = fn(row[None])[0]
    outs = []
    for b in BATCHES:
        others = make_others(b)
        for pos in sorted({0, b // 2, b - 1}):
            batch = others.clone()
            batch[pos] = row
            outs.append(((b, pos), fn(batch)[pos]))
    return alone, outs


def ulp_of(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at |x| (float64), at least the smallest normal's spacing."""
    finfo = torch.finfo(dtype)
    mag = x.abs().double().clamp_min(finfo.smallest_normal)
    return torch.exp2(torch.floor(torch.log2(mag)) - (finfo.nmant if hasattr(finfo, "nmant") else _mant(dtype)))


def _mant(dtype):
    return {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}[dtype]


def assert_within(name, got, ref64, bound):
    err = (got.double().cpu() - ref64.cpu()).abs()
    worst = float((err - bound.cpu()).max())
    assert worst <= 0, f"{name}: error exceeds bound by {worst:.3e} (max error {float(err.max()):.3e})"


def vllm_packs_cpu_weights() -> bool:
    """Whether vLLM's CPU GEMM dispatch on this machine computes with a packed copy of a bf16 weight (oneDNN
    on AVX-512; on an AVX2 machine it falls back to torch's linear over the live weight, so nothing can go
    stale). Checked on the installed vLLM: the weight is changed in place after dispatch."""
    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16), requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    x = torch.randn(4, 64).to(torch.bfloat16)
    layer.weight.data.mul_(2)
    return not torch.equal(layer.cpu_linear(x, layer.weight, None), torch.nn.functional.linear(x, layer.weight))


def tokens_of(train, infer, generated=None):
    """A compare_tokens table of two sequences (the first half of the rows, then the rest) with these logprobs
    (cast to fp32) and generated flags (default: none generated)."""
    import numpy as np
    import pandas as pd

    from alignaudit.comparison.token_diff import compare_tokens

    n = len(train)
    return compare_tokens(
        pd.DataFrame(
            {
                "seq": np.repeat([0, 1], [n // 2, n - n // 2]),
                "pos": np.r_[np.arange(1, n // 2 + 1), np.arange(1, n - n // 2 + 1)],
                "token_id": np.arange(n) % 7,
                "generated": np.zeros(n, bool) if generated is None else generated,
                "lp_train": train.astype(np.float32),
                "lp_infer": infer.astype(np.float32),
            }
        )
    )
