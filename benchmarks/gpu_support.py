"""What ``gpu_decode.py`` and ``gpu_transformers.py`` build on: the random-weight model shapes,
prompts of exact length, the device (timing, memory), the bandwidth floor, kernels counted per
decode step with ``torch.profiler``, a summary of torch.compile's counters, a cost model that says
whether a cell fits the time and memory left, and a results file rewritten atomically after every
cell with a watchdog that ends the run on time.

Nothing here needs the package installed: the scripts put the repository root on ``sys.path``.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import random
import threading
import time
from collections import Counter
from pathlib import Path

import torch
from torch.autograd import DeviceType

WARM_STEPS = 3  # decode steps left out of the steady-state figure (first use, CUDA-graph capture)

# ---------------------------------------------------------------- models
MODELS = {  # the model first: Llama-3.1-8B's shape (GQA 32/8 heads, vocab 128256) is the primary one
    "llama3-8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
    },
    "llama2-7b": {  # MHA, as the paper's LWM-7B
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 11008,
        "vocab_size": 32000,
        "rope_theta": 10000.0,
    },
}
TINY_MODELS = {
    "tiny-gqa": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 4096,
        "rope_theta": 10000.0,
    },
    "tiny-mha": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 4096,
        "rope_theta": 10000.0,
    },
}


def pick_models(names: list[str] | None, tiny: bool) -> tuple[dict, list[str]]:
    """The shapes table and the names to run (default: the primary model alone; tiny: both)."""
    models = TINY_MODELS if tiny else MODELS
    names = names or (list(models) if tiny else [next(iter(models))])
    unknown = [n for n in names if n not in models]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; choose from {list(models)}")
    return models, names


def build_model(shape: dict, device: Device, dtype: torch.dtype, tokenizer):
    """A random-weight Llama of ``shape`` on the device whose answers never end early."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = dict(shape)
    theta = shape.pop("rope_theta")
    config = LlamaConfig(
        **shape,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        max_position_embeddings=2**22,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with device.device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    with torch.no_grad():  # random weights must not stop: the EOS logit is 0, the largest of 30K+ is not
        model.lm_head.weight[tokenizer.eos_token_id].zero_()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


# ids 0-2 as in the embedded model's tokenizer (the tests' tiny models take 2 as end and padding)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ---------------------------------------------------------------- prompts
def word_tokenizer(words: int = 2000):
    """A word-level tokenizer over the most frequent words of the benchmark passages: one word is
    one token, so a prompt of any length is exact and cheap to make."""
    from rag_prompts import records
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    counts = Counter(w for r in records() for w in (r["text"] + " " + r["question"]).split() if w.isalpha())
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for word, _ in counts.most_common(words):
        vocab.setdefault(word, len(vocab))
    for token in ("[", "]", ":", "?", ".", ",", "Documents", "Question", "Title") + tuple(str(n) for n in range(1000)):
        vocab.setdefault(token, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(), pre_tokenizers.Digits(True)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def rag_ids(tokenizer, instruction: str, question: str, docs: list[str]) -> list[int]:
    """The token ids the engine will feed for ``question`` over ``docs``."""
    from snapkv_rag.request.prompts import rag_user_message, to_documents

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": rag_user_message(question, to_documents(docs), instruction)}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return tokenizer(text, add_special_tokens=False).input_ids


def random_prompt(tokenizer, instruction: str, target: int, seed: int = 0) -> tuple[str, list[str]]:
    """A question over documents of random words whose rendered prompt is exactly ``target`` tokens."""
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and w not in SPECIALS]
    rng = random.Random(seed)
    question = "what is the name of the " + " ".join(rng.choices(words, k=6)) + " ?"

    def length(docs: list[str]) -> int:
        return len(rag_ids(tokenizer, instruction, question, docs))

    doc_words = 500
    base = length(["x"])
    per_doc = length(["x", "x"]) - base  # the cost of one more (one-word) document
    docs = [
        " ".join(rng.choices(words, k=doc_words))
        for _ in range(max(0, (target - base - doc_words - per_doc) // (doc_words + per_doc)))
    ]
    short = length(docs + ["x"])
    docs.append(" ".join(rng.choices(words, k=max(1, target - short + 1))))
    got = length(docs)
    if got != target:
        raise RuntimeError(f"prompt builder: wanted {target} tokens, got {got}")
    return question, docs


# ---------------------------------------------------------------- device
class Device:
    """Timing, peak memory and free memory on CUDA or (for the tiny test) the CPU."""

    def __init__(self, name: str):
        self.device = torch.device(name)
        self.cuda = self.device.type == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise SystemExit(f"--device {name}: CUDA is not available here (use --tiny --device cpu to test on CPU)")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def clean(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def free_bytes(self) -> int:
        """Memory a new allocation can still get: what the driver says is free (the CUDA context
        and other processes already taken out), or the host's available memory."""
        if self.cuda:
            self.clean()
            return torch.cuda.mem_get_info(self.device)[0]
        return _proc_kib("/proc/meminfo", "MemAvailable") * 1024

    def allocated_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else _proc_kib("/proc/self/status", "VmRSS") * 1024

    def reset_peak(self) -> None:
        self.clean()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:
                pass

    def peak_bytes(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device)
        return _proc_kib("/proc/self/status", "VmHWM") * 1024

    def name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.cuda else (platform.processor() or "cpu")

    def copy_bandwidth(self, megabytes: int) -> float:
        """Bytes per second of a device-to-device copy (each byte read once and written once)."""
        n = megabytes * 2**20 // 2
        src = torch.empty(n, dtype=torch.bfloat16, device=self.device).fill_(1)
        dst = torch.empty_like(src)
        dst.copy_(src)
        self.sync()
        repeats = 10
        begin = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src)
        self.sync()
        seconds = time.perf_counter() - begin
        del src, dst
        self.clean()
        return 2 * n * 2 * repeats / seconds


def _proc_kib(path: str, field: str) -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


# ---------------------------------------------------------------- bytes and the floor
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


def floor_ms(weights: int, kv_per_token: int, batch: int, cached: float, bandwidth: float) -> tuple[int, float]:
    """Bytes one decode step must read and the time that takes at the copy bandwidth."""
    read = weights + batch * kv_per_token * cached
    return int(read), 1000 * read / bandwidth


# ---------------------------------------------------------------- kernels per step
def profiled_counts(action, device: Device) -> dict:
    """What ``action`` launches, from ``torch.profiler``: on CUDA the kernels on the device (copies and
    memsets apart; kernels replayed from a CUDA graph count one by one), on the CPU (the tiny test:
    there are no kernels) the top-level aten operators, of every thread (the engine decodes in its
    worker thread)."""
    from torch.profiler import ProfilerActivity, profile

    options: dict = {"activities": [ProfilerActivity.CUDA] if device.cuda else [ProfilerActivity.CPU]}
    if not device.cuda:
        try:
            options["experimental_config"] = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        except (AttributeError, TypeError):  # an older torch: the calling thread's operators only
            pass
    with profile(**options) as prof:
        action()
        device.sync()
    if device.cuda:
        names = [e.name() for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA]
        copies = sum(n.startswith(("Memcpy", "Memset")) for n in names)
        return {"kernels": len(names) - copies, "copies": copies}
    top = [
        e
        for e in prof.events()
        if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    ]
    return {"kernels": len(top), "copies": 0}


def kernels_per_step(generate, short: int, long: int, layers: int, device: Device) -> dict:
    """Kernels of one decode step, per layer: ``generate(n)`` decodes ``n`` new tokens after the same
    prefill; the difference between ``long`` and ``short`` tokens, over ``long - short``, leaves the
    prefill (and any per-request work) out. ``generate(short)`` runs once unprofiled first."""
    generate(short)
    a = profiled_counts(lambda: generate(short), device)
    b = profiled_counts(lambda: generate(long), device)
    steps = long - short
    per_step = (b["kernels"] - a["kernels"]) / steps
    return {
        # nothing counted (the profiler saw no kernels: no CUPTI, or a CUDA graph's replay unseen) is no figure
        "status": "ok" if per_step > 0 else "no kernels counted",
        "counted": "CUDA kernels (copies apart)" if device.cuda else "top-level aten operators (CPU: no kernels)",
        "kernels_per_step": per_step,
        "kernels_per_layer": per_step / layers,
        "copies_per_step": (b["copies"] - a["copies"]) / steps,
        "new_tokens": [short, long],
        "counts": [a, b],
    }


def dynamo_summary() -> dict:
    """torch.compile's counters so far in this process: graph breaks, graphs, recompiles (and why)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError as error:
        return {"error": str(error)}
    try:
        from torch._dynamo import guard_failures
    except ImportError:
        guard_failures = {}
    breaks = Counter(counters.get("graph_break", {}))
    # each reason's first line (the guard that failed; the user stack trace after it names local files)
    reasons = [
        str(r).strip().splitlines()[0][:200] for failures in guard_failures.values() for r in failures if str(r).strip()
    ]
    return {
        "graph_breaks": sum(breaks.values()),
        "graph_break_reasons": {
            str(k).strip().splitlines()[0][:200]: v for k, v in breaks.most_common(5) if str(k).strip()
        },
        "unique_graphs": counters.get("stats", {}).get("unique_graphs", 0),
        "recompiles": len(reasons),
        "recompile_reasons": reasons[:5],
        "counters": {
            section: {str(k)[:120]: v for k, v in Counter(values).most_common(8)}
            for section, values in counters.items()
            if values
        },
    }


# ---------------------------------------------------------------- what a cell costs
class CostModel:
    """Predicts a cell's seconds and bytes before it runs.

    Prefill time: FLOPs (2 x parameters x tokens for the matrices, plus causal attention
    2 x layers x tokens^2 x hidden) at the slowest rate measured so far in this run (a guess
    before the first measurement). Memory: weights + per row (the KV cache with one layer's copy
    while it is compressed or moved, plus activations of ``ACTIVATION_COPIES`` hidden-sized vectors
    per prompt token)."""

    ACTIVATION_COPIES = 12

    def __init__(self, model, first_rate_flops: float, first_compile_s: float):
        cfg = model.config
        self.params = sum(p.numel() for p in model.parameters())
        self.layers, self.hidden = cfg.num_hidden_layers, cfg.hidden_size
        self.itemsize = model.dtype.itemsize
        self.kv_per_token = kv_bytes_per_token(model)
        self.rate = first_rate_flops
        self.measured = False
        self.compile_s = first_compile_s

    def prefill_flops(self, tokens: int) -> float:
        return 2.0 * self.params * tokens + 2.0 * self.layers * tokens**2 * self.hidden

    def learn_prefill(self, tokens: int, batch: int, seconds: float) -> None:
        if seconds > 0:
            rate = batch * self.prefill_flops(tokens) / seconds
            self.rate = rate if not self.measured else min(self.rate, rate)
            self.measured = True

    def seconds(self, tokens: int, batch: int, steps: int, step_ms: float, prefills: int = 1) -> float:
        """A cell's predicted wall time: its prefills, its decode steps (at three times the floor)
        and a second of prompt building and bookkeeping."""
        return prefills * batch * self.prefill_flops(tokens) / self.rate + steps * 3 * step_ms / 1000 + 1.0

    def bytes_needed(self, tokens: int, batch: int, steps: int, budget: int | None = None) -> int:
        """Bytes above the weights: the kept cache of every layer (all ``tokens``, or ``budget`` of them
        under SnapKV) plus one layer's whole prompt while it is compressed or moved, and activations."""
        kept = tokens if budget is None else min(tokens, budget)
        kv = self.kv_per_token * ((kept + steps) + tokens / self.layers)
        activations = self.ACTIVATION_COPIES * self.hidden * self.itemsize * tokens
        return int(batch * (kv + activations))


# ---------------------------------------------------------------- results on disk
class ResultFile:
    """The report, rewritten atomically (temp file + rename) after every change, so that a run
    killed at any moment leaves valid JSON with every finished cell."""

    def __init__(self, path: Path, report: dict):
        self.path, self.report = path, report
        self.lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.write()

    def write(self, **updates) -> None:
        with self.lock:
            self.report.update(updates)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.report, indent=1, default=str))
            os.replace(tmp, self.path)


class Watchdog:
    """Ends the process ``grace_s`` after the deadline whatever it is doing (a compile, a long
    prefill): the file then says where it stopped. Time checks before each cell keep this from
    being needed; this makes the bound hold by construction."""

    def __init__(self, results: ResultFile, deadline: float, grace_s: float):
        self.results, self.doing = results, "starting"
        self.kill_at = deadline + grace_s
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while time.monotonic() < self.kill_at:
            time.sleep(0.5)
        self.results.write(ended=f"killed by the watchdog at the deadline, during: {self.doing}")
        print(f"watchdog: deadline passed during {self.doing}; results so far are in {self.results.path}", flush=True)
        os._exit(124)
