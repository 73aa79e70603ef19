"""Time to first token over a stored compressed document set against a full prefill, in one run.

One set of 5 documents (NQ passages, the gold passages of the questions asked among them, as in
``prefix_cache.py``; about ``--tokens`` tokens) is asked ``--questions`` questions through the
embedded model, greedy, key-norm at 50% of each prompt (query-agnostic). For each question: a full
prefill of the whole prompt on an engine without the prefix cache (its own key-norm selection over
the whole prompt), then the same question over the handle that ``index_documents`` returned
(the documents compressed once; only the question's tail is prefilled), alternating. It prints per
question the time to first token of each and their ratio (target >= 5x for questions 2-8), the
time ``index_documents`` took (paid once, before question 1), and the stored bytes against the full
cache's bytes of the documents; writes ``results/doc_store.json``.

    nice -n 19 python benchmarks/doc_store.py          # 8 questions, ~2,000-token prompts
    python benchmarks/doc_store.py --quick             # 2 questions, short prompts (a smoke run)
    python benchmarks/doc_store.py --family lfm2       # a hybrid model: the tail one token per step

``--family lfm2``: a random-weight model of the embedded model's size (hidden 576, 30 layers) with
LFM2's layer pattern (short-convolution layers, attention every third layer), the embedded
tokenizer: the stored states make the tail run one token per step, and this measures what that
costs against a full prefill (timings are exact with random weights; answers are not meaningful).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from prefix_cache import document_set, first_token, later_figures, write  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2000, help="prompt length to reach (default 2000)")
    parser.add_argument("--questions", type=int, default=8, help="questions over the one document set (default 8)")
    parser.add_argument("--ratio", type=float, default=0.5, help="share of the prompt key-norm keeps (default 0.5)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="2 questions, ~400-token prompts, 4 new tokens")
    parser.add_argument(
        "--family",
        choices=["embedded", "lfm2"],
        default="embedded",
        help="the embedded model (default), or a random-weight hybrid of its size (lfm2)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default results/doc_store.json (results/doc_store_<family>.json for another family)",
    )
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = (
            HERE / "results" / ("doc_store.json" if args.family == "embedded" else f"doc_store_{args.family}.json")
        )
    if args.quick:
        args.tokens, args.questions, args.max_new_tokens = 400, 2, 4

    from snapkv_rag import KeyNormConfig, SnapKVLLM
    from snapkv_rag.models import loading

    method = KeyNormConfig(ratio=args.ratio)
    loaded = loading.load(None)
    model = loaded.model if args.family == "embedded" else hybrid_model(loaded.model.config, len(loaded.tokenizer))
    plain = SnapKVLLM(model=model, tokenizer=loaded.tokenizer, snapkv=method, prefix_cache_bytes=0)
    stored = SnapKVLLM(model=model, tokenizer=loaded.tokenizer, prefix_cache_bytes=0)
    documents, asked = document_set(loaded.tokenizer, 5, args.questions, args.tokens)
    warm = [{"title": "Warm-up", "text": "A short text written for the warm-up."}]
    plain.generate("Who wrote it?", warm, max_new_tokens=2)
    stored.index_documents(warm, method).generate("Who wrote it?", max_new_tokens=2)
    begin = time.perf_counter()
    handle = stored.index_documents(documents, method)
    index_s = time.perf_counter() - begin
    print(
        f"index_documents: {handle.prompt_tokens} tokens in {index_s:.3f} s; stored {handle.kept_bytes} bytes "
        f"of {handle.full_bytes} full ({handle.kept_bytes / handle.full_bytes:.3f})",
        flush=True,
    )
    rows = []
    for i, record in enumerate(asked, start=1):
        ttft_full, a = first_token(plain, record["question"], documents, args.max_new_tokens)
        ttft_stored, b = first_token(stored, record["question"], handle, args.max_new_tokens)
        rows.append(
            {
                "question": record["question"],
                "prompt_tokens": a.usage.prompt_tokens,
                "stored_tokens": b.usage.cached_tokens,
                "ttft_s_full": ttft_full,
                "ttft_s_stored": ttft_stored,
                "prefill_s_full": a.timings.prefill_s,
                "prefill_s_stored": b.timings.prefill_s,
                "ratio": ttft_full / ttft_stored,
                "same_answer": a.text == b.text,
                "answer_full": a.text,
                "answer_stored": b.text,
            }
        )
        r = rows[-1]
        print(
            f"Q{i} {r['prompt_tokens']} tokens ({r['stored_tokens']} stored): first token {ttft_full:.3f} s full "
            f"prefill, {ttft_stored:.3f} s over the stored set ({r['ratio']:.2f}x); same answer: {r['same_answer']}",
            flush=True,
        )
    summary = {
        "questions": len(rows),
        "documents": len(documents),
        "prompt_tokens": rows[0]["prompt_tokens"],
        "stored_prefix_tokens": handle.prompt_tokens,
        "method": f"keynorm ratio={args.ratio}",
        "max_new_tokens": args.max_new_tokens,
        "model": Path(stored.model_name).name,
        "index_s": index_s,
        "stored_bytes": handle.kept_bytes,
        "full_bytes": handle.full_bytes,
        "stored_share": handle.kept_bytes / handle.full_bytes,
        **later_figures(rows),
        "doc_store": vars(stored.doc_stats()),
        "quick": args.quick,
        "family": args.family,
    }
    print(
        f"questions 2-{len(rows)}: first token {summary['ratio_later_median']:.2f}x sooner over the stored set "
        f"(median; least {summary['ratio_later_min']:.2f}x); stored {summary['stored_share']:.3f} of the full "
        f"cache's bytes; answers differing from the per-question key-norm run: {summary['differing_answers']} "
        f"of {len(rows)}"
    )
    write(args.out, summary, rows)
    return 0


def hybrid_model(like, vocab_size: int):
    """A random-weight LFM2 model of ``like``'s size: every third layer attention, the rest LFM2's
    short convolutions (a recurrent conv state per layer)."""
    import torch
    from transformers import AutoModelForCausalLM, Lfm2Config

    torch.manual_seed(0)
    layers = like.num_hidden_layers
    config = Lfm2Config(
        vocab_size=vocab_size,
        hidden_size=like.hidden_size,
        intermediate_size=like.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=like.num_attention_heads,
        num_key_value_heads=like.num_key_value_heads,
        block_multiple_of=32,
        max_position_embeddings=like.max_position_embeddings,
        layer_types=["full_attention" if i % 3 == 2 else "conv" for i in range(layers)],
    )
    return AutoModelForCausalLM.from_config(config).eval()


if __name__ == "__main__":
    raise SystemExit(main())
