"""What ``gpu_decode.py`` builds on: prompts of exact length, the device (timing, memory), the
bandwidth floor, a cost model that says whether a cell fits the time and memory left, and a
results file rewritten atomically after every cell with a watchdog that ends the run on time.

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

    def bytes_needed(self, tokens: int, batch: int, steps: int) -> int:
        kv = self.kv_per_token * (tokens + steps) * (1 + 1 / self.layers)
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
