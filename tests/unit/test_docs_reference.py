"""The docs' generated reference pages (miles_async/launch/reference.py) against the code they are made from.

docs/reference/{recipe,cli,metrics}.md are committed; these tests fail when one differs from what
the structs, the argument parser and the metric table say now (a default changed, a key added, a
flag renamed) until the pages are written again:
`python -m miles_async.launch.reference docs/reference`.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import msgspec
import pytest

from miles_async.launch import reference

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference"


@pytest.mark.parametrize("name", sorted(reference.PAGES))
def test_the_committed_page_is_what_the_code_generates(name: str) -> None:
    committed = (REFERENCE / name).read_text()
    assert committed == reference.PAGES[name](), (
        f"docs/reference/{name} is stale: run `python -m miles_async.launch.reference docs/reference`")


def test_the_recipe_page_shows_each_sections_defaults() -> None:
    from miles_async.actors.recipe import LoopConfig
    from miles_async.engine import EngineConfig

    page = reference.recipe_page()
    loop = page.split("## `[loop]`", 1)[1].split("\n## ", 1)[0]
    assert f"| `num_steps` | `int` | `{LoopConfig().num_steps}` |" in loop
    engine = page.split("## `[rollout.engine]`", 1)[1].split("\n## ", 1)[0]
    assert f'| `dtype` | `Literal[\'float32\', \'bfloat16\', \'float16\', \'auto\']` | `"{EngineConfig().dtype}"` |' in engine
    # keys the run fills in say from what, and the SFT recipe's own sections are there
    assert "| `model_dir` | `str` | set by the run: model.path, model.pretrained or the model the run makes |" in page
    assert "# SFT recipes" in page and '### `plugin = "dataset"`' in page


def test_a_changed_default_or_comment_changes_the_page_and_check_names_the_stale_page(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A struct written to a module of its own, rendered, then changed: the row follows the code."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def render(default: int, comment: str) -> str:
        (tmp_path / "refmod.py").write_text(
            "import msgspec\n\n\nclass Section(msgspec.Struct, frozen=True, kw_only=True):\n"
            '    """A section."""\n\n'
            f"    # {comment}\n    steps: int = {default}  # beside\n    name: str = 'x'\n")
        sys.modules.pop("refmod", None)
        reference._comments.cache_clear()
        reference._annotations.cache_clear()
        section = importlib.import_module("refmod").Section
        out: list[str] = []
        reference._section(out, "demo", section, "demo.", {})
        return "\n".join(out)

    first = render(3, "how many steps")
    assert "| `steps` | `int` | `3` | how many steps beside |" in first and "A section." in first
    assert "| `steps` | `int` | `4` | how many steps beside |" in render(4, "how many steps")
    assert "| `steps` | `int` | `3` | fewer steps beside |" in render(3, "fewer steps")

    for name, text in reference.pages().items():
        (tmp_path / name).write_text(text)
    assert reference.main(["--check", str(tmp_path)]) == 0
    recipe = tmp_path / "recipe.md"
    recipe.write_text(recipe.read_text().replace("| `num_steps` | `int` | `100` |", "| `num_steps` | `int` | `99` |"))
    assert reference.main(["--check", str(tmp_path)]) == 1
    assert f"stale generated page(s): {recipe}" in capsys.readouterr().err
    assert reference.main([str(tmp_path)]) == 0 and reference.main(["--check", str(tmp_path)]) == 0


def test_every_recipe_key_has_a_description() -> None:
    """Each key of the recipe page takes its description from the comment on its field; none is bare."""
    missing = reference.undocumented()
    assert missing == [], (f"{len(missing)} recipe key(s) without a description (add a `# ...` comment above "
                           f"or beside the field): {', '.join(missing)}")


def test_the_cli_page_has_every_verb_and_flag_of_the_parser() -> None:
    import argparse

    from miles_async.launch.cli import build_parser

    page = reference.cli_page()
    parser = build_parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for verb, sub in verbs.choices.items():
        assert f"## `miles-async {verb}`" in page
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in page or f", {flag}" in page, (verb, flag)


def test_the_metrics_page_lists_every_metric() -> None:
    from miles_async.observe.names import METRICS

    page = reference.metrics_page()
    assert all(f"| `{m.name}` |" in page for m in METRICS)
    assert len(METRICS) > 30 and msgspec.json.encode(METRICS)
