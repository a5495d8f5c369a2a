"""What an engine is, apart from its adapter: each decision that depends on which engine runs, as a method.

Light on purpose (nothing heavy is imported): the commands consult a kind before any engine starts, and a worker
loads the adapter the kind names. Each engine folder's ``__init__`` defines its kind (``KIND``), and
alignaudit.engines.kind_of looks them up by name, so adding an engine, or following another version of one,
touches that engine's folder (and the registry's one line).
"""

from __future__ import annotations

import importlib
import importlib.util

from alignaudit.errors import EngineError, InputError


class EngineKind:
    """One engine's capabilities and rules. The defaults describe an engine without tensor parallelism,
    training or sampling; each engine's subclass overrides what it has.

    Attributes:
        name: the value of --train / --infer; ``display``: the engine's own name, as prose writes it.
        adapter: ``"module:Class"`` of its alignaudit.engines.base.Engine subclass (imported in a worker only).
        requires: the importable module the adapter needs; ``install``: how to get it.
        tp_option: the engine option that sets the tensor-parallel size (None: the engine runs unsharded).
        trains, rolls_out: whether it can be rl's trainer, rl's rollout engine.
        spawns_ranks: alignaudit starts one process per tensor-parallel rank (otherwise the engine starts its own).
        hooks_reach_ranks: op capture at tensor-parallel size > 1 reaches every rank.
        reserves_a_token: it samples at least one token even when only prompt logprobs are asked for, so a
            prompt must leave room for one more token in the context.
        eager_for_op_capture: op capture runs it eager, not as its compiled default (which then computes other
            bits; reports say so).
        offloads_optimizer: its trainer can keep part of the optimizer state in host memory (rl's memory plan).
        gives_vocab_rows: its adapter gives full-vocabulary log-softmax rows (``compare --full-vocab``,
            Engine.vocab_row_formula says how it computes them).
        samples_groups: it samples a group of completions as one request (Sampling.group_size; vLLM's ``n``);
            otherwise rl submits each prompt once per completion.
        sleeps: its rollout engine can sleep between rl steps (rl --sleep-level), freeing its accelerator memory.
    """

    name = ""
    display = ""
    adapter = ""
    requires = ""
    install = ""
    tp_option: str | None = None
    trains = False
    rolls_out = False
    spawns_ranks = False
    hooks_reach_ranks = True
    reserves_a_token = False
    eager_for_op_capture = False
    offloads_optimizer = False
    gives_vocab_rows = False
    samples_groups = False
    sleeps = False

    def check_installed(self) -> None:
        """Raises EngineError with the install command when the engine's package is missing."""
        top = self.requires.split(".")[0]
        if importlib.util.find_spec(top) is None or (
            top != self.requires and importlib.util.find_spec(self.requires) is None
        ):
            raise EngineError(f"engine {self.name} needs {self.requires}, which is not installed; {self.install}")

    def adapter_class(self):
        """The adapter class (imports the engine's package)."""
        module, _, cls = self.adapter.partition(":")
        return getattr(importlib.import_module(module), cls)

    def tensor_parallel_size(self, settings) -> int:
        """The tensor-parallel size ``settings`` (alignaudit.inputs.request.EngineSettings) ask for: 1 unless
        the engine's own option says otherwise."""
        return settings.options.get(self.tp_option, 1) if self.tp_option else 1

    def check_tensor_parallel(self, spec, tp: int) -> None:
        """Refuse a tensor-parallel size ``tp`` > 1 that cannot split ``spec`` (alignaudit.inputs.checkpoint.
        ModelSpec). Every sharded engine splits the attention heads and the FFN width.

        Raises:
            InputError: naming the size and what it must divide.
        """
        self._must_divide(spec, tp, [("attention heads", spec.num_heads), ("FFN width", spec.intermediate_size)])

    def _must_divide(self, spec, tp: int, sizes: list[tuple[str, int]]) -> None:
        for what, n in sizes:
            if n % tp:
                raise InputError(
                    f"{self.name} {self.tp_option}={tp} does not divide the {n} {what} of {spec.name}; "
                    "use a size that divides it"
                )

    def check_settings(self, settings, mode: str, role: str) -> None:
        """Refuse an option that would not take effect as recorded (before any engine starts). ``mode``:
        "prompt" or "rollout"; ``role``: "train" or "infer" (the flag a message names is --{role}-opt).

        Raises:
            InputError: the engine, the option, the reason and the fix.
        """

    rollout_defaults = {"stop_at_eos": False, "prompt_logprobs": True}
    """The rollout shape this engine samples when none is asked for (Sampling fields left None)."""

    def rollout_shape(self, settings, sampling):
        """``sampling`` with this engine's rollout_defaults in place of fields left None, after refusing a shape
        this engine does not sample (alignaudit.inputs.request.Sampling: group_size, stop_at_eos, prompt_logprobs,
        engine_mode); by default, all but the plain one (one completion per request, EOS ignored, prompt logprobs
        recorded, every request at once). Raises InputError naming the setting."""
        shaped = (
            (sampling.group_size != 1, "--group-size"),
            (sampling.stop_at_eos is True, "--stop-at-eos"),
            (sampling.prompt_logprobs is False, "--no-prompt-logprobs"),
            (sampling.engine_mode != "offline", "--engine-mode"),
        )
        for given, flag in shaped:
            if given:
                raise InputError(
                    f"{flag}: {self.name} rollouts are sampled one completion per request, EOS ignored, "
                    "prompt logprobs recorded, every request at once; use --infer vllm for "
                    "framework-shaped rollouts"
                )
        return self._with_defaults(sampling)

    def _with_defaults(self, sampling):
        import dataclasses

        return dataclasses.replace(
            sampling,
            **{name: value for name, value in self.rollout_defaults.items() if getattr(sampling, name) is None},
        )

    def routing_observable(self, settings) -> bool:
        """Whether an MoE model's routing decisions can be read without changing what the engine computes."""
        return True

    def replays_routing(self, settings) -> bool:
        """Whether, as the trainer, its MoE router can be made to take the rollout engine's experts
        (compare --replay-routing; alignaudit.engines.routing_replay)."""
        return False

    def records_processed_logprobs(self, settings) -> bool:
        """Whether, as the rollout engine, it records logprobs after temperature, top-k and top-p (which the
        training side must then replay)."""
        return False
