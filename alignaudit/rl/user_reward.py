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
MAX_REWARD = 1e100  # |reward| at most: a group's variance, a sum of squares, stays finite in float64 (1e308)


def is_user_reward(name) -> bool:
    """Whether ``--reward name`` names a user's function (MODULE:FUNCTION), or is one (a callable: alignaudit.api.rl),
    rather than a built-in reward."""
    return callable(name) or (isinstance(name, str) and ":" in name)


def reward_name(reward) -> str:
    """How run.json names a reward: its name as given, or a callable's MODULE:QUALNAME (a functools.partial's function,
    a decorated function's own: inspect.unwrap)."""
    if not callable(reward):
        return reward
    function = inspect.unwrap(getattr(reward, "func", reward))
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
        if callable(name):
            self.function, self.source = name, _source_file(name)
            self.sha256 = hashlib.sha256(self.source.read_bytes()).hexdigest() if self.source else None
        else:  # the file's bytes that were run, and their hash, read once
            self.function, self.source, self.sha256 = _load(name)
        tokenizer, why = load_tokenizer(model_dir)
        if tokenizer is None:
            raise InputError(
                f"--reward {name} is given the prompts and completions as text, and {why}; use a "
                "checkpoint with a tokenizer"
            )
        self.tokenizer = tokenizer

    def check_call(self, columns, source: str) -> None:
        """Refuse, before any engine starts, a call the function cannot take: TRL's arguments (ARGUMENTS) and the
        ``columns`` (names) of the prompt file ``source`` as keywords; a column with an argument's name.
        Raises InputError."""
        clash = sorted(set(columns) & set(ARGUMENTS))
        if clash:
            raise InputError(
                f"{source}: the column {clash[0]!r} has the name of an argument --reward {self.name} "
                f"is given ({', '.join(ARGUMENTS)}); rename the column"
            )
        try:
            inspect.signature(self.function).bind(**{key: None for key in (*ARGUMENTS, *columns)})
        except TypeError as e:
            given = f" and the columns of {source} ({', '.join(columns)})" if columns else ""
            called = getattr(self.function, "__name__", type(self.function).__name__)
            raise InputError(
                f"--reward {self.name}: {called} cannot take TRL's reward arguments"
                f"{given} ({e}); write it as def f(prompts, completions, **kwargs) -> list[float]"
            ) from None
        except ValueError:  # a builtin without a signature: let the first call say
            pass

    def record(self) -> dict:
        """What run.json keeps of it: the name given, the function's file and that file's sha256 (both None for a
        callable defined in no Python file, a builtin)."""
        return {"function": self.name, "file": str(self.source) if self.source else None, "sha256": self.sha256}

    def __call__(
        self,
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        step: int,
        columns: dict[str, list] | None = None,
        during: str = "",
    ) -> list[float]:
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
            values = self.function(
                prompts=[decode(p, skip_special_tokens=True) for p in prompt_ids],
                completions=[decode(c, skip_special_tokens=True) for c in completion_ids],
                prompt_ids=[list(p) for p in prompt_ids],
                completion_ids=[list(c) for c in completion_ids],
                step=step,
                **copy.deepcopy(columns or {}),
            )
            if inspect.isawaitable(values):  # an async reward, as TRL awaits one
                import asyncio

                values = asyncio.run(_awaited(values))
        except SystemExit as e:
            raise InputError(
                f"--reward {self.name} called sys.exit({e.code!r}){where}; return the rewards instead"
            ) from None
        except Exception as e:  # noqa: BLE001 - the user's function may raise anything
            text = str(e).splitlines()[0] if str(e) else ""
            raise InputError(
                f"--reward {self.name} raised {type(e).__name__}: {text}{where}; fix the function"
            ) from None
        try:
            values = list(values)
        except TypeError:
            raise InputError(
                f"--reward {self.name} returned {type(values).__name__}, not a list of rewards, one per "
                f"completion{where}"
            ) from None
        if len(values) != len(completion_ids):
            raise InputError(
                f"--reward {self.name} returned {len(values)} rewards for {len(completion_ids)} "
                f"completions{where}; return one per completion"
            )
        rewards = []
        for i, value in enumerate(values):
            number = getattr(value, "item", lambda v=value: v)()  # a numpy or torch scalar as a Python one
            try:  # a bool is 0 or 1, as TRL's float tensor of the rewards reads it
                reward = float(number) if isinstance(number, (int, float)) else math.nan
            except OverflowError:
                reward = math.inf
            if not math.isfinite(reward) or abs(reward) > MAX_REWARD:
                raise InputError(
                    f"--reward {self.name} returned {value!r:.60} for completion {i}{where}; every reward "
                    f"must be a finite number of magnitude at most {MAX_REWARD:g} (GRPO normalizes them "
                    "within each group, in float64)"
                )
            rewards.append(reward)
        return rewards


async def _awaited(values):
    return await values


def _source_file(function) -> Path | None:
    """The Python file ``function`` is defined in: a function's (the innermost of decorators that say what they wrap:
    inspect.unwrap), a functools.partial's function's, a callable object's class's; None where there is none (a
    builtin, a C extension)."""
    inner = getattr(function, "func", function)
    for candidate in (inspect.unwrap(function), inspect.unwrap(inner), type(function)):
        try:
            found = inspect.getsourcefile(candidate) if candidate is not None else None
        except TypeError:
            continue
        if found and Path(found).is_file():
            return Path(found)
    return None


def _load(name: str) -> tuple:
    """(the callable MODULE:FUNCTION names, the file it was run from, that file's sha256). A file module is run from
    the bytes hashed (so the hash is of the code that runs), once a process for those bytes at that absolute path:
    rl's check before any engine starts and the loop share it, and a file changed between two runs of one process
    (alignaudit.api.rl) is run again. An importable module is imported as Python imports it. Raises InputError
    naming what failed."""
    module_name, _, function_name = name.rpartition(":")
    if not module_name or not function_name:
        raise InputError(f"--reward {name}: give MODULE:FUNCTION, e.g. rewards.py:my_reward")
    if module_name.endswith(".py") or Path(module_name).is_file():
        path = Path(module_name)
        if not path.is_file():
            raise InputError(f"--reward {name}: no file {path}")
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        return _file_function(str(path.resolve()), digest, function_name, name, data), path.resolve(), digest
    function = _module_function(module_name, function_name, name)
    source = _source_file(function)
    return function, source, hashlib.sha256(source.read_bytes()).hexdigest() if source else None


@functools.lru_cache(maxsize=None)
def _file_function(path: str, digest: str, function_name: str, name: str, data: bytes):
    """FUNCTION of the Python file at ``path`` run from ``data`` (its bytes, hashed to ``digest``: the cache key with
    the path). Raises InputError (not cached)."""

    def run():
        module = type(sys)(f"alignaudit_user_reward_{digest[:16]}")
        module.__file__ = path
        sys.modules[module.__name__] = module
        exec(compile(data, path, "exec"), module.__dict__)
        return module

    return _import(run, Path(path).name, function_name, name)


@functools.lru_cache(maxsize=None)
def _module_function(module_name: str, function_name: str, name: str):
    """FUNCTION of the importable module ``module_name``. Raises InputError (not cached)."""
    return _import(lambda: importlib.import_module(module_name), module_name, function_name, name)


def _import(run, module_name: str, function_name: str, name: str):
    """The module ``run()`` imports, then its FUNCTION, checked to be callable. Raises InputError naming what
    failed."""
    try:
        module = run()
    except InputError:
        raise
    except SystemExit as e:  # a module that parses its own command line, or exits, as it is imported
        raise InputError(
            f"--reward {name}: importing {module_name} called sys.exit({e.code!r}); a reward module must "
            'not exit when imported (put a script\'s code under `if __name__ == "__main__":`)'
        ) from None
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything while it is imported
        raise InputError(
            f"--reward {name}: importing {module_name} failed: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    function = getattr(module, function_name, None)
    if function is None:
        raise InputError(f"--reward {name}: {module_name} has no {function_name}")
    if not callable(function):
        raise InputError(
            f"--reward {name}: {function_name} is not a function but {type(function).__name__} {function!r:.40}"
        )
    return function
