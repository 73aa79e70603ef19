"""snapkv-rag: retrieval-augmented answers from local LLMs with a SnapKV-compressed KV cache."""

from .config import H2OConfig, PyramidKVConfig, RandomConfig, SnapKVConfig, StreamingLLMConfig
from .engine import ContextLengthError, GenerationOutOfMemoryError, SnapKVLLM
from .loading import ModelLoadError
from .prompts import Document, parse_citations
from .results import CompressionStats, GenerationResult, Timings, Usage

__version__ = "0.1.0"

__all__ = [
    "SnapKVLLM",
    "SnapKVConfig",
    "PyramidKVConfig",
    "StreamingLLMConfig",
    "H2OConfig",
    "RandomConfig",
    "Document",
    "GenerationResult",
    "CompressionStats",
    "Timings",
    "Usage",
    "parse_citations",
    "ContextLengthError",
    "GenerationOutOfMemoryError",
    "ModelLoadError",
]
