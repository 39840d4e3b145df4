"""A model placed in a Hugging Face cache as huggingface_hub's downloads leave it (for tests/unit/test_hub_models.py
and tests/e2e/test_hub_run.py).

    <cache>/models--org--name/blobs/<hash>               the files' bytes, named by their hash: git's blob sha1
                                                         for small files, sha256 for LFS ones (the weights)
    <cache>/models--org--name/snapshots/<commit>/<file>  relative symlinks to the blobs
    <cache>/models--org--name/refs/<branch>              the commit, 40 hex digits, no newline

The tests then read it with the real huggingface_hub only (snapshot_download, scan_cache_dir).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def place_in_hub_cache(cache: Path, repo_id: str, folder: Path, *, branch: str = "main") -> str:
    """Put the files of `folder` into `cache` as one commit of `repo_id`, `branch` pointing at it; the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    files = sorted(p for p in Path(folder).iterdir() if p.is_file())
    commit = hashlib.sha1(b"".join(p.name.encode() + p.read_bytes() for p in files) + branch.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for path in files:
        data = path.read_bytes()
        if path.suffix == ".safetensors":  # stored with git-lfs on the Hub: named by its sha256
            blob = hashlib.sha256(data).hexdigest()
        else:
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        link = snapshot / path.name
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(repo / "blobs" / blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    return commit
