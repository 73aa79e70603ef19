"""Tiny random-weight models of the transformers families the engine supports (2-10 layers,
hidden size 64, built from the config classes: nothing is downloaded)."""

from __future__ import annotations

import torch
import transformers

SLOW_DECAY = -4.0
"""``A_log`` of every SSM / linear-attention layer: ``A = -exp(-4)`` lets a state carry over hundreds of
tokens, as trained models' do. Random init (``A_log`` ~ log(1..16)) forgets within a few tokens, and a
test of a state carried across a split prompt then has no power."""

SLIDING = 96  # windows longer than the test budget (64), so sliding layers get compressed inside them
SHORT_SLIDING = 48  # a window whose share (47) is under the budget: kept whole, never more

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    pad_token_id=2,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

# name -> (config class, settings); every family runs its own modeling code at toy size
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(num_hidden_layers=2)),
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=None)),
    "mistral-window": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=SLIDING)),
    "mistral-window-4096": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=4096)),
    "mixtral": (
        "MixtralConfig",
        dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    ),
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=2)),
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=2)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_hidden_layers=2, **MOE)),
    "qwen3-next": (
        "Qwen3NextConfig",
        dict(
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            shared_expert_intermediate_size=32,
            **MOE,
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        dict(
            num_hidden_layers=2,
            sliding_window=SLIDING,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=3,
            sliding_window=SHORT_SLIDING,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
    "cohere2": (
        "Cohere2Config",
        dict(num_hidden_layers=2, sliding_window=SLIDING, layer_types=["sliding_attention", "full_attention"]),
    ),
    "phi3": ("Phi3Config", dict(num_hidden_layers=2)),
    "gpt-neox": ("GPTNeoXConfig", dict(num_hidden_layers=2, rotary_pct=0.5)),
    "olmo2": ("Olmo2Config", dict(num_hidden_layers=2)),
    "granite": (
        "GraniteConfig",
        dict(
            num_hidden_layers=2,
            attention_multiplier=0.5,
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            logits_scaling=2.0,
        ),
    ),
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=3)),
    "gpt-oss": (
        "GptOssConfig",
        dict(
            num_hidden_layers=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=SLIDING,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "deepseek-v3": (
        "DeepseekV3Config",
        dict(
            num_hidden_layers=2,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            num_key_value_heads=4,
        ),
    ),
    # hybrids, in the layer patterns of published checkpoints: Nemotron-H-8B's "M-M-M-M*-" blocks (Mamba,
    # MLP, attention) and Nemotron-3-Nano's "MEMEM*E" (MoE) blocks in one model
    "nemotron-h": (
        "NemotronHConfig",
        dict(
            hybrid_override_pattern="M-M*-MEM*E",
            ssm_state_size=16,
            mamba_num_heads=8,
            mamba_head_dim=16,
            n_groups=2,
            chunk_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32,
        ),
    ),
    # Falcon-H1: attention and Mamba-2 in parallel in every layer, with its own multipliers
    "falcon-h1": (
        "FalconH1Config",
        dict(
            num_hidden_layers=2,
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_d_state=16,
            mamba_chunk_size=16,
            key_multiplier=0.5,
            attention_in_multiplier=1.5,
            ssm_multipliers=[1.0, 0.5, 1.0, 1.0, 0.5],
        ),
    ),
    # Zamba-7B's pattern (attn_layer_period 6): Mamba, Mamba, then a shared attention block before a Mamba layer
    "zamba": ("ZambaConfig", dict(num_hidden_layers=4, num_key_value_heads=4, mamba_d_state=8)),
    # Zamba2-1.2B: one shared attention block (with per-use LoRA adapters, multi-head) at two hybrid layers
    "zamba2": (
        "Zamba2Config",
        dict(
            num_hidden_layers=5,
            num_key_value_heads=4,
            layers_block_type=["mamba", "mamba", "hybrid", "mamba", "hybrid"],
            mamba_d_state=16,
            n_mamba_heads=4,
            chunk_size=16,
            num_mem_blocks=1,
            use_shared_attention_adapter=True,
            adapter_rank=8,
            use_mem_rope=True,
        ),
    ),
    # LFM2-350M's short-convolution layers with attention at some indices; LFM2-8B-A1B's MoE after dense layers
    "lfm2": ("Lfm2Config", dict(num_hidden_layers=4, full_attn_idxs=[2], block_multiple_of=32)),
    "lfm2-moe": (
        "Lfm2MoeConfig",
        dict(num_hidden_layers=4, layer_types=["conv", "conv", "full_attention", "conv"], num_dense_layers=1, **MOE),
    ),
}

# more hybrids, used by tests/test_state_slots.py (per-row recurrent state): Bamba-9B's Mamba-2 layers with
# attention at some indices, Granite 4's (GraniteMoeHybrid) mamba / attention layer types with MoE
HYBRIDS: dict[str, tuple[str, dict]] = {
    "bamba": (
        "BambaConfig",
        dict(
            num_hidden_layers=3,
            attn_layer_indices=[1],
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_chunk_size=16,
        ),
    ),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        dict(
            num_hidden_layers=3,
            layer_types=["mamba", "attention", "mamba"],
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_chunk_size=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=64,
        ),
    ),
    # Jamba's Mamba (v1) layers with attention every attn_layer_period layers and MoE every other layer
    "jamba": (
        "JambaConfig",
        dict(
            num_hidden_layers=4,
            attn_layer_period=4,
            attn_layer_offset=2,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
            num_experts_per_tok=2,
            mamba_d_state=8,
            use_mamba_kernels=False,
        ),
    ),
    # Kimi-Linear: gated delta net (KDA) linear attention layers + multi-head latent attention layers
    "kimi-linear": (
        "KimiLinearConfig",
        dict(
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            linear_head_dim=16,
            linear_num_heads=4,
            linear_conv_kernel_dim=4,
            kv_lora_rank=32,
            q_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            num_key_value_heads=4,
            moe_intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
        ),
    ),
}


def tiny_model(name: str, vocab_size: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A random-weight causal LM of family ``name`` (see :data:`FAMILIES`)."""
    class_name, settings = FAMILIES[name] if name in FAMILIES else HYBRIDS[name]
    config_class = getattr(transformers, class_name)
    settings = {**COMMON, **settings, "vocab_size": vocab_size}
    if class_name == "GPTNeoXConfig":  # its own names for the same things
        settings.pop("num_key_value_heads")
        settings.pop("head_dim")
    if class_name in ("DeepseekV3Config", "Zamba2Config"):  # head sizes derived from other settings
        settings.pop("head_dim")
    config = config_class(**settings)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        if class_name == "GptOssConfig":  # sinks start at zero: give them weight so that they matter
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
        for name, parameter in model.named_parameters():
            if name.endswith("A_log"):
                parameter.fill_(SLOW_DECAY)
    return model.eval()
