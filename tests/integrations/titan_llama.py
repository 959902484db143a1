"""A tiny Llama with torchtitan's parameter names, and its state-dict adapter to transformers'
``LlamaForCausalLM`` names, for the Hugging Face tests of the torchtitan manager.

torchtitan's own ``torchtitan.models.llama3`` (its debug model and ``Llama3StateDictAdapter``)
needs triton to import, which a CPU machine lacks; so the tests bring this adapter, built on
torchtitan's ``StateDictAdapter`` base (which reads ``fqn_to_index_mapping`` from
``hf_assets_path``) and converting as torchtitan's Llama 3 adapter does: the same names, and
the query and key rows permuted between torchtitan's rotary layout and transformers'. The
forward pass is a stand-in that gives every weight a gradient, not Llama's."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

# transformers must never reach the network: models are built from configs
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DIM, HEADS, KV_HEADS, LAYERS, VOCAB, HIDDEN = 64, 4, 2, 2, 256, 128
HEAD_DIM = DIM // HEADS


def hf_config() -> Any:
    """transformers' config of the same model."""
    import transformers

    return transformers.LlamaConfig(
        hidden_size=DIM,
        intermediate_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        repeat = HEADS // KV_HEADS
        k = self.wk(x).repeat_interleave(repeat, dim=-1)
        v = self.wv(x).repeat_interleave(repeat, dim=-1)
        out: torch.Tensor = self.wo(torch.tanh(self.wq(x) * k) * v)
        return out


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = Attention()
        self.feed_forward = FeedForward()
        self.attention_norm = nn.RMSNorm(DIM)
        self.ffn_norm = nn.RMSNorm(DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h))
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    """torchtitan's Llama 3 names: ``tok_embeddings``, ``layers.N.attention.wq`` ...,
    ``norm``, ``lm_head``. Takes the float batches of the tests' datasets, as token ids."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = (x * 100).long().remainder(VOCAB)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        out: torch.Tensor = self.lm_head(self.norm(h))
        return out


@dataclass
class ModelConfig:
    """What the adapter reads of the model's config."""

    dim: int = DIM
    n_heads: int = HEADS
    n_kv_heads: int = KV_HEADS


_FROM_HF = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.wv.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_TO_HF = {v: k for k, v in _FROM_HF.items()}


def _to_hf_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """torchtitan's rotary row order to transformers' (the conversion scripts' permute)."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols).clone()


def _from_hf_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols).clone()


class TitanLlamaAdapter(StateDictAdapter):  # type: ignore[misc]
    """``to_hf``/``from_hf`` between :class:`TitanLlama` and ``LlamaForCausalLM``."""

    def __init__(self, model_config: Any = None, hf_assets_path: str | None = None) -> None:
        super().__init__(model_config or ModelConfig(), hf_assets_path)

    @staticmethod
    def _abstract(key: str) -> tuple[str, str | None]:
        match = re.search(r"\d+", key)
        if match is None:
            return key, None
        return re.sub(r"\d+", "{}", key, count=1), match.group(0)

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in state_dict.items():
            abstract, layer = self._abstract(key)
            if abstract == "layers.{}.attention.wq.weight":
                value = _to_hf_rows(value, self.model_config.n_heads)
            elif abstract == "layers.{}.attention.wk.weight":
                value = _to_hf_rows(value, self.model_config.n_kv_heads)
            out[_TO_HF[abstract].format(layer)] = value
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in hf_state_dict.items():
            abstract, layer = self._abstract(key)
            if abstract == "model.layers.{}.self_attn.q_proj.weight":
                value = _from_hf_rows(value, self.model_config.n_heads)
            elif abstract == "model.layers.{}.self_attn.k_proj.weight":
                value = _from_hf_rows(value, self.model_config.n_kv_heads)
            out[_FROM_HF[abstract].format(layer)] = value
        return out
