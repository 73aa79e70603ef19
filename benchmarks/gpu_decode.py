"""GPU decode speed and memory against the bandwidth floor: full cache vs SnapKV, random weights.

Builds Llama-3-8B-shaped (GQA, 8 KV heads) and Llama-2-7B-shaped (MHA, as the paper's LWM-7B)
models with random bf16 weights directly on the device (no weight files), wraps each in
``SnapKVLLM`` and, for prompts of 16K-128K tokens at batch 1 and 2, times decoding with the full
cache and with SnapKV through the public ``generate_batch``. Every figure is set against the
bandwidth floor of the same run: (weight bytes + KV bytes read per decode step) / device copy
bandwidth, measured first. Also: peak memory per cell, and the longest prompt that fits for each
method (a linear fit of peak memory over prompt length, checked by a real run where the time
budget allows).

Prompts are documents of words from a word-level tokenizer built here (one word = one token, ids
far below either vocabulary), so a prompt's length is exact and any length is cheap to make. The
end-of-sequence rows of the LM head are zeroed so that random weights never stop early.

    python benchmarks/gpu_decode.py results/gpu-h200            # the H200 run, < 8 minutes
    python benchmarks/gpu_decode.py --tiny --device cpu OUT_DIR  # the same code, tiny, on CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MODELS = {
    "llama3-8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "intermediate_size": 14336, "vocab_size": 128256, "rope_theta": 500000.0},
    "llama2-7b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                  "intermediate_size": 11008, "vocab_size": 32000, "rope_theta": 10000.0},
}
TINY_MODELS = {
    "tiny-gqa": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "intermediate_size": 128, "vocab_size": 4096, "rope_theta": 10000.0},
    "tiny-mha": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                 "intermediate_size": 128, "vocab_size": 4096, "rope_theta": 10000.0},
}
SPECIALS = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ---------------------------------------------------------------- prompts
def word_tokenizer(words: int = 2000):
    """A word-level tokenizer over the most frequent words of the benchmark passages."""
    from collections import Counter

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rag_prompts import records

    counts = Counter(w for r in records() for w in (r["text"] + " " + r["question"]).split() if w.isalpha())
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for word, _ in counts.most_common(words):
        vocab.setdefault(word, len(vocab))
    for token in ("[", "]", ":", "?", "Documents", "Question", "Title") + tuple(str(n) for n in range(1000)):
        vocab.setdefault(token, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                  pre_tokenizers.Punctuation(), pre_tokenizers.Digits(True)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
                                        bos_token="<|im_start|>", eos_token="<|im_end|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def random_prompt(llm, target: int, seed: int = 0) -> tuple[str, list[str]]:
    """A question over documents of random words whose rendered prompt is exactly ``target`` tokens."""
    words = [w for w in llm.tokenizer.get_vocab() if w.isalpha() and w not in SPECIALS]
    rng = random.Random(seed)
    question = "what is the name of the " + " ".join(rng.choices(words, k=6)) + " ?"

    def length(docs: list[str]) -> int:
        return len(rag_ids(llm, question, docs))

    doc_words = 500
    docs: list[str] = []
    base = length(["x"])
    per_doc = length(["x", "x"]) - base  # the cost of one more (one-word) document
    while base + len(docs) * (doc_words + per_doc) < target - doc_words - per_doc:
        docs.append(" ".join(rng.choices(words, k=doc_words)))
    short = length(docs + ["x"])
    docs.append(" ".join(rng.choices(words, k=max(1, target - short + 1))))
    got = length(docs)
    if got != target:
        raise RuntimeError(f"prompt builder: wanted {target} tokens, got {got}")
    return question, docs


def rag_ids(llm, question: str, docs: list[str]) -> list[int]:
    from snapkv_rag.prompts import rag_user_message, to_documents

    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": rag_user_message(question, to_documents(docs), llm.instruction)}],
        add_generation_prompt=True, tokenize=False)
    return llm.tokenizer(text, add_special_tokens=False).input_ids


# ---------------------------------------------------------------- device
class Device:
    """Timing, peak memory and capacity on CUDA or (for the tiny test) the CPU."""

    def __init__(self, name: str):
        self.device = torch.device(name)
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def capacity_bytes(self) -> int:
        if self.cuda:
            return torch.cuda.get_device_properties(self.device).total_memory
        return _meminfo_kib("MemAvailable") * 1024

    def reset_peak(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:
                pass

    def peak_bytes(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device)
        return _status_kib("VmHWM") * 1024

    def name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.cuda else (platform.processor() or "cpu")

    def copy_bandwidth(self, megabytes: int) -> float:
        """Bytes per second of a device-to-device copy (each byte read once and written once)."""
        n = megabytes * 2**20 // 2
        src = torch.empty(n, dtype=torch.bfloat16, device=self.device).fill_(1)
        dst = torch.empty_like(src)
        dst.copy_(src)
        repeats = 10
        if self.cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.sync()
            start.record()
            for _ in range(repeats):
                dst.copy_(src)
            stop.record()
            self.sync()
            seconds = start.elapsed_time(stop) / 1000
        else:
            begin = time.perf_counter()
            for _ in range(repeats):
                dst.copy_(src)
            seconds = time.perf_counter() - begin
        del src, dst
        return 2 * n * 2 * repeats / seconds


def _proc_kib(path: str, field: str) -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _meminfo_kib(field: str) -> int:
    return _proc_kib("/proc/meminfo", field)


def _status_kib(field: str) -> int:
    return _proc_kib("/proc/self/status", field)


# ---------------------------------------------------------------- model
def build_llm(name: str, shape: dict, device: Device, dtype: torch.dtype, tokenizer):
    """A random-weight Llama of ``shape`` made on the device, wrapped as a SnapKVLLM."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from snapkv_rag import SnapKVLLM

    shape = dict(shape)
    theta = shape.pop("rope_theta")
    config = LlamaConfig(**shape, rope_parameters={"rope_type": "default", "rope_theta": theta},
                         max_position_embeddings=2**22, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with device.device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    with torch.no_grad():  # random weights must not stop: the EOS logit is 0, the largest of 100K+ is not
        model.lm_head.weight[tokenizer.eos_token_id].zero_()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config._name_or_path = name
    return SnapKVLLM(model=model, tokenizer=tokenizer, snapkv=False)


def weight_bytes_read(model) -> int:
    """Bytes of weights one decode step reads: every parameter but the input embedding (a row
    lookup), unless the LM head shares it."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    if model.get_output_embeddings().weight.data_ptr() != embed.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total


def kv_bytes_per_token(model) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * model.dtype.itemsize


# ---------------------------------------------------------------- one cell
def run_cell(llm, device: Device, size: int, batch: int, budget: int | None, steps: int) -> dict:
    """One (prompt size, batch, method): decode ms/token, prefill time, peak memory."""
    from snapkv_rag import GenerationOutOfMemoryError, SnapKVConfig

    question, docs = random_prompt(llm, size)
    config = SnapKVConfig(max_capacity_prompt=budget) if budget else False
    device.reset_peak()
    base = device.peak_bytes()
    started = time.perf_counter()
    try:
        results = llm.generate_batch([question] * batch, [docs] * batch, batch_size=batch,
                                     max_new_tokens=steps + 1, snapkv=config)
    except (torch.OutOfMemoryError, GenerationOutOfMemoryError) as error:
        return {"status": "OOM", "error": str(error).splitlines()[0], "wall_s": time.perf_counter() - started}
    finally:
        gc.collect()
        if device.cuda:
            torch.cuda.empty_cache()
    result = results[0]
    peak = device.peak_bytes()
    return {"status": "ok", "prompt_tokens": result.usage.prompt_tokens,
            "completion_tokens": result.usage.completion_tokens,
            "decode_ms_per_token": result.timings.decode_ms_per_token, "prefill_s": result.timings.prefill_s,
            "selection_ms": result.compression.selection_ms, "kept_tokens_max": max(result.compression.kept_tokens),
            "peak_bytes": peak, "peak_above_start_bytes": peak - base if device.cuda else peak - base,
            "wall_s": time.perf_counter() - started}


def floor_ms(weights: int, kv_per_token: int, batch: int, cached: float, bandwidth: float) -> tuple[int, float]:
    """Bytes one decode step must read and the time that takes at the copy bandwidth."""
    read = weights + batch * kv_per_token * cached
    return int(read), 1000 * read / bandwidth


# ---------------------------------------------------------------- longest prompt
def longest_fit(llm, device: Device, points: list[tuple[int, int]], budget: int | None, capacity: int,
                time_left: float, last_prefill: tuple[int, float] | None, steps: int) -> dict:
    """Estimate the longest batch-1 prompt from a linear fit of peak memory over length, then
    check it with a real run where the prefill (extrapolated as quadratic in length) fits in time."""
    if len(points) < 2:
        return {"status": "not enough points"}
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    intercept = my - slope * mx
    if slope <= 0:
        return {"status": "no growth with length", "points": points}
    estimate = int((0.97 * capacity - intercept) / slope) // 1024 * 1024
    out = {"status": "estimated", "estimate_tokens": estimate, "bytes_per_token": slope,
           "fixed_bytes": intercept, "points": points}
    if last_prefill is None:
        return out
    length, seconds = last_prefill
    for attempt in (estimate, int(estimate * 0.9) // 1024 * 1024):
        predicted = seconds * (attempt / length) ** 2 * 1.5 + 10
        if predicted > time_left:
            out["check"] = f"skipped: a {attempt}-token prefill would take ~{predicted:.0f} s, {time_left:.0f} s left"
            return out
        started = time.perf_counter()
        cell = run_cell(llm, device, attempt, 1, budget, min(steps, 4))
        time_left -= time.perf_counter() - started
        if cell["status"] == "ok":
            out.update(status="verified", verified_tokens=attempt, check_peak_bytes=cell["peak_bytes"])
            return out
        out["check"] = f"OOM at {attempt} tokens"
    return out


# ---------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path, help="folder to write gpu_decode.json into")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny configs and prompts: a test of the code path")
    parser.add_argument("--models", nargs="+", default=None, help=f"subset of {list(MODELS)} (or tiny ones)")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="prompt lengths (default 16K 32K 64K 128K)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--budget", type=int, default=None, help="SnapKV max_capacity_prompt (default 1024)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per cell")
    parser.add_argument("--time-budget-s", type=float, default=450.0,
                        help="stop starting new cells after this long (default 450: the run must end in 8 min)")
    parser.add_argument("--no-longest", action="store_true", help="skip the longest-prompt estimate and check")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip the third method, SnapKV decoding through the compiled fixed-size-cache step")
    args = parser.parse_args()
    from snapkv_rag import SnapKVLLM

    models = TINY_MODELS if args.tiny else MODELS
    names = args.models or list(models)
    sizes = args.sizes or ([256, 512] if args.tiny else [16384, 32768, 65536, 131072])
    budget = args.budget or (64 if args.tiny else 1024)
    device = Device(args.device)
    dtype = torch.float32 if (args.tiny and not device.cuda) else torch.bfloat16
    started = time.perf_counter()

    def time_left() -> float:
        return args.time_budget_s - (time.perf_counter() - started)

    bandwidth = device.copy_bandwidth(64 if args.tiny else 4096)
    print(f"{device.name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    tokenizer = word_tokenizer()
    report = {"benchmark": "gpu_decode", "device": device.name(), "dtype": str(dtype).removeprefix("torch."),
              "torch": torch.__version__, "copy_bandwidth_bytes_per_s": bandwidth, "budget": budget,
              "steps": args.steps, "sizes": sizes, "batches": args.batches, "tiny": args.tiny,
              "command": "python benchmarks/gpu_decode.py " + " ".join(sys.argv[1:]), "models": {}}
    for name in names:
        if time_left() <= 0:
            report["models"][name] = {"skipped": "time budget"}
            continue
        llm = build_llm(name, models[name], device, dtype, tokenizer)
        compiled = None if args.no_compile else SnapKVLLM(model=llm.model, tokenizer=tokenizer, snapkv=False,
                                                          compile=True)
        warmed: set[int] = set()
        methods = [("full", None, llm), ("snapkv", budget, llm)] + (
            [] if compiled is None else [("snapkv_compiled", budget, compiled)])
        weights, per_token = weight_bytes_read(llm.model), kv_bytes_per_token(llm.model)
        capacity = device.capacity_bytes()
        entry = {"shape": models[name], "weight_bytes_read_per_step": weights, "kv_bytes_per_token": per_token,
                 "capacity_bytes": capacity, "cells": []}
        report["models"][name] = entry
        print(f"{name}: {weights / 2**30:.1f} GiB of weights read per step, {per_token / 2**10:.0f} KiB KV/token",
              flush=True)
        memory_points: dict[str, list[tuple[int, int]]] = {"full": [], "snapkv": []}
        last_prefill: dict[str, tuple[int, float]] = {}
        for size in sizes:
            for batch in args.batches:
                cell = {"size": size, "batch": batch}
                for method, method_budget, engine in methods:
                    cached = (size if method == "full" else min(size, budget)) + args.steps / 2
                    read, floor = floor_ms(weights, per_token, batch, cached, bandwidth)
                    needs = weights + batch * per_token * (size + args.steps)
                    if time_left() <= 0:
                        outcome = {"status": "skipped (time budget)"}
                    elif method == "full" and needs > capacity:
                        outcome = {"status": "OOM", "error": f"predicted: the full cache alone needs "
                                                             f"{needs / 2**30:.0f} GiB"}
                    else:
                        if engine is compiled and batch not in warmed:  # compiles: untimed
                            started_compile = time.perf_counter()
                            run_cell(engine, device, 2 * budget, batch, budget, args.steps)
                            warmed.add(batch)
                            entry.setdefault("compile_s", {})[batch] = time.perf_counter() - started_compile
                        outcome = run_cell(engine, device, size, batch, method_budget, args.steps)
                    outcome.update(floor_bytes_read=read, floor_ms_per_token=floor)
                    if outcome["status"] == "ok":
                        outcome["ratio_to_floor"] = outcome["decode_ms_per_token"] / floor
                        if batch == 1 and method in memory_points:
                            memory_points[method].append((size, outcome["peak_bytes"]))
                            last_prefill[method] = (size, outcome["prefill_s"])
                    cell[method] = outcome
                if cell["full"]["status"] == "ok" and cell["snapkv"]["status"] == "ok":
                    cell["speedup"] = cell["full"]["decode_ms_per_token"] / cell["snapkv"]["decode_ms_per_token"]
                if cell["full"]["status"] == "ok" and cell.get("snapkv_compiled", {}).get("status") == "ok":
                    cell["speedup_compiled"] = (cell["full"]["decode_ms_per_token"]
                                                / cell["snapkv_compiled"]["decode_ms_per_token"])
                entry["cells"].append(cell)
                print(f"  {size} x{batch}: " + ", ".join(
                    f"{m} {cell[m].get('decode_ms_per_token', float('nan')):.2f} ms/token "
                    f"({cell[m].get('ratio_to_floor', float('nan')):.2f}x floor) [{cell[m]['status']}]"
                    for m, _, _ in methods) + (f", speedup {cell['speedup']:.2f}x" if "speedup" in cell else "")
                    + (f", compiled {cell['speedup_compiled']:.2f}x" if "speedup_compiled" in cell else ""),
                    flush=True)
        if not args.no_longest:
            entry["longest"] = {}
            for method, method_budget in (("full", None), ("snapkv", budget)):
                entry["longest"][method] = longest_fit(llm, device, memory_points[method], method_budget, capacity,
                                                       time_left(), last_prefill.get(method), args.steps)
            full_fit, snap_fit = entry["longest"]["full"], entry["longest"]["snapkv"]
            if "estimate_tokens" in full_fit and "estimate_tokens" in snap_fit:
                entry["longest_ratio_estimate"] = snap_fit["estimate_tokens"] / full_fit["estimate_tokens"]
        del llm, compiled, methods
        gc.collect()
        if device.cuda:
            torch.cuda.empty_cache()
    report["wall_s"] = time.perf_counter() - started
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "gpu_decode.json").write_text(json.dumps(report, indent=1))
    print(table(report))
    print(f"wrote {args.out_dir / 'gpu_decode.json'} in {report['wall_s']:.0f} s")


def table(report: dict) -> str:
    lines = ["| model | prompt | batch | full ms/token (x floor) | SnapKV ms/token (x floor) | speedup | "
             "SnapKV compiled ms/token (x floor) | speedup compiled | peak GiB full | peak GiB SnapKV |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, entry in report["models"].items():
        for cell in entry.get("cells", []):
            def show(m: str) -> str:
                c = cell.get(m, {"status": "-"})
                return (f"{c['decode_ms_per_token']:.2f} ({c['ratio_to_floor']:.2f}x)" if c["status"] == "ok"
                        else c["status"])

            def peak(m: str) -> str:
                return f"{cell[m]['peak_bytes'] / 2**30:.1f}" if cell[m]["status"] == "ok" else "-"

            speed = f"{cell['speedup']:.2f}x" if "speedup" in cell else "-"
            compiled = f"{cell['speedup_compiled']:.2f}x" if "speedup_compiled" in cell else "-"
            lines.append(f"| {name} | {cell['size']} | {cell['batch']} | {show('full')} | {show('snapkv')} | "
                         f"{speed} | {show('snapkv_compiled')} | {compiled} | {peak('full')} | {peak('snapkv')} |")
        for method, fit in entry.get("longest", {}).items():
            lines.append(f"| {name} | longest ({method}) | 1 | {fit.get('status')}: "
                         f"{fit.get('verified_tokens', fit.get('estimate_tokens', '-'))} tokens | | | | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
