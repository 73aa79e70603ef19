"""Tiny random-weight models of the transformers families the engine supports (2-3 layers,
hidden size 64, built from the config classes: nothing is downloaded)."""

from __future__ import annotations

import torch
import transformers

SLIDING = 96  # windows longer than the test budget (64), so sliding layers get compressed inside them
SHORT_SLIDING = 48  # a window whose share (47) is under the budget: kept whole, never more

COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=4096, pad_token_id=2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

# name -> (config class, settings); every family runs its own modeling code at toy size
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(num_hidden_layers=2)),
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=None)),
    "mistral-window": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=SLIDING)),
    "mistral-window-4096": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=4096)),
    "mixtral": ("MixtralConfig", dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=2)),
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=2)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_hidden_layers=2, **MOE)),
    "qwen3-next": ("Qwen3NextConfig", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                           linear_value_head_dim=16, linear_conv_kernel_dim=4, shared_expert_intermediate_size=32,
                                           **MOE)),
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=2, sliding_window=SLIDING, query_pre_attn_scalar=24,
                                    layer_types=["sliding_attention", "full_attention"])),
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=3, sliding_window=SHORT_SLIDING, query_pre_attn_scalar=24,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "cohere2": ("Cohere2Config", dict(num_hidden_layers=2, sliding_window=SLIDING,
                                      layer_types=["sliding_attention", "full_attention"])),
    "phi3": ("Phi3Config", dict(num_hidden_layers=2)),
    "gpt-neox": ("GPTNeoXConfig", dict(num_hidden_layers=2, rotary_pct=0.5)),
    "olmo2": ("Olmo2Config", dict(num_hidden_layers=2)),
    "granite": ("GraniteConfig", dict(num_hidden_layers=2, attention_multiplier=0.5, embedding_multiplier=2.0,
                                      residual_multiplier=0.5, logits_scaling=2.0)),
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=3)),
    "gpt-oss": ("GptOssConfig", dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=SLIDING, layer_types=["sliding_attention", "full_attention"])),
    "deepseek-v3": ("DeepseekV3Config", dict(num_hidden_layers=2, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
                                             qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32, n_group=1, topk_group=1, first_k_dense_replace=1,
                                             num_key_value_heads=4)),
}


def tiny_model(name: str, vocab_size: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A random-weight causal LM of family ``name`` (see :data:`FAMILIES`)."""
    class_name, settings = FAMILIES[name]
    config_class = getattr(transformers, class_name)
    settings = {**COMMON, **settings, "vocab_size": vocab_size}
    if class_name == "GPTNeoXConfig":  # its own names for the same things
        settings.pop("num_key_value_heads")
        settings.pop("head_dim")
    if class_name == "DeepseekV3Config":
        settings.pop("head_dim")
    config = config_class(**settings)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if class_name == "GptOssConfig":  # sinks start at zero: give them weight so that they matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    return model.eval()
