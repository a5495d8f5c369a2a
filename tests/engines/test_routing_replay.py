"""compare --replay-routing on the Qwen3 MoE fixture (R3): the rollout engine's experts per token and layer are
recorded, the trainer's router (Megatron-Core's RouterReplay; transformers' Qwen3MoeTopKRouter with its top-k
replaced) takes them, and the comparison is reported with and without. Three engine kinds run: vLLM eager as the
rollout engine (once, its routing reused), megatron and hf as trainers (each on its own routing and replaying)."""

from __future__ import annotations

import json

import pytest
import torch

from alignaudit.capture.directory import read_capture
from alignaudit.capture.op_store import OpStore
from alignaudit.capture.ops import op_id
from alignaudit.capture.rundir import RUN, SUMMARY, UNREPLAYED
from alignaudit.comparison.integrity import load_run
from alignaudit.inputs.checkpoint import load_spec
from alignaudit.inputs.prompts import load_prompts
from alignaudit.inputs.request import EngineRun, EngineSettings, Request
from alignaudit.pipelines.runs import ROUTING, capture, compare
from helpers import ROOT, one_line_error

pytestmark = pytest.mark.engines

MOE = ROOT / "fixtures" / "qwen3-moe-tiny"
VLLM_EAGER = EngineRun("vllm", EngineSettings("bf16", "cpu", 0, {"enforce_eager": True}))


def routing_of(c) -> dict[tuple[int, int], torch.Tensor]:
    """(layer, seq) -> the capture's experts per token, read straight from its op store."""
    store = OpStore(c.path, c.manifest["ops"])
    return {(layer, seq): ids for layer in range(2) for seq, ids in store.sequences(op_id("routing", layer)).items()}


def rerouted(a: dict, b: dict) -> set[tuple[int, int, int]]:
    """(layer, seq, position) of every token two routings send to different expert sets."""
    assert a.keys() == b.keys()
    return {
        (layer, seq, int(p))
        for (layer, seq), ids in a.items()
        for p in (ids != b[layer, seq]).any(-1).nonzero().flatten()
    }


def differing(a: dict, b: dict) -> set[tuple[int, int]]:
    """(seq, logprob index) whose fp32 bits differ between two captures' logprob sequences."""
    return {(seq, int(i)) for seq, x in a.items() for i in (x.view(torch.int32) != b[seq].view(torch.int32)).nonzero()}


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory):
    """One compare --replay-routing run: vLLM eager (bf16) rolls out, megatron trains."""
    spec = load_spec(MOE)
    out = tmp_path_factory.mktemp("replay") / "megatron-vllm"
    out.mkdir()
    request = Request(
        spec, load_prompts(spec), EngineRun("megatron", EngineSettings("bf16", "cpu")), VLLM_EAGER, replay_routing=True
    )
    summary = compare(request, out)
    return out, summary


def test_megatron_replays_vllms_routing_and_reports_what_remains(megatron_run):
    """Without replay the bf16 engines route some token differently (how many depends on the CPU's ISA; that some
    are is what test_moe's bisect test pins too); with Megatron-Core's RouterReplay every token of every layer
    goes to vLLM's experts, read back from megatron's own router (its routing_map). The summary's counts are
    recomputed here from the captures' routing and logprob bits."""
    out, summary = megatron_run
    infer, own, replayed = (read_capture(out / name) for name in ("infer", UNREPLAYED, "train"))
    vllm_routing = routing_of(infer)
    before = rerouted(routing_of(own), vllm_routing)
    assert before and rerouted(routing_of(replayed), vllm_routing) == set()
    r = summary["routing_replay"]
    assert (r["rerouted_before"], r["rerouted_after"]) == (len(before), 0)
    assert (
        summary["routing"]
        == r["routing_after"]
        == [{"layer": i, "tokens": 180, "rerouted": 0, "agreement": 1.0} for i in range(2)]
    )
    assert [x["rerouted"] for x in r["routing_before"]] == [sum(1 for t in before if t[0] == i) for i in range(2)]
    # what remains: the mismatches with replay are the run's own numbers; without, the unreplayed capture's
    lp = {name: c.logprob_sequences() for name, c in (("infer", infer), ("own", own), ("replayed", replayed))}
    assert r["mismatches_before"] == len(differing(lp["own"], lp["infer"]))
    assert r["mismatches_after"] == summary["mismatches"] == len(differing(lp["replayed"], lp["infer"]))
    assert r["max_abs_diff_after"] == summary["max_abs_diff"] <= r["max_abs_diff_before"]
    # the replay changed megatron's logprobs at the rerouted tokens and only downstream of them: logprob index i
    # (token i + 1) is computed from positions 0..i
    changed = differing(lp["own"], lp["replayed"])
    assert r["tokens_changed_by_replay"] == len(changed) >= 1 and len(changed) < r["tokens_compared"]
    assert all(any(s == seq and p <= i for _, s, p in before) for seq, i in changed)
    assert any((seq, p) in changed for _, seq, p in before if p < len(lp["own"][seq]))
    # how megatron replayed: its own RouterReplay, switched on in the config it records
    settings = replayed.manifest["engine_settings"]
    assert settings["transformer_config"]["moe_enable_routing_replay"] is True
    assert r["mechanism"]["mechanism"].startswith("megatron.core.transformer.moe.router_replay.RouterReplay")
    assert own.manifest["engine_settings"]["transformer_config"]["moe_enable_routing_replay"] is False
    assert replayed.manifest["routing_from"] == str((out / "infer").resolve())


def test_the_replayed_run_is_sealed_and_reads_back(megatron_run):
    """run.json records the option and the unreplayed capture; gate and report's loader accept the run."""
    out, summary = megatron_run
    record = json.loads((out / RUN).read_text())
    assert record["replay_routing"] is True and record["status"] == "complete"
    assert set(record["routing_replay"]["unreplayed"]) >= {"manifest_sha256"}
    run = load_run(out)
    assert run.train.path.name == "train" and json.loads((out / SUMMARY).read_text()) == summary


def test_hf_replays_vllms_routing(megatron_run, tmp_path):
    """transformers' router replaying the same vLLM routing (capture level, the rollout capture reused): every
    token to vLLM's experts; its weights are its own softmax at them (test_replayed_router_weights)."""
    out, _ = megatron_run
    spec = load_spec(MOE)
    infer = read_capture(out / "infer")
    hf = EngineRun("hf", EngineSettings("bf16", "cpu"))
    own = capture(spec, infer.token_batch(), hf, tmp_path / "own", role="train", ops=ROUTING)
    replayed = capture(
        spec, infer.token_batch(), hf, tmp_path / "replayed", role="train", ops=ROUTING, routing_from=infer.path
    )
    vllm_routing = routing_of(infer)
    assert rerouted(routing_of(replayed), vllm_routing) == set()
    assert replayed.manifest["engine_settings"]["routing_replay"]["mechanism"].endswith("replayed_router_forward")
    changed = differing(own.logprob_sequences(), replayed.logprob_sequences())
    before = rerouted(routing_of(own), vllm_routing)
    assert bool(changed) == bool(before)  # hf's own routing may agree with vLLM's on this CPU; then nothing changes
    assert all(any(s == seq and p <= i for _, s, p in before) for seq, i in changed)


def test_replayed_router_weights():
    """transformers' router under replay: given its own top-k it returns its own output bit for bit; given other
    experts, the weights are its fp32 softmax over every expert at those experts, renormalized (norm_topk_prob),
    computed here in fp64."""
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from alignaudit.engines.routing_replay import replayed_router_forward

    config = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    router = Qwen3MoeTopKRouter(config).to(torch.bfloat16)
    torch.manual_seed(0)
    router.weight.data.normal_()
    x = torch.randn(5, 16).to(torch.bfloat16)
    logits, weights, ids = router(x)
    target = {"ids": ids}
    replay = replayed_router_forward(router, target)
    for got, want in zip(replay(x), (logits, weights, ids), strict=True):
        assert torch.equal(got, want)
    target["ids"] = torch.tensor([[0, 7], [1, 2], [3, 4], [5, 6], [6, 0]])
    _, replayed_weights, replayed_ids = replay(x)
    p = torch.softmax(logits.double(), -1).gather(-1, target["ids"])
    assert torch.equal(replayed_ids, target["ids"]) and replayed_weights.dtype == torch.bfloat16
    assert torch.allclose(replayed_weights.double(), p / p.sum(-1, keepdim=True), atol=4e-3, rtol=0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "qwen3-tiny"], "qwen3-tiny (Qwen3ForCausalLM) is dense"),
        (["--mode", "rollout"], "runs in prompt mode only"),
        (["--repeat", "2"], "with --repeat is undefined"),
        (["--infer", "vllm"], "add --infer-opt enforce_eager=true, or use --infer hf"),
        (["--train", "vllm", "--infer", "hf"], "the train engine vllm cannot take given experts"),
        (
            ["--strict", "all", "--infer", "hf"],
            "the train engine megatron with the strict MoE layer (--strict with "
            "linear) routes by its own kernel, which replays nothing; drop linear",
        ),
        (["--infer", "hf", "--full-vocab"], "--full-vocab with --replay-routing is not built yet"),
    ],
)
def test_replay_routing_is_refused_where_undefined(capsys, tmp_path, argv, message):
    argv = ["compare", "--model", str(MOE), *argv] if "--model" not in argv else ["compare", *argv]
    err = one_line_error(capsys, [*argv, "--replay-routing", "--out", str(tmp_path / "o")], 2)
    assert message in err and not (tmp_path / "o").exists()


def test_the_python_api_refuses_replay_on_a_dense_model(tmp_path):
    from alignaudit import api
    from alignaudit.errors import InputError

    with pytest.raises(InputError, match=r"qwen3-tiny \(Qwen3ForCausalLM\) is dense"):
        api.compare("qwen3-tiny", replay_routing=True, out=tmp_path / "o")
    with pytest.raises(InputError, match="^full_vocab with replay_routing is not built yet"):
        api.compare(str(MOE), train="megatron", infer="hf", replay_routing=True, full_vocab=True, out=tmp_path / "o")
    assert not (tmp_path / "o").exists()
