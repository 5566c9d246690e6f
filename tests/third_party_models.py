"""Models from outside transformers and litgpt, tiny, in LightningModules whose steps call ``self.model(x)``.

* x-transformers' ``TransformerWrapper`` + ``Decoder`` (lucidrains/x-transformers, pip ``x-transformers``):
  its rotary helpers run under ``torch.autocast(t.device.type, enabled=False)``; its blocks are a
  ``ModuleList`` of attention and feed-forward layers, each a ``ModuleList`` of (norm, layer, residual).
* :class:`MinGPT`: written after the layout of Karpathy's minGPT (``mingpt/model.py``): the embeddings,
  blocks and final norm in a ``ModuleDict`` named ``transformer``, a ``bias`` buffer holding the causal
  mask, each block's MLP run through a ``lambda`` kept as an attribute, ``forward(idx, targets)``
  returning ``(logits, loss)`` with ``ignore_index=-1``.
* :class:`TitanLlama`: written after the layout of torchtitan's Llama 3 (``torchtitan/models/llama3/
  model/model.py``): blocks in a ``ModuleDict`` keyed "0", "1", ... (so a pipeline split can delete
  layers), rotary embeddings as a complex ``freqs_cis`` buffer (``torch.polar``, ``view_as_complex``)
  passed to every block, grouped-query attention with ``repeat_kv``, a SwiGLU feed-forward, RMSNorm.
* :class:`ViT`: a vision transformer written the common way (timm's layout): a convolutional patch
  embedding, a class token and learned positions, pre-norm blocks in a ``ModuleList``, a final norm and a
  linear head on the pooled class token.

Dropout is off everywhere: the one-device comparison needs the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

VOCAB = 64


class LM(L.LightningModule):
    """A decoder trained on next-token prediction; the steps call ``self.model(x)``."""

    def __init__(
        self, model: nn.Module, lr: float = 1e-3, returns_pair: bool = False, sgd: bool = False
    ) -> None:
        super().__init__()
        self.model, self.lr, self.returns_pair, self.sgd = model, lr, returns_pair, sgd

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.returns_pair:  # minGPT: logits, loss = model(idx, targets)
            _, loss = self.model(x, y)
        else:
            loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.sgd:
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class ImageClassifier(L.LightningModule):
    def __init__(self, model: nn.Module, lr: float = 0.1) -> None:
        super().__init__()
        self.model, self.lr = model, lr

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self.model(images), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        # SGD: the fused qkv projection has a key bias, whose gradient is exactly zero (see MinGPT's).
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def x_transformers_decoder() -> nn.Module:
    from x_transformers import Decoder, TransformerWrapper

    return TransformerWrapper(
        num_tokens=VOCAB, max_seq_len=32, attn_layers=Decoder(dim=32, depth=2, heads=4, rotary_pos_emb=True)
    )


# --- minGPT's layout ---------------------------------------------------------------------------------


class NewGELU(nn.Module):
    """The tanh approximation of GELU, as minGPT (and GPT-2's code) writes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class MinGPTAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.register_buffer(
            "bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)
        )
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MinGPTBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = MinGPTAttention(n_embd, n_head, block_size)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.ModuleDict(
            dict(c_fc=nn.Linear(n_embd, 4 * n_embd), c_proj=nn.Linear(4 * n_embd, n_embd), act=NewGELU())
        )
        m = self.mlp
        self.mlpf = lambda x: m.c_proj(m.act(m.c_fc(x)))  # MLP forward, as minGPT keeps it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlpf(self.ln_2(x))


class MinGPT(nn.Module):
    def __init__(self, n_layer: int = 4, n_head: int = 4, n_embd: int = 32, block_size: int = 32) -> None:
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(VOCAB, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                h=nn.ModuleList([MinGPTBlock(n_embd, n_head, block_size) for _ in range(n_layer)]),
                ln_f=nn.LayerNorm(n_embd),
            )
        )
        self.lm_head = nn.Linear(n_embd, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        _, t = idx.size()
        assert t <= self.block_size, (
            f"Cannot forward sequence of length {t}, block size is only {self.block_size}"
        )
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device).unsqueeze(0)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


# --- torchtitan's Llama 3 layout ---------------------------------------------------------------------


@dataclass
class TitanArgs:
    dim: int = 32
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = VOCAB
    multiple_of: int = 16
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 32


def precompute_freqs_cis(dim: int, end: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    ndim, seqlen = x.ndim, x.shape[1]
    freqs_cis = freqs_cis[0:seqlen]
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        torch.unsqueeze(x, dim=3)
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class TitanAttention(nn.Module):
    def __init__(self, args: TitanArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.n_rep, self.head_dim = self.n_heads // self.n_kv_heads, args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        return self.wo(output.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class TitanFeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int) -> None:
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    def __init__(self, args: TitanArgs) -> None:
        super().__init__()
        self.attention = TitanAttention(args)
        self.feed_forward = TitanFeedForward(args.dim, 4 * args.dim, args.multiple_of)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    def __init__(self, args: TitanArgs | None = None) -> None:
        super().__init__()
        self.args = args = args or TitanArgs()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        freqs = precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len * 2, args.rope_theta)
        self.register_buffer("freqs_cis", freqs, persistent=False)
        self.layers = nn.ModuleDict({str(i): TitanBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # (torchtitan checks each part for None: a pipeline stage deletes the parts it does not hold)
        h = self.tok_embeddings(tokens) if self.tok_embeddings else tokens
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        h = self.norm(h) if self.norm else h
        return self.output(h) if self.output else h


# --- a vision transformer ----------------------------------------------------------------------------


class PatchEmbed(nn.Module):
    def __init__(self, patch: int, channels: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(channels, dim, kernel_size=patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, patches, dim)


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj, self.heads = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def attn(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, image: int = 16, patch: int = 4, channels: int = 3, dim: int = 32, depth: int = 4,
                 heads: int = 4, classes: int = 10) -> None:  # fmt: skip
        super().__init__()
        self.patch_embed = PatchEmbed(patch, channels, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])  # pooled: the class token


def token_data(n: int = 16, t: int = 12, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, VOCAB, (n, t + 1), generator=g)
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def image_data(n: int = 16, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g))


def third_party_model(name: str) -> L.LightningModule:
    """The LightningModule of one of this file's models, built from seed 0."""
    torch.manual_seed(0)
    if name == "x-transformers":
        return LM(x_transformers_decoder())
    if name == "mingpt":
        # SGD: minGPT's fused c_attn has a key bias, whose gradient is exactly zero (softmax ignores it);
        # AdamW would turn its rounding noise into lr-sized updates that differ between any two runs.
        return LM(MinGPT(), lr=0.1, returns_pair=True, sgd=True)
    if name == "torchtitan-llama":
        return LM(TitanLlama())
    if name == "vit":
        return ImageClassifier(ViT())
    raise ValueError(name)
