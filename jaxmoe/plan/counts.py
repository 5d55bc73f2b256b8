"""What a config's model holds and costs per token, counted from its shapes: total and
active parameters, and training FLOPs per token the three ways the measured runs jaxmoe
is set beside count them (PaLM's, Megatron's, MaxText's)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jaxmoe.config import Config


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int  # parameters touched by one token: top-k of the routed experts
    embedding: int  # input embedding table (a lookup, no matmul FLOPs)
    norm: int  # norm scales (elementwise, no matmul FLOPs)


def param_counts(c: Config) -> ParamCounts:
    """The model's total parameters and those one token uses (active: top-k of the
    routed experts, everything else whole), embedding and head included."""
    m, moe = c.model, c.moe
    d, hd = m.d_model, m.head_size
    layer_norms = 2 * d + {"none": 0, "head": 2 * hd, "full": (m.num_heads + m.num_kv_heads) * hd}[m.qk_norm]
    if m.attention == "mla":
        H, Rq, Rkv, Hv = m.num_heads, m.q_lora_rank, m.kv_lora_rank, m.v_head_dim
        layer_norms += Rq + Rkv  # the latents' norms
        q = (d * Rq + Rq * H * hd) if Rq else d * H * hd
        attn = (q + d * (Rkv + m.qk_rope_head_dim) + Rkv * H * (m.qk_nope_head_dim + Hv)
                + H * Hv * d + layer_norms)
    else:
        attn = d * hd * (2 * m.num_heads + 2 * m.num_kv_heads) + layer_norms  # q, k, v, o
    dense_mlp = 3 * d * m.mlp_hidden
    shared = 3 * d * moe.shared_expert_hidden
    expert = 3 * d * moe.expert_hidden
    router = d * moe.num_experts
    embed = m.vocab_size * d
    outer = 2 * embed + d  # embedding, LM head, final norm
    L_dense, L_moe = m.num_dense_layers, c.num_moe_layers
    total = outer + m.num_layers * attn + L_dense * dense_mlp
    total += L_moe * (router + shared + moe.num_experts * expert)
    active = total - L_moe * (moe.num_experts - moe.top_k) * expert
    # a multi-token prediction module: a layer like the last (MoE where the model has
    # MoE layers), its projection of [embedding; hidden] and three norms; embedding
    # and head are the model's
    ffn_total, ffn_active = ((router + shared + moe.num_experts * expert,
                              router + shared + moe.top_k * expert) if L_moe
                             else (dense_mlp, dense_mlp))
    total += m.mtp_layers * (attn + ffn_total + 2 * d * d + 3 * d)
    active += m.mtp_layers * (attn + ffn_active + 2 * d * d + 3 * d)
    return ParamCounts(total=total, active=active, embedding=embed,
                       norm=(m.num_layers + m.mtp_layers) * layer_norms + d + 3 * d * m.mtp_layers)


FLOP_COUNTS = ("palm", "megatron", "maxtext")


def flops_per_token(c: Config, count: str = "palm") -> float:
    """Training FLOPs per token: 6 x active matmul params + attention scores, counted
    one of three ways (the anchors' figures are each in their own):

    palm      PaLM's: attention adds 6 x layers x heads x (qk + v head dims) x seq_len
              (forward QK^T and AV, times three), without causal savings. Multi-token
              prediction modules count as layers, each also running the LM head.
    megatron  Megatron-LM's and Megatron-Bridge's (`num_floating_point_operations`):
              causal attention, half PaLM's; MTP modules as in palm; the router not
              counted.
    maxtext   MaxText's (`calculate_tflops_training_per_device`): causal attention; the
              router counted; no MTP module (its DeepSeek-V3 config runs none).
    """
    if count not in FLOP_COUNTS:
        raise ValueError(f"count: {count!r} is not one of {FLOP_COUNTS}")
    m = c.model
    if count == "maxtext" and m.mtp_layers:
        c = dataclasses.replace(c, model=dataclasses.replace(m, mtp_layers=0))
        m = c.model
    counts = param_counts(c)
    matmul_params = counts.active - counts.embedding - counts.norm
    matmul_params += m.mtp_layers * m.d_model * m.vocab_size  # the shared head, again
    if count == "megatron":  # no router; MLA's latent norms and MTP's three norms are in
        matmul_params -= (c.num_moe_layers + m.mtp_layers) * m.d_model * c.moe.num_experts \
            if c.num_moe_layers else 0
        if m.attention == "mla":
            matmul_params += (m.num_layers + m.mtp_layers) * (m.q_lora_rank + m.kv_lora_rank)
        matmul_params += m.mtp_layers * 3 * m.d_model
    layers = m.num_layers + m.mtp_layers
    attention = 6 * layers * m.num_heads * (m.head_size + m.value_size) * c.train.seq_len
    return 6.0 * matmul_params + (attention if count == "palm" else attention / 2)
