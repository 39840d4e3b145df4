"""A Hub dataset placed in the datasets cache under HF_HOME as `datasets.load_dataset` leaves it after a
download (for tests/unit/test_dataset_task.py and tests/e2e/test_dataset_run.py).

    <HF_HOME>/datasets/<org>___<name>/<subset>/0.0.0/<commit>/dataset_info.json
    <HF_HOME>/datasets/<org>___<name>/<subset>/0.0.0/<commit>/<name>-<split>.arrow

Offline (HF_HUB_OFFLINE=1) the installed `datasets` (5.x) reads a Hub id from this layout only: it
never asks the Hub, and its cached-dataset builder takes the newest folder of the subset. The
files are written by datasets' own Parquet builder from Parquet files of the rows; the tests then
load them with the real `datasets.load_dataset`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

COMMIT = "e53f048856ff4f594e959d75785d2c2d37b678ee"


def place_hub_dataset(home: Path, repo_id: str, name: str, splits: dict[str, list[dict[str, Any]]]) -> Path:
    """`repo_id`'s subset `name` with these splits' rows, in the datasets cache of HF_HOME `home`; its folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet

    home.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in splits.items():
        files[split] = [str(home / f"{split}.parquet")]
        pq.write_table(pa.Table.from_pylist(rows), files[split][0])
    org, short = repo_id.split("/")
    builder = Parquet(cache_dir=str(home / "build"), dataset_name=short, config_name=name, hash=COMMIT,
                      data_files=DataFilesDict.from_patterns(files))
    builder.download_and_prepare()
    dest = home / "datasets" / f"{org}___{short}" / name / "0.0.0" / COMMIT
    dest.parent.mkdir(parents=True)
    # A local builder names its folder by its data files' hash; a download from the Hub, by the subset.
    shutil.move(builder.cache_dir, dest)
    shutil.rmtree(home / "build")
    return dest
