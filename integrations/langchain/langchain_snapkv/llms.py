"""``SnapKVLLM``: the same engine as a LangChain text-completion LLM (string in, string out)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import closing
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from snapkv_rag import GenerationResult

from ._engine import EngineFields, result_metadata


class SnapKVLLM(EngineFields, BaseLLM):
    """Text-completion LLM over a SnapKV-compressed KV cache.

    The prompt is sent as the user turn of the model's chat template. Documents go separately, as
    with :class:`~langchain_snapkv.ChatSnapKV`, so that the question stays last::

        from langchain_snapkv import SnapKVLLM

        llm = SnapKVLLM(max_new_tokens=32)
        text = llm.invoke("Who wrote Hamlet?", documents=["Hamlet is a play by William Shakespeare."])
        result = llm.generate(["Who wrote Hamlet?"], documents=[...])
        result.generations[0][0].generation_info["citations"]   # also compression, timings

    ``generation_info`` carries the same figures as ``ChatSnapKV``'s ``response_metadata``;
    ``llm_output["token_usage"]`` sums the usage over the prompts.
    """

    def _generation(self, result: GenerationResult) -> Generation:
        info = result_metadata(result, self.model_name)
        info["usage"] = {
            "prompt_tokens": result.usage.prompt_tokens,
            "completion_tokens": result.usage.completion_tokens,
        }
        return Generation(text=result.text, generation_info=info)

    def _llm_result(self, generations: list[Generation]) -> LLMResult:
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        for generation in generations:
            for key in usage:
                usage[key] += generation.generation_info["usage"][key]
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return LLMResult(
            generations=[[g] for g in generations], llm_output={"token_usage": usage, "model_name": self.model_name}
        )

    def _one(
        self, prompt: str, options: dict, documents: list | None, run_manager: CallbackManagerForLLMRun | None
    ) -> Generation:
        if not self.streaming:
            return self._generation(self.engine.generate(prompt, documents, **options))
        text = ""
        for chunk in self._chunks(prompt, options, documents, run_manager):
            text += chunk.text
            info = chunk.generation_info
        return Generation(text=text, generation_info=info)

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        options, documents = self._call_options(stop, kwargs)
        if not self.streaming and len(prompts) > 1:  # all at once: the engine decodes them together
            results = self.engine.generate_batch(
                prompts, [documents] * len(prompts), batch_size=len(prompts), **options
            )
            return self._llm_result([self._generation(r) for r in results])
        return self._llm_result([self._one(p, options, documents, run_manager) for p in prompts])

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        options, documents = self._call_options(stop, kwargs)
        if self.streaming:
            generations = []
            for prompt in prompts:
                text, info = "", None
                async for chunk in self._astream(prompt, stop, run_manager, **kwargs):
                    text, info = text + chunk.text, chunk.generation_info or info
                generations.append(Generation(text=text, generation_info=info))
            return self._llm_result(generations)
        results = await asyncio.gather(*(self.engine.agenerate(p, documents, **options) for p in prompts))
        return self._llm_result([self._generation(r) for r in results])

    def _chunk(self, item: str | GenerationResult) -> GenerationChunk:
        if isinstance(item, str):
            return GenerationChunk(text=item)
        return GenerationChunk(text="", generation_info=self._generation(item).generation_info)

    def _chunks(
        self, prompt: str, options: dict, documents: list | None, run_manager: CallbackManagerForLLMRun | None
    ) -> Iterator[GenerationChunk]:
        with closing(self.engine.stream_result(prompt, documents, **options)) as items:
            for item in items:
                chunk = self._chunk(item)
                if run_manager and isinstance(item, str):
                    run_manager.on_llm_new_token(item, chunk=chunk)
                yield chunk

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        options, documents = self._call_options(stop, kwargs)
        yield from self._chunks(prompt, options, documents, run_manager)

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        options, documents = self._call_options(stop, kwargs)
        async for item in self.engine.astream_result(prompt, documents, **options):
            chunk = self._chunk(item)
            if run_manager and isinstance(item, str):
                await run_manager.on_llm_new_token(item, chunk=chunk)
            yield chunk
