"""Quantized weights: ``quantize="int8"/"int4"`` on a model the engine loads, and models the caller
quantized with transformers' ``TorchAoConfig``, through the engine and its fronts. The selection is
checked against an independent SnapKV over that same quantized model's own full-cache attention."""

from __future__ import annotations

import pytest
import torch
from independent_snapkv import assert_kept_kv_are_an_independent_selection
from snapkv_testing import filler_documents, tiny_llama
from torch import nn
from transformers import AutoModelForCausalLM, TorchAoConfig

from snapkv_rag import SnapKVConfig, SnapKVLLM
from snapkv_rag.models import quantize as quantizing

pytestmark = pytest.mark.usefixtures("one_thread")
BUDGET = SnapKVConfig(max_capacity_prompt=64, window_size=8)
QUESTION = "Which harbour lies north?"
LAYERS = {"int8": quantizing.Int8Linear, "int4": quantizing.Int4Linear}


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tokenizer):
    """A tiny Llama saved as a model folder, as a user's checkpoint would be."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(len(tokenizer), intermediate_size=192).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def user_quantized(folder, scheme: str):
    """The tiny model loaded the way a user quantizes one: transformers' TorchAoConfig."""
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, PerGroup

    config = Int8WeightOnlyConfig() if scheme == "int8" else IntxWeightOnlyConfig(torch.int4, PerGroup(32))
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=TorchAoConfig(config), dtype=torch.float32)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantize_replaces_every_linear_layer_and_shrinks_the_weights(folder, scheme):
    plain = SnapKVLLM(str(folder))
    llm = SnapKVLLM(str(folder), quantize=scheme)
    linears = [m for m in plain.model.modules() if isinstance(m, nn.Linear)]
    quantized = [m for m in llm.model.modules() if isinstance(m, LAYERS[scheme])]
    head = quantizing.HEAD_BY_DEFAULT[scheme]
    assert len(quantized) == len(linears) - (0 if head else 1)
    assert isinstance(llm.model.lm_head, LAYERS[scheme] if head else nn.Linear)
    assert llm.model.get_input_embeddings().weight.dtype == torch.float32  # the embedding stays
    assert llm.weight_quantization == scheme and plain.weight_quantization is None
    blocks = sum(m.weight.numel() * 4 for m in linears if m is not plain.model.lm_head)
    saved = quantizing.weight_bytes(plain.model) - quantizing.weight_bytes(llm.model)
    assert saved > blocks * (0.7 if scheme == "int8" else 0.8)  # int8: a quarter left; int4: an eighth (+ scales)


@pytest.mark.parametrize("scheme, tolerance", [("int8", 0.02), ("int4", 0.15)])
def test_a_quantized_layer_is_close_to_its_float_layer_and_rows_do_not_affect_each_other(scheme, tolerance):
    torch.manual_seed(0)
    linear = nn.Linear(256, 96)
    layer = LAYERS[scheme](linear)
    x = torch.randn(5, 7, 256)
    with torch.inference_mode():
        exact, got, steps = linear(x), layer(x), layer(x[:, :1])  # prefill chunks; a decode step
        alone = torch.cat([layer(x[i : i + 1, :1]) for i in range(5)])
        chunks = torch.cat([layer(x[i : i + 1]) for i in range(5)])  # each row's prefill chunk alone
    assert got.shape == exact.shape and got.dtype == exact.dtype
    assert ((got - exact).norm() / exact.norm()).item() < tolerance
    assert ((steps - exact[:, :1]).norm() / exact[:, :1].norm()).item() < tolerance
    assert torch.equal(alone, steps)  # a row's decode step is the same whatever it is batched with
    assert torch.allclose(chunks, got, rtol=1e-5, atol=1e-5)  # a chunk's: to the float matmul's rounding


def test_an_int4_prefill_chunk_multiplies_the_kernels_own_weights_and_decode_rows_equal_single_rows():
    """A chunk of several tokens a row unpacks the 4-bit codes to float weights for one dense
    matmul (the kernel's time grows with every row); the weights are exactly those the kernel
    multiplies by, and a decode row's result does not depend on its batch. (A prompt is prefilled
    on its own, as in the float model, whose dense matmuls need not give a row the same bits in
    every batch either.)"""
    torch.manual_seed(0)
    layer = quantizing.Int4Linear(nn.Linear(256, 128))
    assert layer.unpacks  # 128 output rows: two of the kernel's blocks of 64
    x = torch.randn(3, 9, 256)
    with torch.inference_mode():
        got = layer(x)
        flat = x.reshape(-1, 256)
        kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, layer.packed, layer.group, layer.scales_and_zeros)
        kernel = kernel.view_as(got) + layer.bias
        assert ((got - kernel).norm() / kernel.norm()).item() < 1e-5
        chunks = torch.cat([layer(x[i : i + 1]) for i in range(3)])  # to the dense matmul's rounding
        assert torch.allclose(chunks, got, rtol=1e-5, atol=1e-5)
        steps = layer(x[:, :1])  # a decode step of three rows (a strided view): the kernel
        assert torch.equal(torch.cat([layer(x[i : i + 1, :1]) for i in range(3)]), steps)


def test_an_int8_prefill_chunk_multiplies_the_kernels_own_weights_in_the_inputs_dtype():
    """A chunk of several tokens a row multiplies the dequantized int8 weights in one dense matmul
    (the kernel is slower than that past a few rows): the int8 values and scales the kernel reads,
    without its rounding of the activations to bfloat16; a decode step goes through the kernel."""
    torch.manual_seed(0)
    layer = quantizing.Int8Linear(nn.Linear(256, 96))
    x = torch.randn(3, 9, 256)
    weights = layer.weight.float() * layer.scale.float()[:, None]
    with torch.inference_mode():
        got = layer(x)
        assert torch.allclose(got, x @ weights.t() + layer.bias, rtol=1e-5, atol=1e-5)  # float32 throughout
        kernel = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, 256).bfloat16(), layer.weight, layer.scale)
        kernel = kernel.float().view_as(got) + layer.bias
        assert ((got - kernel).norm() / kernel.norm()).item() < 0.01  # the kernel's, but for bfloat16
        step = x[:, :1].reshape(-1, 256).bfloat16()
        expected = torch.ops.aten._weight_int8pack_mm(step, layer.weight, layer.scale).float().view(3, 1, 96)
        assert torch.equal(layer(x[:, :1]), expected + layer.bias)  # a decode step: the kernel itself


def test_int8_quantizes_the_weights_only_so_an_activation_outlier_costs_the_other_channels_nothing():
    """Small models carry activation outliers (one channel hundreds of times the rest): quantizing
    each token's activations to int8 would round the other channels to zero. ``"int8"`` is
    weight-only, so the result stays that of the int8 weights in floating point."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 64, bias=False)
    layer = quantizing.Int8Linear(linear)
    weights = layer.weight.float() * layer.scale.float()[:, None]  # the int8 weights, dequantized
    x = torch.randn(4, 256) * 0.01
    x[:, 17] = 5.0  # the outlier: 500 times the rest, which per-token int8 codes would round to 0
    with torch.inference_mode():
        got = layer(x)
    small = x.clone()
    small[:, 17] = 0
    expected = x @ weights.t()
    assert ((got - expected).norm() / expected.norm()).item() < 0.01
    # what the small channels add is kept, not rounded away (it is what a tied answer turns on)
    contribution = small @ weights.t()
    recovered = got - x[:, 17:18] @ weights[:, 17:18].t()
    assert ((recovered - contribution).norm() / contribution.norm()).item() < 0.3


@pytest.mark.parametrize("how", ["int8", "int4", "torchao-int8", "torchao-int4"])
def test_the_selection_is_exact_against_the_quantized_models_own_attention(folder, tokenizer, how):
    if how.startswith("torchao"):
        llm = SnapKVLLM(model=user_quantized(folder, how.split("-")[1]), tokenizer=tokenizer)
        assert llm.weight_quantization == "torchao"
    else:
        llm = SnapKVLLM(str(folder), quantize=how)
    ids = llm.request(QUESTION, filler_documents(5)).input_ids
    assert_kept_kv_are_an_independent_selection(llm, ids, BUDGET)


@pytest.mark.parametrize("how", ["int8", "int4", "torchao-int4"])
def test_a_quantized_batch_equals_single_calls(folder, tokenizer, how):
    if how.startswith("torchao"):
        llm = SnapKVLLM(model=user_quantized(folder, "int4"), tokenizer=tokenizer, max_new_tokens=12)
    else:
        llm = SnapKVLLM(str(folder), quantize=how, max_new_tokens=12)
    questions = [QUESTION, "Who keeps the lighthouse?", "When does the ferry leave?"]
    documents = [filler_documents(n) for n in (3, 5, 4)]
    try:
        batch = llm.generate_batch(questions, documents, batch_size=3, snapkv=BUDGET, ignore_eos=True)
        single = [llm.generate(q, d, snapkv=BUDGET, ignore_eos=True) for q, d in zip(questions, documents)]
    finally:
        llm.close()
    assert [r.text for r in batch] == [r.text for r in single]
    assert max(r.timings.batch_size for r in batch) > 1  # they did decode together


def test_bad_quantize_values_and_combinations_are_refused_naming_the_option(folder, tokenizer):
    with pytest.raises(ValueError, match="quantize: expected None, 'int8' or 'int4'"):
        SnapKVLLM(str(folder), quantize="int3")
    model = tiny_llama(len(tokenizer))
    with pytest.raises(ValueError, match="quantize='int8': applies to a model the engine loads"):
        SnapKVLLM(model=model, tokenizer=tokenizer, quantize="int8")
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))  # left as it was
    with pytest.raises(ValueError, match=r"quantized already \(torchao\)"):
        quantizing.quantize_model(user_quantized(folder, "int8"), "int8")
    twice = quantizing.quantize_model(tiny_llama(len(tokenizer)), "int4")
    with pytest.raises(ValueError, match=r"quantized already \(int4\)"):
        quantizing.quantize_model(twice, "int8")


# ---------------------------------------------------------------- every front takes both options
def test_langchain_and_llamaindex_pass_quantize_and_kv_dtype_to_the_engine(folder):
    from langchain_snapkv import SnapKVLLM as LangChainLLM
    from llama_index.llms.snapkv import SnapKVLLM as LlamaIndexLLM

    chain = LangChainLLM(model=str(folder), quantize="int8", kv_dtype="int8", max_new_tokens=4, snapkv=BUDGET)
    index = LlamaIndexLLM(model=str(folder), quantize="int4", kv_dtype="int8", max_new_tokens=4, snapkv=BUDGET)
    try:
        assert (chain.engine.weight_quantization, chain.engine.kv_dtype) == ("int8", "int8")
        assert (index.engine.weight_quantization, index.engine.kv_dtype) == ("int4", "int8")
        assert isinstance(chain.invoke(QUESTION), str)
        assert isinstance(index.complete(QUESTION).text, str)
    finally:
        chain.close()
        index.close()


def test_the_cli_and_the_server_run_a_quantized_model_with_an_8_bit_cache(folder, tmp_path):
    import json
    import subprocess
    import sys

    import httpx
    from server_testing import running_server

    docs = tmp_path / "a.txt"
    docs.write_text(" ".join(f"The river number {i} lies north." for i in range(80)))
    runs = {}
    for flags in ([], ["--quantize", "int8", "--kv-dtype", "int8"]):
        out = subprocess.run(
            [sys.executable, "-m", "snapkv_rag.cli", "ask", "Which river?", "--docs", str(docs), "--model",
             str(folder), "--budget", "64", "--json", "--max-new-tokens", "2", *flags],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        runs[bool(flags)] = json.loads(out.stdout)["compression"]
    assert runs[True]["kept_tokens"] == runs[False]["kept_tokens"]
    assert runs[True]["kv_bytes_kept"] < runs[False]["kv_bytes_kept"] / 3  # int8 + scales against float32
    bad = subprocess.run(
        [sys.executable, "-m", "snapkv_rag.cli", "ask", "q", "--model", str(folder), "--quantize", "int2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "--quantize" in bad.stderr
    llm = SnapKVLLM(str(folder), quantize="int8", kv_dtype="int8", max_new_tokens=4)
    with running_server(llm) as (base, _app):
        reply = httpx.post(
            f"{base}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4},
            timeout=60,
        )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] is not None


def test_a_model_the_user_quantized_answers_the_same_through_langchain_llamaindex_and_the_server(folder, tokenizer):
    """A TorchAoConfig model handed to the engine is the engine's model in every front: LangChain's
    and LlamaIndex's adapters over that engine, and the server, give its own greedy answer."""
    import httpx
    from server_testing import running_server

    from langchain_snapkv import ChatSnapKV
    from llama_index.llms.snapkv import SnapKVLLM as LlamaIndexLLM

    llm = SnapKVLLM(model=user_quantized(folder, "int8"), tokenizer=tokenizer, max_new_tokens=6)
    documents = filler_documents(4)
    try:
        expected = llm.generate(QUESTION, documents, snapkv=BUDGET).text
        assert expected.strip()  # an answer to compare, not an empty one
        chat = ChatSnapKV(engine=llm, max_tokens=6, snapkv=BUDGET)
        assert chat.invoke(QUESTION, documents=documents).content == expected
        index = LlamaIndexLLM(engine=llm, max_new_tokens=6)
        alone = llm.generate(QUESTION, snapkv=None).text
        assert index.complete(QUESTION).text == alone
        with running_server(llm) as (base, _app):
            reply = httpx.post(
                f"{base}/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 6},
                timeout=60,
            )  # fmt: skip
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == alone
        assert llm.weight_quantization == "torchao"
    finally:
        llm.close()
