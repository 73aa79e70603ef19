"""Stored document sets on disk: one safetensors file per set (:mod:`snapkv_rag.documents.store`).

The tensors are ``layer.<i>.keys`` / ``.values`` / ``.positions`` per attention layer, packed
without padding (every head's kept slots one after another, with ``.counts`` per head and the padded
``.width``: :mod:`snapkv_rag.kv.ragged`; a layer that layout does not fit is saved padded, as every
layer was in the first format, which still loads); under a ``kv_dtype`` (an 8-bit kept cache,
:mod:`snapkv_rag.kv.quantized`) the keys and values are the 8-bit tensors themselves, with
``.key_scale`` / ``.value_scale`` (per slot and group of channels) beside them, and the metadata
names the ``kv_dtype``: a file is loaded only by an engine of the same ``kv_dtype`` (another is
refused, naming both); a recurrent layer's state after the prefix is ``state.<i>.conv_states.<n>`` /
``.recurrent_states.<n>``, its flags in the metadata; the safetensors header's metadata holds one
JSON string, ``snapkv_rag``: the file format, the library version, the model's and tokenizer's
identity, the method with its settings, the prefix's token ids, the documents (and a hash of their
text), the instruction, the entry's key and a SHA-256 of the tensor data. Loading checks all of it:
a file from another model, dtype, ``kv_dtype``, tokenizer or library version, an unreadable /
truncated file, or data that does not hash to what was saved, is refused with a ``ValueError`` that
says which.

Saving writes a temporary file beside ``path`` (``.<name>.<pid>.partial``), flushes it to disk and
renames it into place, then flushes the folder, so a crash (even SIGKILL or a power cut) leaves at
``path`` either the old complete file or the new complete one, never a torn one; a write that fails
(a full disk) removes its temporary file, leaves ``path`` as it was and raises an ``OSError`` naming
``path``. A file that already holds *another* document set (another key) is never replaced
unless ``overwrite=True`` (``FileExistsError``); saving the same set again rewrites it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as to_bytes
from transformers.cache_utils import LinearAttentionLayer

from ..kv import ragged
from ..kv.prompt_cache import LayerKV
from ..kv.ragged import PackedKV
from ..request.prompts import Document
from .stored import Stored, documents_hash, entry_key, identity, method_from_json, method_json

FORMAT = "snapkv-rag-documents/4"  # /4: 8-bit K/V with a scale per group of channels
# /3: kv_dtype in the metadata, 8-bit K/V with one scale per token and head (only its float files
# are read: the 8-bit ones would need quantizing again)
PER_HEAD_SCALES = "snapkv-rag-documents/3"
# /1: every layer padded; /2: packed
READS = ("snapkv-rag-documents/1", "snapkv-rag-documents/2", PER_HEAD_SCALES, FORMAT)
META = "snapkv_rag"
SLOT_TENSORS = ("keys", "values", "positions", "key_scale", "value_scale")  # per slot (scales: 8-bit only)
TENSOR_STATES = ("conv_states", "recurrent_states")  # a recurrent layer's state object: its tensors
FLAG_STATES = (
    "is_conv_states_initialized",
    "is_recurrent_states_initialized",
    "has_previous_state",
    "conv_kernel_size",
)  # ... and its flags (JSON)


def _tensors(entry: Stored) -> dict[str, torch.Tensor]:
    out = {}
    for i, packed in enumerate(entry.packed):
        if packed is None:
            continue
        if packed.padded is not None:  # a layout kept padded: the layer as it is
            layer = packed.padded
            parts = {name: getattr(layer, name) for name in SLOT_TENSORS}
            parts = {name: None if t is None else t[0] for name, t in parts.items()}
        else:
            parts = {name: getattr(packed, name) for name in SLOT_TENSORS}
            parts.update(counts=packed.counts, width=torch.tensor([packed.width]))
        out.update({f"layer.{i}.{name}": t.contiguous().cpu() for name, t in parts.items() if t is not None})
    for i, state in enumerate(entry.states):
        for name in TENSOR_STATES if state is not None else ():
            out.update(
                {
                    f"state.{i}.{name}.{n}": t.contiguous().cpu()
                    for n, t in getattr(state, name).items()
                    if t is not None
                }
            )
    return out


def _state_meta(entry: Stored) -> dict:
    """Per recurrent layer the flags of its state object (its tensors are saved as ``state.<i>.*``)."""
    return {
        str(i): {
            "number_of_states": state.number_of_states,
            **{name: {str(n): v for n, v in getattr(state, name).items()} for name in FLAG_STATES},
        }
        for i, state in enumerate(entry.states)
        if state is not None
    }


def _states(meta: dict, tensors: dict[str, torch.Tensor], layers: int, device) -> tuple:
    """The state objects saved by :func:`_tensors` and :func:`_state_meta` (``()``: none)."""
    if not meta:
        return ()
    states = [None] * layers
    for i, flags in meta.items():
        state = LinearAttentionLayer(number_of_states=int(flags["number_of_states"]))
        for name in FLAG_STATES:
            setattr(state, name, {int(n): v for n, v in flags[name].items()})
        for name in TENSOR_STATES:
            found = {n: tensors.get(f"state.{i}.{name}.{n}") for n in range(state.number_of_states)}
            setattr(state, name, {n: None if t is None else t.to(device) for n, t in found.items()})
        first = next(t for name in TENSOR_STATES for t in getattr(state, name).values() if t is not None)
        state.dtype, state.device = first.dtype, first.device
        states[int(i)] = state
    return tuple(states)


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        tensor = tensors[name].contiguous().view(torch.uint8)  # (float8 has no numpy dtype: its bytes)
        digest.update(tensor.numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def _meta(path: Path) -> dict | None:
    """The metadata of a file saved here, ``None`` if it is not one (or unreadable)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return json.loads((f.metadata() or {})[META])
    except (SafetensorError, OSError, KeyError, ValueError):
        return None


def save(llm, entry: Stored, path, overwrite: bool = False) -> None:
    """Write ``entry`` to ``path`` (see the module's rules on replacing a file)."""
    path = Path(path)
    if path.exists() and not overwrite:
        old = _meta(path)
        if old is None or old.get("key") != entry.key:
            raise FileExistsError(
                f"path: {path} already exists and holds "
                f"{'another document set' if old else 'something else'}; pass overwrite=True to "
                "replace it, or save to another path"
            )
    tensors = _tensors(entry)
    meta = {
        "format": FORMAT,
        "key": entry.key,
        **identity(llm),
        "kv_dtype": entry.kv_dtype,
        "method": method_json(entry.method),
        "ids": list(entry.ids),
        "layers": len(entry.layers),
        "instruction": entry.instruction,
        "documents": [{"text": d.text, "title": d.title, "id": d.id} for d in entry.documents],
        "documents_hash": documents_hash(entry.documents),
        "states": _state_meta(entry),
        "checksum": _checksum(tensors),
    }
    write_atomically(path, to_bytes(tensors, metadata={META: json.dumps(meta)}))


PARTIAL = ".partial"
CHUNK = 1 << 20


def partial_path(path: Path) -> Path:
    """Where :func:`write_atomically` writes ``path`` before renaming it into place."""
    return path.with_name(f".{path.name}.{os.getpid()}{PARTIAL}")


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` at ``path``, all or nothing (see the module's note on crashes)."""
    partial = partial_path(path)
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view[:CHUNK]) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial, path)
    except OSError as error:
        partial.unlink(missing_ok=True)
        raise OSError(error.errno, f"path: could not write {path}: {error.strerror or error}") from error
    try:  # the rename itself outlives a power cut once the folder is flushed
        folder = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(folder)
    except OSError:
        pass
    finally:
        os.close(folder)


def _check_meta(llm, path: Path, meta) -> dict:
    """``llm``'s identity, once ``meta`` is a document cache file's made by the same model, dtype,
    tokenizer and library version (else a ``ValueError`` naming ``path`` and what differs)."""
    if not isinstance(meta, dict) or meta.get("format") not in READS:
        raise ValueError(f"path: {path} is not a snapkv-rag document cache file (format {FORMAT})")
    mine = identity(llm)
    for field, what in (
        ("library", "library version"),
        ("model", "model"),
        ("model_hash", "model configuration"),
        ("dtype", "dtype"),
        ("tokenizer_hash", "tokenizer"),
    ):
        if meta.get(field) != mine[field]:
            raise ValueError(
                f"path: {path} was made with another {what} ({meta.get(field)!r}; this engine has "
                f"{mine[field]!r}): index the documents again with this engine"
            )
    engine_kv = getattr(llm.runner, "kv_dtype", None)
    if meta.get("kv_dtype") is not None and meta["format"] == PER_HEAD_SCALES:
        raise ValueError(
            f"path: {path} holds an 8-bit cache in an earlier format (one scale per token and head; "
            f"this version keeps one per group of channels): index the documents again with this engine"
        )
    if meta.get("kv_dtype") != engine_kv:
        raise ValueError(
            f"path: {path} holds a cache saved with kv_dtype={meta.get('kv_dtype')!r} and this engine has "
            f"kv_dtype={engine_kv!r}: load it with SnapKVLLM(kv_dtype={meta.get('kv_dtype')!r}), or index "
            "the documents again with this engine"
        )
    return mine


def _read(path: Path, tensors: bool) -> tuple[dict | None, dict]:
    """The metadata saved in the file at ``path`` (``None`` when missing or not JSON) and, if
    ``tensors``, its tensors; a ``ValueError`` naming the file when it cannot be read."""
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(META)
            read = {name: f.get_tensor(name) for name in f.keys()} if tensors else {}
    except (SafetensorError, OSError, RuntimeError, ValueError) as error:
        raise ValueError(
            f"path: {path} is not a readable document cache file (corrupt or truncated: {error})"
        ) from error
    try:
        return (json.loads(raw) if raw is not None else None), read
    except ValueError:
        return None, read


def check_header(llm, path) -> dict:
    """The metadata of the file at ``path`` once its header says it is a document cache file for
    ``llm`` (its tensors are not read: :func:`load` checks them); else a ``ValueError`` naming it."""
    path = Path(path)
    meta, _ = _read(path, tensors=False)
    _check_meta(llm, path, meta)
    return meta


def load(llm, path) -> Stored:
    """The :class:`Stored` entry of a file written by :func:`save`, checked against ``llm``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path: no file at {path}")
    meta, tensors = _read(path, tensors=True)
    mine = _check_meta(llm, path, meta)
    if _checksum(tensors) != meta.get("checksum"):
        raise ValueError(f"path: {path} is corrupt: its tensors do not match the checksum saved with them")
    method = method_from_json(meta["method"])
    ids = tuple(int(i) for i in meta["ids"])
    if entry_key(mine, method, ids) != meta["key"]:
        raise ValueError(f"path: {path} is inconsistent: its key does not match its contents")
    device = llm.runner.device
    packed = [None] * int(meta["layers"])
    for i in range(len(packed)):
        part = {name.rsplit(".", 1)[1]: t.to(device) for name, t in tensors.items() if name.startswith(f"layer.{i}.")}
        slot = [part.get(name) for name in SLOT_TENSORS]
        if "counts" in part:  # packed heads (this format's)
            packed[i] = PackedKV(*slot[:3], part["counts"], int(part["width"]), None, *slot[3:])
        elif "keys" in part:  # a padded layer (and every layer of the first format)
            keys, values, positions, key_scale, value_scale = (None if t is None else t[None] for t in slot)
            packed[i] = ragged.pack(LayerKV(keys, values, positions, None, key_scale, value_scale))
    documents = tuple(Document(text=d["text"], title=d["title"], id=d["id"]) for d in meta["documents"])
    states = _states(meta.get("states") or {}, tensors, len(packed), device)
    return Stored(meta["key"], ids, tuple(packed), method, documents, meta["instruction"], states)
