"""Small random-weight models of the shapes people serve, built locally (no hub downloads).

Each builder writes a Hugging Face checkpoint (safetensors, bf16) and a word-level tokenizer
into ``out_dir`` and returns it: every prompt word ``w<i>`` is exactly one token, as in
``tiny_model.py``, so tests control token counts and block boundaries exactly. Weights come from
a config and a seed: two builds are identical. Each checkpoint is a few MB (``heavy_llama``:
451 MB) and loads in under a second; a vLLM server's start is vLLM's own (50-170 s on two
shared cores). ``docs/notes-vllm-models.md`` has what vLLM 0.32's CPU build makes of each.

Serve on the CPU build (with ``--enable-prefix-caching``):
- ``gemma3``: sliding-window + full-attention layers (Gemma 3 text, ``Gemma3ForCausalLM``).
- ``gpt_oss``: gpt-oss's shape (MoE, alternating sliding/full attention, attention sinks),
  unquantized bf16.
- ``qwen3_next``: gated delta net (linear attention) + full attention, MoE; vLLM raises its
  block size to 544 tokens.
- ``deepseek_v2``: MLA (latent 512 + 64) with a tiny MoE.
- ``heavy_llama``: Llama-3.1-8B's KV bytes per token (32 layers x 8 KV heads x 128, bf16:
  128 KiB/token) with little compute, for transfer benchmarks.
- ``lora_adapter``: a random LoRA for a Llama-shaped base (``tiny_model`` or ``heavy_llama``).

Do not serve there (kept to retry on a later vLLM; the notes say why): ``granite_hybrid``,
``nemotron_h``, ``falcon_h1``, ``jamba`` (crash in vLLM's CPU Mamba kernels with prefix caching),
``bamba`` (not in vLLM 0.32's model registry).

Command line: ``python models.py NAME OUT_DIR`` (names: ``BUILDERS``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

VOCAB = 512
SPECIAL = ["<unk>", "<s>", "</s>"]
BOS, EOS, PAD = 1, 2, 0
# Peaky logits: greedy choices are far from ties, so a pulled prefix and a recompute agree.
INIT_RANGE = 0.2


def write_tokenizer(out_dir: str, vocab: int = VOCAB) -> None:
    """Word-level tokenizer: ``<unk> <s> </s> w0 w1 ...``, whitespace-split."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ids = {t: i for i, t in enumerate(SPECIAL)}
    for i in range(vocab - len(SPECIAL)):
        ids[f"w{i}"] = len(ids)
    tok = Tokenizer(models.WordLevel(vocab=ids, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<unk>",
    )
    fast.save_pretrained(out_dir)


def _common(**overrides: Any) -> dict[str, Any]:
    base = dict(
        vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
        initializer_range=INIT_RANGE, tie_word_embeddings=False, max_position_embeddings=16384,
        torch_dtype="bfloat16",
    )
    base.update(overrides)
    return base


def _save(out_dir: str, model_cls: Any, config: Any, seed: int, name: str,
          meta: dict[str, Any] | None = None) -> str:
    import torch

    os.makedirs(out_dir, exist_ok=True)
    write_tokenizer(out_dir, config.vocab_size)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    # No chat template: tests use /v1/completions with token-id prompts.
    with open(os.path.join(out_dir, "kvmesh-model.json"), "w") as f:
        json.dump({"builder": name, "seed": seed, "vocab": config.vocab_size, **(meta or {})}, f)
    return out_dir


def gemma3(out_dir: str, seed: int = 0, layers: int = 6, sliding_window: int = 64,
           full_every: int = 3, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
           head_dim: int = 64, intermediate: int = 512) -> str:
    """Gemma 3 text: every ``full_every``-th layer full attention, the others a
    ``sliding_window``-token window (Gemma 3 itself: 5 sliding, 1 full, window 1024)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    layer_types = [
        "full_attention" if (i + 1) % full_every == 0 else "sliding_attention"
        for i in range(layers)
    ]
    config = Gemma3TextConfig(**_common(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        query_pre_attn_scalar=head_dim, sliding_window=sliding_window, layer_types=layer_types,
    ))
    return _save(out_dir, Gemma3ForCausalLM, config, seed, "gemma3",
                 {"sliding_window": sliding_window, "layer_types": layer_types})


def gpt_oss(out_dir: str, seed: int = 0, layers: int = 4, sliding_window: int = 128,
            hidden: int = 256, heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
            experts: int = 4, experts_per_tok: int = 2, intermediate: int = 256) -> str:
    """gpt-oss's shape, unquantized: MoE MLPs, sliding (even layers) and full (odd) attention
    alternating as in gpt-oss (window 128), attention sinks, biased attention projections."""
    from transformers import GptOssConfig, GptOssForCausalLM

    layer_types = [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
    ]
    config = GptOssConfig(**_common(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        num_local_experts=experts, num_experts_per_tok=experts_per_tok,
        sliding_window=sliding_window, layer_types=layer_types,
    ))
    return _save(out_dir, GptOssForCausalLM, config, seed, "gpt_oss",
                 {"sliding_window": sliding_window, "layer_types": layer_types})


def _mamba2(hidden: int, mamba_heads: int, mamba_head_dim: int, d_state: int) -> dict[str, Any]:
    return dict(mamba_n_heads=mamba_heads, mamba_d_head=mamba_head_dim, mamba_n_groups=1,
                mamba_d_state=d_state, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64)


def granite_hybrid(out_dir: str, seed: int = 0, layers: int = 4, hidden: int = 256,
                   heads: int = 4, kv_heads: int = 2, intermediate: int = 512,
                   mamba_heads: int = 8, d_state: int = 16, experts: int = 0) -> str:
    """Granite 4 (``GraniteMoeHybridForCausalLM``): Mamba-2 layers with one attention layer in
    every ``layers // 2`` (here layers 1 and 3 attention, 0 and 2 Mamba); dense MLP unless
    ``experts``."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    layer_types = ["attention" if i % 2 == 1 else "mamba" for i in range(layers)]
    config = GraniteMoeHybridConfig(**_common(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        num_local_experts=experts, num_experts_per_tok=min(2, experts),
        shared_intermediate_size=intermediate, layer_types=layer_types,
        position_embedding_type="rope",
        **_mamba2(hidden, mamba_heads, 2 * hidden // mamba_heads, d_state),
    ))
    return _save(out_dir, GraniteMoeHybridForCausalLM, config, seed, "granite_hybrid",
                 {"layer_types": layer_types})


def bamba(out_dir: str, seed: int = 0, layers: int = 4, hidden: int = 256, heads: int = 4,
          kv_heads: int = 2, intermediate: int = 512, mamba_heads: int = 8,
          d_state: int = 16) -> str:
    """Bamba: Mamba-2 layers, attention at odd indices."""
    from transformers import BambaConfig, BambaForCausalLM

    attn = [i for i in range(layers) if i % 2 == 1]
    config = BambaConfig(**_common(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, attn_layer_indices=attn,
        **_mamba2(hidden, mamba_heads, 2 * hidden // mamba_heads, d_state),
    ))
    return _save(out_dir, BambaForCausalLM, config, seed, "bamba", {"attn_layers": attn})


def nemotron_h(out_dir: str, seed: int = 0, hidden: int = 256, heads: int = 4,
               kv_heads: int = 2, intermediate: int = 512, mamba_heads: int = 8,
               d_state: int = 16, pattern: str = "M*M-") -> str:
    """NemotronH: ``pattern`` of Mamba-2 (``M``), attention (``*``) and MLP (``-``) layers."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(**_common(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=len(pattern),
        hybrid_override_pattern=pattern, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=hidden // heads, mamba_num_heads=mamba_heads,
        mamba_head_dim=2 * hidden // mamba_heads, ssm_state_size=d_state, n_groups=1,
        conv_kernel=4, expand=2, chunk_size=64,
    ))
    return _save(out_dir, NemotronHForCausalLM, config, seed, "nemotron_h", {"pattern": pattern})


def falcon_h1(out_dir: str, seed: int = 0, layers: int = 2, hidden: int = 256, heads: int = 4,
              kv_heads: int = 2, intermediate: int = 512, mamba_heads: int = 8,
              d_state: int = 16) -> str:
    """Falcon-H1: attention and Mamba-2 in parallel in every layer."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    config = FalconH1Config(**_common(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        mamba_n_heads=mamba_heads, mamba_d_head=2 * hidden // mamba_heads, mamba_n_groups=1,
        mamba_d_ssm=2 * hidden, mamba_d_state=d_state, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=64,
    ))
    return _save(out_dir, FalconH1ForCausalLM, config, seed, "falcon_h1")


def jamba(out_dir: str, seed: int = 0, layers: int = 4, hidden: int = 256, heads: int = 4,
          kv_heads: int = 2, intermediate: int = 512, d_state: int = 16) -> str:
    """Jamba: Mamba-1 layers with attention every 2nd layer; dense MLPs (one expert)."""
    from transformers import JambaConfig, JambaForCausalLM

    config = JambaConfig(**_common(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, attn_layer_period=2,
        attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0, num_experts=1,
        num_experts_per_tok=1, mamba_d_state=d_state, mamba_d_conv=4, mamba_expand=2,
        use_mamba_kernels=False,
    ))
    return _save(out_dir, JambaForCausalLM, config, seed, "jamba")


def qwen3_next(out_dir: str, seed: int = 0, layers: int = 4, hidden: int = 256,
               heads: int = 4, kv_heads: int = 2, head_dim: int = 64, intermediate: int = 256,
               experts: int = 4) -> str:
    """Qwen3-Next: gated delta net (linear attention) layers with full attention every 4th
    layer, MoE MLPs."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    layer_types = [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
    ]
    config = Qwen3NextConfig(**_common(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        layer_types=layer_types, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=intermediate,
        shared_expert_intermediate_size=intermediate, decoder_sparse_step=1,
    ))
    return _save(out_dir, Qwen3NextForCausalLM, config, seed, "qwen3_next",
                 {"layer_types": layer_types})


def deepseek_v2(out_dir: str, seed: int = 0, layers: int = 2, hidden: int = 256,
                heads: int = 4, kv_lora_rank: int = 512, q_lora_rank: int | None = None,
                qk_nope_head_dim: int = 128, qk_rope_head_dim: int = 64, v_head_dim: int = 128,
                experts: int = 4, intermediate: int = 512) -> str:
    """DeepSeek-V2's MLA: one latent of ``kv_lora_rank + qk_rope_head_dim`` values per token
    and layer; layer 0 dense, the others a tiny MoE (``experts`` routed + 1 shared). The
    latent keeps DeepSeek's own 512 + 64 = 576: vLLM's CPU MLA backends accept no other
    (``Head dimension 96 is not supported by MLA``)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(**_common(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, kv_lora_rank=kv_lora_rank,
        q_lora_rank=q_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
        head_dim=qk_rope_head_dim, first_k_dense_replace=1, n_routed_experts=experts,
        n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=intermediate // 2,
        topk_method="greedy", n_group=1, topk_group=1,
    ))
    return _save(out_dir, DeepseekV2ForCausalLM, config, seed, "deepseek_v2",
                 {"kv_lora_rank": kv_lora_rank, "qk_rope_head_dim": qk_rope_head_dim})


def heavy_llama(out_dir: str, seed: int = 0, layers: int = 32, kv_heads: int = 8,
                head_dim: int = 128, hidden: int = 1024, intermediate: int = 1024) -> str:
    """Llama-3.1-8B's KV cache (32 layers x 8 KV heads x 128, bf16: 128 KiB per token, 4 MiB
    per 32-token block) with a small model around it (hidden 1024, 8 query heads, MLP 1024;
    about 200 M parameters, 0.4 GB): transfers move an 8B model's bytes while prefill costs
    far less than an 8B model's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**_common(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=kv_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=32768,
    ))
    return _save(out_dir, LlamaForCausalLM, config, seed, "heavy_llama",
                 {"kv_bytes_per_token": layers * kv_heads * head_dim * 2 * 2})


def lora_adapter(base_dir: str, out_dir: str, seed: int = 1, rank: int = 8,
                 targets: tuple[str, ...] = ("q_proj", "v_proj"), scale: float = 0.5) -> str:
    """A random LoRA adapter (PEFT's file layout, written without PEFT) for the Llama-shaped
    model in ``base_dir`` (``tiny_model.build`` or ``heavy_llama``): rank ``rank`` on
    ``targets`` of every layer, ``lora_B`` non-zero so that the adapter changes the output.
    Serve with ``--enable-lora --max-lora-rank >= rank --lora-modules NAME=out_dir``."""
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(base_dir, "config.json")) as f:
        cfg = json.load(f)
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    out_features = {
        "q_proj": cfg["num_attention_heads"] * head_dim,
        "k_proj": cfg["num_key_value_heads"] * head_dim,
        "v_proj": cfg["num_key_value_heads"] * head_dim,
        "o_proj": hidden,
    }
    in_features = {"o_proj": cfg["num_attention_heads"] * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for t in targets:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{t}"
            a = torch.randn(rank, in_features.get(t, hidden), generator=gen) * scale
            b = torch.randn(out_features[t], rank, generator=gen) * scale
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
            "lora_dropout": 0.0, "target_modules": list(targets), "bias": "none",
            "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False,
            "use_dora": False, "base_model_name_or_path": base_dir,
        }, f, indent=1)
    return out_dir


BUILDERS: dict[str, Callable[..., str]] = {
    "gemma3": gemma3,
    "gpt_oss": gpt_oss,
    "granite_hybrid": granite_hybrid,
    "bamba": bamba,
    "nemotron_h": nemotron_h,
    "falcon_h1": falcon_h1,
    "jamba": jamba,
    "qwen3_next": qwen3_next,
    "deepseek_v2": deepseek_v2,
    "heavy_llama": heavy_llama,
}


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in BUILDERS:
        sys.exit(f"usage: models.py {{{','.join(BUILDERS)}}} OUT_DIR")
    print(BUILDERS[sys.argv[1]](sys.argv[2]))
