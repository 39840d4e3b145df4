"""A model named by the user, resolved to a local folder: a folder as it is, or a Hugging Face id.

    resolve_model("runs/reverse/final_model")    -> that folder (it must hold config.json)
    resolve_model("Qwen/Qwen3-0.6B")             -> the snapshot of the branch main, downloaded into
                                                    the Hugging Face cache if it is not there yet
    resolve_model("Qwen/Qwen3-0.6B", "v1.0")     -> the snapshot of a branch, tag or commit

A value that exists on disk is a local folder; otherwise one of the form `org/name` is a Hub id,
resolved by `huggingface_hub.snapshot_download` with only the files our loader and the external
engines read (ALLOW_PATTERNS: config, generation config, tokenizer and chat template files, the
safetensors weights and their index). The answer is a `ResolvedModel`: the snapshot folder (its
name is the commit hash, so the path itself pins the revision: the controller hands that path to
every process and node, and nothing resolves the branch again), the repo id and the commit.

The Hugging Face environment is huggingface_hub's own, read when it is first imported: `HF_HOME`
or `HF_HUB_CACHE` (where the cache is), `HF_HUB_OFFLINE=1` (the cache only, no network), `HF_TOKEN`
(gated and private repositories; handed to huggingface_hub by the environment, never written to a
log or a command line here). Resolving writes nothing outside that cache.

Within one process a Hub id and revision resolve once (`_RESOLVED`): the run's pre-flight and the
controller, which both ask, get the same commit even while the branch moves on the Hub.

Bad input is one `ValueError` line naming the value and the fix: a path that does not exist and
is no Hub id, an id not in the cache while offline, a repository or revision the Hub does not
have, a gated or private repository, a folder without config.json, a snapshot without
safetensors weights.

Try it: `HF_HUB_OFFLINE=1 python -m miles_async.models.hub Qwen/Qwen3-0.6B` (from a filled cache).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
from huggingface_hub import constants
from huggingface_hub.errors import (
    DisabledRepoError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

__all__ = ["ALLOW_PATTERNS", "ResolvedModel", "is_hub_id", "resolve_model"]

# What our loader (config, tokenizer, chat template, safetensors) and transformers' tokenizers in
# the external engines read; everything else in a repository (.bin, .gguf, ONNX, images) is left.
ALLOW_PATTERNS = ["config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                  "added_tokens.json", "vocab.*", "merges.txt", "chat_template*", "*.safetensors",
                  "*.safetensors.index.json"]
COMMIT = re.compile(r"[0-9a-f]{40}")
# `org/name`: one slash, nothing that reads as a path (./x, ~/x, /x); huggingface_hub checks the rest.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """A model folder, and where it came from: for a Hub id, the repository and the commit."""

    folder: Path
    repo_id: str | None = None  # None: a local folder
    commit: str | None = None  # the 40-hex commit of the snapshot (None: a local folder)

    @property
    def name(self) -> str:
        """How to call the model to a user (a served model's default name): the Hub id, or the folder's name."""
        return self.repo_id or self.folder.name

    def describe(self, what: str = "model") -> str:
        """The line said once when a run or a server starts."""
        if self.repo_id is None:
            return f"{what} {self.folder}"
        return f"{what} {self.repo_id} at revision {self.commit} ({self.folder})"


_RESOLVED: dict[tuple[str, str, bool, str, bool], ResolvedModel] = {}


def is_hub_id(value: str) -> bool:
    """Whether `value` has the form of a Hub model id (`org/name`); it may still name no model."""
    return bool(HUB_ID.fullmatch(value)) and "--" not in value and ".." not in value


def resolve_model(value: str, revision: str = "", *, key: str = "model.path", revision_key: str = "model.revision",
                  weights: bool = True) -> ResolvedModel:
    """The model `value` names (module docstring); `key` and `revision_key` are the names the user
    gave them (a recipe's keys, a command's options), for the messages. `weights=False`: a Hub
    snapshot's config and tokenizer files only (what a session server reads). ValueError (one
    line) for bad input."""
    path = Path(value).expanduser()
    if not value:
        raise ValueError(f"{key} is empty: name a model folder or a Hugging Face id (org/name)")
    if path.exists():
        if revision:
            raise ValueError(f"{revision_key} {revision!r} picks a revision of a Hugging Face id, but {key} {value!r} "
                             f"is a local folder: remove {revision_key}, or name the model by its Hub id")
        return ResolvedModel(folder=_checked(path, value, key))
    if not is_hub_id(value):
        raise ValueError(f"{key} {value!r} does not exist (no config.json there): name a Hugging Face model folder "
                         "(config.json, *.safetensors) or a Hub id (org/name)")
    memo_key = (value, revision, weights, str(constants.HF_HUB_CACHE), constants.is_offline_mode())
    known = _RESOLVED.get(memo_key)
    if known is not None and (known.folder / "config.json").is_file():
        return known
    patterns = ALLOW_PATTERNS if weights else [p for p in ALLOW_PATTERNS if "safetensors" not in p]
    folder = Path(_download(value, revision, key, revision_key, patterns))
    commit = folder.name if COMMIT.fullmatch(folder.name) else None
    at = f" at revision {commit}" if commit else ""
    if not (folder / "config.json").is_file():
        raise ValueError(f"{key} {value!r}{at} has no config.json: it is not a transformers model (or the cache holds "
                         f"only part of it: `hf download {value}`)")
    if weights and not any(folder.glob("*.safetensors")):
        raise ValueError(f"{key} {value!r}{at} has no *.safetensors weights (the loader reads safetensors only): "
                         f"pick a revision or a repository that has them, or fill the cache (`hf download {value}`)")
    resolved = ResolvedModel(folder=folder, repo_id=value, commit=commit)
    _RESOLVED[memo_key] = resolved
    return resolved


def _checked(folder: Path, value: str, key: str) -> Path:
    if not folder.is_dir():
        raise ValueError(f"{key} {value!r} is a file, not a model folder: name the folder that holds config.json")
    if not (folder / "config.json").is_file():
        raise ValueError(f"{key} {value!r} holds no config.json: name a Hugging Face model folder (config.json, "
                         "*.safetensors), e.g. a finished run's final_model/")
    return folder


def _download(repo_id: str, revision: str, key: str, revision_key: str, patterns: list[str]) -> str:
    """snapshot_download, its failures turned into one line each."""
    what = f"{key} {repo_id!r}" + (f" ({revision_key} {revision!r})" if revision else "")
    fill = f"`hf download {repo_id}{f' --revision {revision}' if revision else ''}` (or `huggingface-cli download`)"
    try:
        return huggingface_hub.snapshot_download(repo_id, revision=revision or None, allow_patterns=patterns)
    except HFValidationError as e:
        raise ValueError(f"{what} is not a valid Hugging Face id ({e}): name a model folder or a Hub id org/name") from e
    except RevisionNotFoundError as e:
        raise ValueError(f"{revision_key} {revision!r}: {repo_id} has no such branch, tag or commit on the Hugging Face "
                         f"Hub: name one it has (e.g. main)") from e
    except GatedRepoError as e:
        raise ValueError(f"{what}: the repository is gated: ask for access at https://huggingface.co/{repo_id}, then "
                         f"{_token_fix()}") from e
    except RepositoryNotFoundError as e:
        raise ValueError(f"{what}: no local folder of that name, and the Hugging Face Hub has no model {repo_id} that "
                         f"can be read (a typo, or a private repository: {_token_fix()})") from e
    except DisabledRepoError as e:
        raise ValueError(f"{what}: the repository is disabled on the Hugging Face Hub: name another model") from e
    except IncompleteSnapshotError as e:
        raise ValueError(f"{what}: the cached snapshot in {constants.HF_HUB_CACHE} is incomplete and the Hub cannot "
                         f"be reached: complete it where the Hub is reachable, {fill}") from e
    except LocalEntryNotFoundError as e:
        raise ValueError(_not_cached(repo_id, revision, what, fill)) from e
    except HfHubHTTPError as e:
        raise ValueError(f"{what}: the Hugging Face Hub answered {_first_line(e)}: try again later, or {fill} "
                         "beforehand") from e
    except OSError as e:  # the disk (full, not writable): the cache is where it writes
        raise ValueError(f"{what}: downloading into {constants.HF_HUB_CACHE} failed: {_first_line(e)}: free space "
                         "there or point HF_HOME (or HF_HUB_CACHE) at a writable folder") from e


def _not_cached(repo_id: str, revision: str, what: str, fill: str) -> str:
    """The line for a model neither in the cache nor downloadable now, saying what the cache holds."""
    held = _cached_revisions(repo_id)
    holds = (f"holds {repo_id} only at {', '.join(held)}" if held else
             f"does not hold it ({constants.HF_HUB_CACHE})")
    if constants.is_offline_mode():
        return (f"{what}: no local folder of that name, and HF_HUB_OFFLINE=1 keeps to the Hugging Face cache, "
                f"which {holds}: fill the cache first, {fill}, or unset HF_HUB_OFFLINE")
    return (f"{what}: no local folder of that name, the Hugging Face Hub cannot be reached, and the Hugging Face "
            f"cache {holds}: check the network (or HF_ENDPOINT), or fill the cache where the Hub is reachable, {fill}")


def _cached_revisions(repo_id: str) -> list[str]:
    """The branches/tags and commits (shortened) of `repo_id` in the cache; [] when it holds none."""
    try:
        info = huggingface_hub.scan_cache_dir(constants.HF_HUB_CACHE)
    except (huggingface_hub.CacheNotFound, OSError):
        return []
    out: list[str] = []
    for repo in info.repos:
        if repo.repo_id == repo_id and repo.repo_type == "model":
            out += sorted(repo.refs)
            out += sorted(r.commit_hash[:12] for r in repo.revisions)
    return out


def _token_fix() -> str:
    """What to do about the token, saying whether one is set and never what it is."""
    if os.environ.get("HF_TOKEN"):
        return "make sure the token in HF_TOKEN belongs to an account that can read it"
    if huggingface_hub.get_token():
        return "the stored token (`hf auth login`) cannot read it: set HF_TOKEN to one that can"
    return "set HF_TOKEN to a token of an account that can read it"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit("usage: python -m miles_async.models.hub MODEL [REVISION]")
    try:
        print(resolve_model(sys.argv[1], sys.argv[2] if len(sys.argv) == 3 else "", key="MODEL",
                            revision_key="REVISION").describe())
    except ValueError as e:
        raise SystemExit(str(e)) from None
