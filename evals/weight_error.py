"""Where int8 weights lose the unquantized model's answers: the same engine with its linear layers
rounded by one scheme at a time, against the unquantized (float32) model on the same NQ prompts.

Per scheme, two figures: the mean KL divergence of the next-token distributions from the float32
model's over every position of the first ``--kl-prompts`` prompts (teacher-forced, one forward pass
each), and the share of greedy answers (``--max-new-tokens``, full cache) identical to float32's.

Schemes (``SCHEMES``): the weights rounded to bfloat16 (the scale for the others: the rounding
that the whole bfloat16 engine adds); int8 with one scale per output channel, as ``quantize="int8"``
stores them, computed in float32 (the rounding of the weights alone) and through the shipped layer
(:class:`~snapkv_rag.models.quantize.Int8Linear`: over a prompt, which is all the KL sees, a dense
product of its int8 weights and scales stored in bfloat16; for each decode step, the int8 kernel
with bfloat16 activations); int8 with a scale per
group of 64 or 32 input channels (finer than any int8 kernel the project has on a CPU); and
per-channel int8 on one part of the model only (the output head, the attention projections, the
MLPs), which says where the error comes from.

    python -m evals.weight_error --num-questions 40 --out evals/results/quantized/weight_error.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from snapkv_rag.models.quantize import Int8Linear

from . import datasets


def round_int8(weight: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """``weight`` rounded to symmetric int8 and back: one scale per output channel (``group``
    None), or per ``group`` input channels; each scale is the group's largest magnitude / 127."""
    out, inputs = weight.shape
    size = inputs if group is None else group
    if inputs % size:
        raise ValueError(f"group {group}: does not divide {inputs} input channels")
    grouped = weight.float().reshape(out, inputs // size, size)
    scale = (grouped.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)
    return (torch.round(grouped / scale).clamp(-127, 127) * scale).reshape(out, inputs).to(weight.dtype)


class Rounded(nn.Module):
    """A linear layer whose weight is another's, rounded: computed in the input's dtype."""

    def __init__(self, linear: nn.Linear, weight: torch.Tensor):
        super().__init__()
        self.weight, self.bias = weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


def _parts(*names: str) -> Callable[[str, bool], bool]:
    return lambda name, is_head: any(part in name for part in names) and not is_head


def _everything(name: str, is_head: bool) -> bool:
    return True


def _head(name: str, is_head: bool) -> bool:
    return is_head


SCHEMES: dict[str, tuple[Callable, Callable[[str, bool], bool]]] = {
    # name: (the layer that replaces a linear, which linears: (name, is the output head) -> bool)
    "bfloat16 weights": (lambda m: Rounded(m, m.weight.detach().to(torch.bfloat16).float()), _everything),
    "int8 per channel (float32 product)": (lambda m: Rounded(m, round_int8(m.weight.detach())), _everything),
    "int8 per channel (shipped layer)": (Int8Linear, _everything),
    "int8 groups of 64": (lambda m: Rounded(m, round_int8(m.weight.detach(), 64)), _everything),
    "int8 groups of 32": (lambda m: Rounded(m, round_int8(m.weight.detach(), 32)), _everything),
    "int8 per channel: head only": (lambda m: Rounded(m, round_int8(m.weight.detach())), _head),
    "int8 per channel: attention only": (lambda m: Rounded(m, round_int8(m.weight.detach())), _parts("self_attn")),
    "int8 per channel: MLPs only": (lambda m: Rounded(m, round_int8(m.weight.detach())), _parts("mlp")),
}
ANSWERED = tuple(name for name, (_, which) in SCHEMES.items() if which is _everything)
"""The schemes whose answers are compared too (those over the whole model; the others: KL only)."""


def swap(model: nn.Module, make: Callable, which: Callable[[str, bool], bool]) -> dict[str, nn.Module]:
    """Replace the chosen linear layers of ``model`` by ``make(layer)``; returns the originals."""
    head = model.get_output_embeddings()
    chosen = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and which(n, m is head)]
    for name, module in chosen:
        _set(model, name, make(module))
    return dict(chosen)


def restore(model: nn.Module, originals: dict[str, nn.Module]) -> None:
    for name, module in originals.items():
        _set(model, name, module)


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


@torch.no_grad()
def log_probs(model: nn.Module, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.log_softmax(model(ids[None]).logits[0].float(), -1) for ids in prompts]


def mean_kl(reference: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """KL(reference || other) per position, averaged over positions and then prompts."""
    per_prompt = [(ref.exp() * (ref - o)).sum(-1).mean().item() for ref, o in zip(reference, other)]
    return sum(per_prompt) / len(per_prompt)


def answers(llm, examples, max_new_tokens: int) -> list[str]:
    llm.prefix_cache.clear()  # a cached document prefix holds the keys another scheme computed
    options = {"snapkv": False, "max_new_tokens": max_new_tokens}
    return [llm.generate(e.question, list(e.documents), **options).text for e in examples]


def measure(llm, examples, kl_prompts: int, max_new_tokens: int, schemes=None, say=print) -> list[dict]:
    """One record per scheme: its mean KL and, for the schemes in :data:`ANSWERED`, how many of
    its greedy answers equal float32's."""
    prompts = [torch.as_tensor(llm.request(e.question, list(e.documents)).input_ids) for e in examples[:kl_prompts]]
    reference, reference_answers = log_probs(llm.model, prompts), answers(llm, examples, max_new_tokens)
    records = []
    for name in schemes or SCHEMES:
        start = time.perf_counter()
        make, which = SCHEMES[name]
        originals = swap(llm.model, make, which)
        try:
            record = {"scheme": name, "kl": mean_kl(reference, log_probs(llm.model, prompts))}
            if name in ANSWERED:
                got = answers(llm, examples, max_new_tokens)
                record["identical"] = sum(a == b for a, b in zip(got, reference_answers))
                record["prompts"] = len(examples)
        finally:
            restore(llm.model, originals)
        records.append(record)
        say(f"{name}: {json.dumps(record)} ({time.perf_counter() - start:.0f} s)")
    return records


def markdown(records: list[dict], command: str, kl_prompts: int) -> str:
    lines = [
        "# Where int8 weights lose answers: one rounding at a time against float32",
        "",
        f"`{command}`",
        "",
        f"KL: mean over every position of the first {kl_prompts} prompts, teacher-forced. Identical: greedy "
        "full-cache answers equal to the float32 model's.",
        "",
        "| weights | mean KL | identical answers |",
        "|---|---:|---:|",
    ]
    for r in records:
        same = f"{r['identical']}/{r['prompts']} ({r['identical'] / r['prompts']:.0%})" if "identical" in r else "-"
        lines.append(f"| {r['scheme']} | {r['kl']:.5f} | {same} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.weight_error", description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-questions", type=int, default=40, help="NQ prompts answered per scheme (default 40)")
    parser.add_argument("--kl-prompts", type=int, default=12, help="prompts the KL is taken over (default 12)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="answer length (default 16)")
    parser.add_argument(
        "--num-docs", type=int, default=10, help="documents per prompt, gold in the middle (default 10)"
    )
    parser.add_argument("--out", type=Path, required=True, help="the markdown table (a .json beside it)")
    args = parser.parse_args(argv)
    if not 1 <= args.kl_prompts <= args.num_questions:
        parser.error(f"--kl-prompts {args.kl_prompts}: give 1 to --num-questions ({args.num_questions})")
    from snapkv_rag import SnapKVLLM

    examples = datasets.nq_examples(args.num_questions, [args.num_docs], ["middle"], 0)
    llm = SnapKVLLM(None, device="cpu", dtype="float32", prefix_cache_bytes=0)  # each scheme prefills anew
    records = measure(llm, examples, args.kl_prompts, args.max_new_tokens, say=lambda s: print(s, file=sys.stderr))
    command = "python -m evals.weight_error " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown(records, command, args.kl_prompts))
    args.out.with_suffix(".json").write_text(json.dumps(records, indent=1) + "\n")
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
