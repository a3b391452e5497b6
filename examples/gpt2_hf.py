"""A `transformers` GPT-2 built from a config (random weights, no downloads): the second
family of the examples, whose projections are `Conv1D` (weights stored (K, N)), whose
norms are LayerNorms with biases and whose MLP is bias + GELU (tanh).

On CUDA it has GPT-2 medium's dimensions (d 1024, 24 layers, 16 heads, vocab 50257); on
the CPU it is tiny. Override with ADVISOR_EXAMPLE_SIZE=tiny|full.
"""

from __future__ import annotations

import os

import torch

VOCAB_TINY = 256


def _config(device: torch.device):
    from transformers import GPT2Config

    size = os.environ.get("ADVISOR_EXAMPLE_SIZE", "full" if device.type == "cuda" else "tiny")
    if size == "full":
        return GPT2Config(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257, n_positions=2048)
    return GPT2Config(n_embd=96, n_layer=2, n_head=6, vocab_size=VOCAB_TINY, n_positions=1024)


def build_model(device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    config = _config(torch.device(device))
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = GPT2LMHeadModel(config)
    return model.to(dtype=dtype).eval()


def make_inputs(seq_len: int, batch: int, device: torch.device) -> dict:
    vocab = _config(torch.device(device)).vocab_size
    g = torch.Generator().manual_seed(seq_len * 1000 + batch)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=g).to(device)
    return {"input_ids": ids, "use_cache": False}
