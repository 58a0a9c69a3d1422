"""A tiny random-weight Llama written with transformers (no download): what the real-vLLM
tests serve, with or without sliding-window layers. Head size 32 and fp32, as vLLM's CPU
attention takes; the seed picks the weights."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _save(model, path: Path) -> Path:
    """fp32 weights and greedy generation, as vLLM loads them."""
    import torch

    path.mkdir(parents=True, exist_ok=True)
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    return path


def write(
    path: str | Path,
    seed: int = 0,
    layers: int = 2,
    sliding_window: int | None = None,
    kv_heads: int = 2,
    head_dim: int = 32,
) -> Path:
    """``sliding_window``: every other layer (from the second) attends to that many tokens
    (``layer_types``, which vLLM's Llama reads): vLLM then runs two KV cache groups, full
    attention and sliding window (its hybrid KV cache manager). ``kv_heads`` of ``head_dim``
    (the attention heads are twice as many, the hidden size follows)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=2 * kv_heads * head_dim,
        intermediate_size=4 * kv_heads * head_dim,
        num_hidden_layers=layers,
        num_attention_heads=2 * kv_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=8192,
        initializer_range=0.05,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
        **(
            {
                "layer_types": [
                    "sliding_attention" if i % 2 else "full_attention" for i in range(layers)
                ],
                "sliding_window": sliding_window,
            }
            if sliding_window
            else {}
        ),
    )
    return _save(LlamaForCausalLM(config), path)


def write_mamba2(path: str | Path, seed: int = 0, layers: int = 2) -> Path:
    """A tiny random-weight Mamba2 (no attention: each request's KV is one state block per
    layer, vLLM's MambaSpec)."""
    import torch
    from transformers import Mamba2Config, Mamba2ForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    config = Mamba2Config(
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=layers,
        state_size=16,
        num_heads=8,
        head_dim=32,
        expand=2,
        n_groups=1,
        conv_kernel=4,
        chunk_size=32,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return _save(Mamba2ForCausalLM(config), path)


if __name__ == "__main__":
    write(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
