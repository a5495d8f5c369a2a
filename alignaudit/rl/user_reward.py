"""A user's reward for ``alignaudit rl --reward MODULE:FUNCTION``, called as TRL calls a reward function, so that a
TRL user's function works unchanged (trl/trainer/grpo_trainer.py, GRPOTrainer._calculate_rewards):

    FUNCTION(prompts=[str], completions=[str], prompt_ids=[[int]], completion_ids=[[int]], step=int, **columns)
        -> one float per completion

``columns``: each other key of the ``--prompts`` (or ``--eval-prompts``) JSONL file by name, one value per
completion (its prompt's), as TRL passes a dataset's columns (``answer=[...]`` for a GSM8K-style file).

``MODULE`` is a Python file (``rewards.py``, ``path/to/rewards.py``) or an importable module (``my_pkg.rewards``).
prompts and completions are the token ids decoded with the checkpoint's own tokenizer, special tokens skipped (as TRL
decodes completions). Checked before any engine starts: the module imports, FUNCTION exists, is callable and takes
those keywords and the prompt files' columns (TRL's convention: ``**kwargs`` for the ones it does not name).
Checked at every call: one finite number per completion. run.json records the name given, the file the function is
defined in and that file's sha256.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
from pathlib import Path

from alignaudit.errors import InputError

ARGUMENTS = ("prompts", "completions", "prompt_ids", "completion_ids", "step")


def is_user_reward(name) -> bool:
    """Whether ``--reward name`` names a user's function (MODULE:FUNCTION), or is one (a callable: alignaudit.api.rl),
    rather than a built-in reward."""
    return callable(name) or (isinstance(name, str) and ":" in name)


def reward_name(reward) -> str:
    """How run.json names a reward: its name as given, or a callable's MODULE:QUALNAME."""
    if not callable(reward):
        return reward
    function = getattr(reward, "func", reward)  # a functools.partial: the function it calls
    qualified = getattr(function, "__qualname__", type(function).__qualname__)
    return f"{getattr(function, '__module__', None) or type(function).__module__}:{qualified}"


class UserReward:
    """The function ``name`` names (MODULE:FUNCTION; or ``name`` itself, a callable), with the tokenizer of the
    checkpoint at ``model_dir``.

    Raises:
        InputError: the module cannot be imported, has no such function, or the checkpoint has no tokenizer; each
            naming the fix. (check_call: the function cannot take the arguments it will be given.)
    """

    def __init__(self, name, model_dir: str):
        from alignaudit.reports.token_text import load_tokenizer

        self.name = reward_name(name)
        self.function = name if callable(name) else _load(name)
        self.tokenizer, why = load_tokenizer(model_dir)
        if self.tokenizer is None:
            raise InputError(f"--reward {name} is given the prompts and completions as text, and {why}; use a "
                             "checkpoint with a tokenizer")
        self.source = _source_file(self.function)
        self.sha256 = hashlib.sha256(self.source.read_bytes()).hexdigest() if self.source else None

    def check_call(self, columns, source: str) -> None:
        """Refuse, before any engine starts, a call the function cannot take: TRL's arguments (ARGUMENTS) and the
        ``columns`` (names) of the prompt file ``source`` as keywords; a column with an argument's name.
        Raises InputError."""
        clash = sorted(set(columns) & set(ARGUMENTS))
        if clash:
            raise InputError(f"{source}: the column {clash[0]!r} has the name of an argument --reward {self.name} "
                             f"is given ({', '.join(ARGUMENTS)}); rename the column")
        try:
            inspect.signature(self.function).bind(**{key: None for key in (*ARGUMENTS, *columns)})
        except TypeError as e:
            given = f" and the columns of {source} ({', '.join(columns)})" if columns else ""
            raise InputError(f"--reward {self.name}: {self.function.__name__} cannot take TRL's reward arguments"
                             f"{given} ({e}); write it as def f(prompts, completions, **kwargs) -> list[float]"
                             ) from None
        except ValueError:  # a builtin without a signature: let the first call say
            pass

    def record(self) -> dict:
        """What run.json keeps of it: the name given, the function's file and that file's sha256 (both None for a
        callable defined in no Python file, a builtin)."""
        return {"function": self.name, "file": str(self.source) if self.source else None, "sha256": self.sha256}

    def __call__(self, prompt_ids: list[list[int]], completion_ids: list[list[int]], step: int,
                 columns: dict[str, list] | None = None, during: str = "") -> list[float]:
        """One reward per completion, from one call of the user's function (``columns``: name -> one value per
        completion, passed as keyword arguments; check_call refused names that clash). The function gets copies:
        what it changes in its arguments changes nothing the run records. ``during``: where the call is made, for
        the messages ("step 3", "the held-out evaluation after step 20").

        Raises:
            InputError: the function raised, or returned other than one finite number per completion (naming the
                first bad one).
        """
        decode = self.tokenizer.decode
        where = f" ({during})" if during else ""
        try:
            values = self.function(prompts=[decode(p, skip_special_tokens=True) for p in prompt_ids],
                                   completions=[decode(c, skip_special_tokens=True) for c in completion_ids],
                                   prompt_ids=[list(p) for p in prompt_ids],
                                   completion_ids=[list(c) for c in completion_ids], step=step,
                                   **copy.deepcopy(columns or {}))
        except Exception as e:  # noqa: BLE001 - the user's function may raise anything
            text = str(e).splitlines()[0] if str(e) else ""
            raise InputError(f"--reward {self.name} raised {type(e).__name__}: {text}{where}; fix the function"
                             ) from None
        try:
            values = list(values)
        except TypeError:
            raise InputError(f"--reward {self.name} returned {type(values).__name__}, not a list of rewards, one per "
                             f"completion{where}") from None
        if len(values) != len(completion_ids):
            raise InputError(f"--reward {self.name} returned {len(values)} rewards for {len(completion_ids)} "
                             f"completions{where}; return one per completion")
        for i, value in enumerate(values):
            number = getattr(value, "item", lambda v=value: v)()  # a numpy or torch scalar as a Python one
            if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
                raise InputError(f"--reward {self.name} returned {value!r} for completion {i}{where}; every reward "
                                 "must be a finite number (GRPO normalizes them within each group)")
        return [float(getattr(v, "item", lambda v=v: v)()) for v in values]


def _source_file(function) -> Path | None:
    """The Python file ``function`` is defined in: a function's, a functools.partial's function's, a callable
    object's class's; None where there is none (a builtin, a C extension)."""
    for candidate in (function, getattr(function, "func", None), type(function)):
        try:
            found = inspect.getsourcefile(candidate) if candidate is not None else None
        except TypeError:
            continue
        if found and Path(found).is_file():
            return Path(found)
    return None


@functools.lru_cache(maxsize=None)
def _load(name: str):
    """The callable MODULE:FUNCTION names, its module imported once a process (rl checks it before any engine starts,
    then calls it from the loop). Raises InputError naming what failed (not cached)."""
    module_name, _, function_name = name.rpartition(":")
    if not module_name or not function_name:
        raise InputError(f"--reward {name}: give MODULE:FUNCTION, e.g. rewards.py:my_reward")
    try:
        if module_name.endswith(".py") or Path(module_name).is_file():
            path = Path(module_name)
            if not path.is_file():
                raise InputError(f"--reward {name}: no file {path}")
            spec = importlib.util.spec_from_file_location(f"alignaudit_user_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except InputError:
        raise
    except SystemExit as e:  # a module that parses its own command line, or exits, as it is imported
        raise InputError(f"--reward {name}: importing {module_name} called sys.exit({e.code!r}); a reward module must "
                         "not exit when imported (put a script's code under `if __name__ == \"__main__\":`)") from None
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything while it is imported
        raise InputError(f"--reward {name}: importing {module_name} failed: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from None
    function = getattr(module, function_name, None)
    if function is None:
        raise InputError(f"--reward {name}: {module_name} has no {function_name}")
    if not callable(function):
        raise InputError(f"--reward {name}: {function_name} is not a function but {type(function).__name__} "
                         f"{function!r:.40}")
    return function
