"""A tiny random-weight Llama and a word-level tokenizer, built locally (no hub downloads).

Every prompt word ``w<i>`` is exactly one token, so tests control token counts and block
boundaries exactly. Weights come from a fixed seed: two builds are identical.
"""

from __future__ import annotations

import json
import os
import sys

VOCAB = 512
SPECIAL = ["<unk>", "<s>", "</s>"]


def build(out_dir: str, seed: int = 0, layers: int = 2, hidden: int = 256, heads: int = 4,
          kv_heads: int = 2, intermediate: int = 512) -> str:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(out_dir, exist_ok=True)
    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for i in range(VOCAB - len(SPECIAL)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out_dir)

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=16384,
        initializer_range=0.2,  # peaky logits: greedy choices are far from ties
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    # No chat template: tests use /v1/completions with token-id prompts.
    with open(os.path.join(out_dir, "kvmesh-tiny.json"), "w") as f:
        json.dump({"seed": seed, "vocab": VOCAB}, f)
    return out_dir


if __name__ == "__main__":
    print(build(sys.argv[1]))
