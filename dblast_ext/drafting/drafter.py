"""The block-diffusion drafter: DFlash's architecture plus DBLast's K-branch head.

State-dict names follow the public DFlash checkpoints (docs/design.md): `fc`, `hidden_norm`,
`layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q_norm,k_norm},
post_attention_layernorm, mlp.{gate,up,down}_proj}`, `norm`; DBLast adds `branch_expander`
(Linear H -> K*H) and `prior_head` (Linear H -> K). Embedding and LM head are the target's.

Attention: queries come from the block only; keys/values are the drafter's projections of
the context features (every token before the block, cached across cycles) followed by the
block's own; absolute RoPE positions. Full-attention layers have no mask; DFlash's
sliding-attention layers are causal within the block and see keys less than `sliding_window`
positions away (`is_causal` overrides the causal part for every layer). The context features
enter every layer's k/v projections directly (after `fc` and `hidden_norm`), not through the
layer norms. The block embeddings are the target's, times `input_embedding_scale`.
"""
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch
from torch import nn

from .. import ops, reference
from .dflash2 import CandidateSelector, GroupedDynamicConv


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    block_size: int
    num_target_layers: int
    target_layer_ids: List[int]
    mask_token_id: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    attention_bias: bool = False
    layer_types: Optional[List[str]] = None  # "full_attention" / "sliding_attention" per layer
    sliding_window: Optional[int] = None  # in force (DFlash: only with use_sliding_window)
    is_causal: Optional[bool] = None  # every layer causal (True) or not (False); None: sliding layers only
    input_embedding_scale: float = 1.0  # block embeddings = target embeddings x this
    num_branches: int = 1
    # DFlash2 (dblast_ext.drafting.dflash2): convolutions around every sublayer, the candidate selector, and
    # the draft logits' multiplier and soft-cap; None / 1.0: a DFlash (or DBLast) drafter
    conv_kernel_size: Optional[int] = None
    conv_group_size: Optional[int] = None
    selector_rank: Optional[int] = None
    selector_top_k: Optional[int] = None
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None
    extra: dict = field(default_factory=dict)  # other config.json fields, written back unchanged

    @property
    def is_dflash2(self) -> bool:
        return self.conv_kernel_size is not None or self.selector_rank is not None

    @property
    def family(self) -> str:
        """Which drafter this is: "dflash2" (convolutions, candidate selector), "dblast" (K > 1
        branches) or "dflash" (neither); docs/design.md, the drafter family."""
        return "dflash2" if self.is_dflash2 else "dblast" if self.num_branches > 1 else "dflash"

    def sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def window(self, layer: int) -> int:
        """The layer's sliding window (keys less than this many positions away), -1 for none (a
        sliding layer without a window is causal only, as in DFlash)."""
        return int(self.sliding_window) if self.sliding(layer) and self.sliding_window is not None else -1

    def causal(self, layer: int) -> bool:
        """Whether the layer's block queries see only block keys at or before them (DFlash: its
        sliding layers, unless `is_causal` says otherwise for every layer)."""
        return self.sliding(layer) if self.is_causal is None else bool(self.is_causal)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary_tables(positions: torch.Tensor, dim: int, theta: float):
    """cos and sin [N, 1, T, D] of the rotary embedding at positions [N, T]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    angles = positions.float()[:, None, :, None] * inv_freq  # [N, 1, T, D/2]
    return torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)


def apply_rope(x: torch.Tensor, tables) -> torch.Tensor:
    """Rotary embedding (rotate-half convention) of x [N, heads, T, D] with rotary_tables."""
    cos, sin = tables
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x [N, heads, T, D] at positions [N, T]."""
    return apply_rope(x, rotary_tables(positions, x.shape[-1], theta))


class DrafterAttention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)

    def project_keys_values(self, x: torch.Tensor, tables):
        """Rotated keys and values [N, Hkv, T, D] of hidden states x [N, T, H]."""
        n, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(n, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(n, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, tables), v

    def project_queries(self, x: torch.Tensor, tables) -> torch.Tensor:
        n, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(n, t, self.heads, self.head_dim)).transpose(1, 2)
        return apply_rope(q, tables)


class DrafterMLP(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DrafterAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = DrafterMLP(c)
        if c.conv_kernel_size is not None:  # DFlash2: a convolution pair around each sublayer
            self.attention_conv = GroupedDynamicConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)
            self.mlp_conv = GroupedDynamicConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)

    def forward(self, h: torch.Tensor, block_rope, attend: Callable, block: Optional[int] = None) -> torch.Tensor:
        """One layer over the block hidden states h [N, T, H] (inference: one block; training:
        many blocks side by side, each `block` long). `attend(q, k_block, v_block)` -> [N, Hq, T, D]
        is where the two differ: the inference pass attends to its cache through the attention
        op, training to every block's context through a dense mask."""
        attn = self.self_attn
        convolved = hasattr(self, "attention_conv")
        x = self.input_layernorm(h)
        if convolved:
            taps = self.attention_conv.taps(x)
            x = self.attention_conv.apply(x, taps, 0, block)
        q = attn.project_queries(x, block_rope)
        k_blk, v_blk = attn.project_keys_values(x, block_rope)
        out = attn.o_proj(attend(q, k_blk, v_blk).transpose(1, 2).reshape(h.shape[0], h.shape[1], -1))
        h = h + (self.attention_conv.apply(out, taps, 1, block) if convolved else out)
        x = self.post_attention_layernorm(h)
        if not convolved:
            return h + self.mlp(x)
        taps = self.mlp_conv.taps(x)
        return h + self.mlp_conv.apply(self.mlp(self.mlp_conv.apply(x, taps, 0, block)), taps, 1, block)


class DrafterCache:
    """The drafter's own context K/V per layer: [N, Hkv, capacity, D]; row r's first
    `lengths[r]` entries are valid (rows of a batch commit different numbers of tokens)."""

    def __init__(self, config: DrafterConfig, rows: int, capacity: int, device, dtype):
        shape = (rows, config.num_key_value_heads, capacity, config.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.lengths = torch.zeros(rows, dtype=torch.int64, device=device)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def length(self) -> int:
        """The longest row's cached tokens (reads the device: not for the decode loop)."""
        return int(self.lengths.max()) if self.lengths.numel() else 0

    def crop(self, length: int) -> None:
        """Forget cached context beyond `length` tokens (a rejected suffix)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length must lie in [0, {self.length}], got {length}")
        self.lengths.clamp_(max=length)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keeps only the given rows (int64 indices, in order): finished prompts drop out."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.lengths = self.lengths.index_select(0, rows)


class DBlastDrafter(nn.Module):
    """DFlash drafter with an optional K-branch head (K = 1 without it is plain DFlash)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        if config.num_branches > 1:
            self.branch_expander = nn.Linear(h, config.num_branches * h)
            self.prior_head = nn.Linear(h, config.num_branches)
        if config.selector_rank is not None:
            self.candidate_selector = CandidateSelector(h, config.vocab_size, config.selector_rank,
                                                        config.selector_top_k)

    @property
    def num_branches(self) -> int:
        return self.config.num_branches

    def scale_embeddings(self, block_embeddings: torch.Tensor) -> torch.Tensor:
        """The target's embeddings of the block tokens as the drafter reads them (DFlash's
        `input_embedding_scale`)."""
        scale = self.config.input_embedding_scale
        return block_embeddings if scale == 1.0 else block_embeddings * scale

    def forward(self, block_embeddings: torch.Tensor, context_features: torch.Tensor, cache: DrafterCache,
                use_kernels: bool = True, context_lens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One drafting pass. Appends the new context (`context_features` [N, T, L*H], the
        target features of tokens not yet cached; `context_lens` [N]: how many of the T are
        row r's, None for all) to `cache`, then runs the block (`block_embeddings` [N, B, H]:
        anchor + masks, embedded by the target) at the positions right after each row's
        context. Returns the final-normed block hidden states [N, B, H].
        With `context_lens` nothing reads the device (the decode loop's path): the caller sizes
        the cache for its longest row plus T; without, the capacity is checked here."""
        c = self.config
        if use_kernels and torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
            raise RuntimeError("the kernel path is inference-only: run the drafter under torch.inference_mode() "
                               "or torch.no_grad(), or pass use_kernels=False to train through the reference ops")
        rows, new, block = context_features.shape[0], context_features.shape[1], block_embeddings.shape[1]
        device = block_embeddings.device
        if context_lens is None:
            if cache.length + new > cache.capacity:
                raise ValueError(f"drafter cache holds {cache.capacity} tokens; {cache.length + new} needed")
            counts = torch.full((rows,), new, dtype=torch.int64, device=device)
        else:
            counts = context_lens.to(device=device, dtype=torch.int64)
        start = cache.lengths                                          # [N]
        lens = start + counts
        dtype = self.fc.weight.dtype  # the target may run in another precision
        block_embeddings = self.scale_embeddings(block_embeddings.to(dtype))
        context = self.hidden_norm(self.fc(context_features.to(dtype)))
        ctx_pos = start[:, None] + torch.arange(new, device=device)   # [N, T] (rows past counts: unused)
        blk_pos = lens[:, None] + torch.arange(block, device=device)  # [N, B]
        slots = ctx_pos[:, None, :, None].expand(rows, c.num_key_value_heads, new, c.head_dim)
        # rotary tables once per pass, shared by every layer
        ctx_rope = rotary_tables(ctx_pos, c.head_dim, c.rope_theta)
        blk_rope = rotary_tables(blk_pos, c.head_dim, c.rope_theta)
        attention = ops.drafter_attention if use_kernels else reference.drafter_attention
        attention_lens = lens.to(torch.int32)
        h = block_embeddings
        for i, layer in enumerate(self.layers):
            if new:
                k_ctx, v_ctx = layer.self_attn.project_keys_values(context, ctx_rope)
                cache.keys[i].scatter_(2, slots, k_ctx.to(cache.keys[i].dtype))
                cache.values[i].scatter_(2, slots, v_ctx.to(cache.values[i].dtype))

            def attend(q, k_blk, v_blk, i=i):
                return attention(q, cache.keys[i], cache.values[i], k_blk, v_blk, attention_lens, window=c.window(i),
                                 causal=c.causal(i))

            h = layer(h, blk_rope, attend)
        cache.lengths = lens
        return self.norm(h)

    def branch_prior(self, anchor_hidden: torch.Tensor, category_temperature: float = 1.0) -> torch.Tensor:
        """Tempered category distribution [N, K] from the anchor position's normed state;
        temperature 0 puts all mass on the argmax branch. K = 1: ones."""
        rows = anchor_hidden.shape[0]
        if self.num_branches == 1:
            return torch.ones(rows, 1, device=anchor_hidden.device)
        logits = self.prior_head(anchor_hidden).float()
        if category_temperature == 0:
            return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return torch.softmax(logits / category_temperature, dim=-1)

    @torch.no_grad()
    def branch_tokens(self, block_hidden: torch.Tensor, lm_head_weight: torch.Tensor, vocab_size: int,
                      use_kernels: bool = True) -> torch.Tensor:
        """Greedy token of every branch at every draft position: [N, K, b] (block positions 1..B-1)."""
        drafts, expander = self._head_inputs(block_hidden, lm_head_weight.dtype)  # the op takes one dtype
        argmax = ops.branch_argmax if use_kernels else reference.branch_argmax
        result = argmax(drafts, lm_head_weight, *expander, vocab_size=vocab_size)
        return self._per_branch(result.tokens, block_hidden)

    def ranked_branch_tokens(self, block_hidden: torch.Tensor, lm_head_weight: torch.Tensor, vocab_size: int,
                             m: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Every branch's m likeliest rows of the head (of its first `vocab_size`) at every draft
        position, likeliest first, and their probabilities (softmax over those rows):
        ([N, K, b, m] int64, [N, K, b, m] float32)."""
        head = lm_head_weight[:vocab_size]
        # h_z = h + W_z h + b_z as dblast::branch_argmax expands it (float32), then the head in its own dtype
        drafts, expander = self._head_inputs(block_hidden, head.dtype, torch.promote_types(head.dtype, torch.float32))
        states = reference.branch_states(drafts, *expander).to(head.dtype)      # [N * b, K, H]
        logits = (states @ head.T).float()                                       # [N * b, K, V']
        probs, tokens = torch.softmax(logits, dim=-1).topk(min(m, head.shape[0]), dim=-1)
        return self._per_branch(tokens, block_hidden), self._per_branch(probs, block_hidden)

    def _head_inputs(self, block_hidden: torch.Tensor, dtype: torch.dtype,
                     expander_dtype: Optional[torch.dtype] = None):
        """The draft rows [N * b, H] (block positions 1..B-1) in the head's dtype, and the branch
        expander (None, None at K = 1) rounded to that dtype, then held in `expander_dtype` (default:
        the same): what the fused expander + LM head takes."""
        rows, block, width = block_hidden.shape
        drafts = block_hidden[:, 1:].reshape(rows * (block - 1), width).to(dtype)
        if self.num_branches == 1:
            return drafts, (None, None)
        return drafts, self._expander_as(dtype, expander_dtype or dtype)

    def _expander_as(self, dtype: torch.dtype, held: torch.dtype):
        """(W_z, b_z) rounded to `dtype` and held in `held`. Converting the [K * H, H] weight every
        cycle cost about 1 ms on a CPU (2% of a trie cycle), so outside autograd the converted pair
        is kept while the parameters keep their storage and version (an optimizer step or a load
        makes it anew)."""
        weight, bias = self.branch_expander.weight, self.branch_expander.bias
        convert = lambda t: t.detach().to(dtype).to(held)  # noqa: E731
        if torch.is_grad_enabled() and weight.requires_grad:
            return weight.to(dtype).to(held), bias.to(dtype).to(held)
        if torch.compiler.is_compiling():  # a traced cycle converts once per graph, and cannot compare pointers
            return convert(weight), convert(bias)
        try:
            key = (weight.data_ptr(), weight._version, bias.data_ptr(), bias._version, weight.device, dtype, held)
        except RuntimeError:  # inference tensors have no version counter: nothing tells a change, so no keeping
            return convert(weight), convert(bias)
        kept = getattr(self, "_expander_kept", None)
        if kept is None or kept[0] != key:
            kept = self._expander_kept = (key, (convert(weight), convert(bias)))
        return kept[1]

    def _per_branch(self, per_row: torch.Tensor, block_hidden: torch.Tensor) -> torch.Tensor:
        """[N * b, K, ...] (row-major over the draft rows) -> [N, K, b, ...]."""
        rows, block = block_hidden.shape[:2]
        shaped = per_row.reshape(rows, block - 1, self.num_branches, *per_row.shape[2:])
        return shaped.transpose(1, 2).contiguous()

    @torch.no_grad()
    def add_dflash2(self, conv_kernel_size: int, conv_group_size: int, selector_rank: int, selector_top_k: int,
                    generator: Optional[torch.Generator] = None) -> None:
        """Makes a K = 1 (DFlash) drafter a DFlash2 one that drafts what it drafted: convolutions
        around every sublayer as the identity, and a candidate selector whose pair term is zero
        (successor codebook 0) but not stuck there (the predecessor codebook and the projection
        random, so the successor codebook's gradient is not zero). Draft logits unscaled."""
        if self.config.is_dflash2:
            raise ValueError("the drafter is a DFlash2 drafter already")
        if self.num_branches != 1:
            raise ValueError(f"DFlash2 parts go on a K = 1 (DFlash) drafter, this one has {self.num_branches} branches")
        c, ref = self.config, self.fc.weight
        for layer in self.layers:
            for name in ("attention_conv", "mlp_conv"):
                conv = GroupedDynamicConv(c.hidden_size, conv_kernel_size, conv_group_size).to(ref.device, ref.dtype)
                conv.make_identity()
                setattr(layer, name, conv)
        selector = CandidateSelector(c.hidden_size, c.vocab_size, selector_rank, selector_top_k).to(ref.device,
                                                                                                    ref.dtype)
        g = generator if generator is not None else torch.Generator().manual_seed(0)
        selector.hidden_projection.weight.copy_(torch.randn(selector_rank, c.hidden_size, generator=g)
                                                / c.hidden_size**0.5)
        selector.predecessor_codebook.copy_(torch.randn(c.vocab_size, selector_rank, generator=g) / selector_rank**0.5)
        self.candidate_selector = selector
        c.conv_kernel_size, c.conv_group_size = conv_kernel_size, conv_group_size
        c.selector_rank, c.selector_top_k = selector_rank, selector_top_k

    @torch.no_grad()
    def add_branch_head(self, num_branches: int, generator: Optional[torch.Generator] = None,
                        spread: float = 1e-3) -> None:
        """Adds a K-branch head to a K = 1 (DFlash) drafter. Branches start near the DFlash
        drafter (h_z = h + small W_z h) but differ from one another: identical branches
        would get identical gradients forever."""
        if self.num_branches != 1:
            raise ValueError(f"the drafter already has {self.num_branches} branches")
        if self.config.is_dflash2:
            raise ValueError("a DFlash2 drafter drafts one chain through its candidate selector: DBLast branches "
                             "are not supported on it")
        if num_branches < 2:
            raise ValueError(f"num_branches must be >= 2 to add a branch head, got {num_branches}")
        h = self.config.hidden_size
        ref = self.fc.weight
        self.config.num_branches = num_branches
        self.branch_expander = nn.Linear(h, num_branches * h).to(ref.device, ref.dtype)
        self.prior_head = nn.Linear(h, num_branches).to(ref.device, ref.dtype)
        g = generator if generator is not None else torch.Generator().manual_seed(0)
        self.branch_expander.weight.copy_(torch.randn(num_branches * h, h, generator=g) * spread / h**0.5)
        self.branch_expander.bias.zero_()
        self.prior_head.weight.copy_(torch.randn(num_branches, h, generator=g) * spread / h**0.5)
        self.prior_head.bias.zero_()
