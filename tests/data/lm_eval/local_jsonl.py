"""The datasets of the tiny lm-eval tasks in this folder: JSONL files beside this module, read with
`datasets` (no download). A task names its file in `dataset_kwargs.data_files`; lm-eval calls
`load` as the task's `custom_dataset` (`!function local_jsonl.load`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets

HERE = Path(__file__).resolve().parent


def load(data_files: str, **_metadata: Any) -> datasets.DatasetDict:
    """The file as the task's one split, "test"; lm-eval also passes its metadata, unused here."""
    return datasets.load_dataset("json", data_files={"test": str(HERE / data_files)})
