"""GPT (nanoGPT) whose residual connections are switchable: res, hc, mhc, mhclite, kromhc or ihc.

The residual state is (B, T, n, C): the embedding is copied into n streams, every attention and
every MLP sublayer is wrapped by its own connection from residuals.py (2L wrappers), and the
streams are summed before the final LayerNorm and the tied LM head. With residual="res" (n = 1)
this is exactly nanoGPT. The keys of authors.SETTINGS default to the paper as written; the other
value of each is what the authors' code computes (configs/authors.py, docs/faithfulness.md).
"""

import math
import re
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

import authors
from residuals import PERM_SAMPLINGS, RESIDUALS, RMS_EPS, at_least_fp32, expand_streams, reduce_streams

# ----------------------------------------------------------------------------------------------
# Settings that describe and check themselves


def setting(default, help, group="model", choices=None, valid=None, requirement=None, pattern=None):
    """A dataclass field that describes itself: `help`, the one line --help prints; `group`, the
    heading it is listed under; its check, `choices` (or a `pattern` they name) or a predicate
    `valid` with its `requirement` as the error states it."""
    return field(default=default, metadata=dict(help=help, group=group, choices=choices, valid=valid,
                                                requirement=requirement, pattern=pattern))


def check_settings(settings):
    """Check every field of a dataclass built with setting() against its own check; the first bad
    value is one ValueError line. Unset optional settings (None) are not checked."""
    for f in fields(settings):
        value, meta = getattr(settings, f.name), f.metadata
        if value is None or not meta:
            continue
        if meta["pattern"] is not None and not re.fullmatch(meta["pattern"], value) or (
                meta["pattern"] is None and meta["choices"] is not None and value not in meta["choices"]):
            raise ValueError(f"unknown {f.name} '{value}'; valid: {', '.join(meta['choices'])}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name} must be a finite number, got {value}")
        if meta["valid"] is not None and not meta["valid"](value):
            raise ValueError(f"{f.name} must be {meta['requirement']}, got {value}")


def at_least(bound, note=""):
    return dict(valid=lambda v: v >= bound, requirement=f">= {bound}{note}")


def in_unit_interval():
    return dict(valid=lambda v: 0 <= v < 1, requirement="in [0, 1)")


# ----------------------------------------------------------------------------------------------
# Sizes


@dataclass(frozen=True)
class Size:
    """A model size: its shape, its peak learning rate and the cosine's end (min_lr)."""
    n_layer: int
    n_head: int
    n_embd: int
    learning_rate: float
    min_lr: float

    def shape(self) -> dict:
        return dict(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd)


SIZES = {
    # ours: the CPU demo and test model; 3e-3 trains it better than the paper's rule (docs/results.md)
    "tiny": Size(n_layer=4, n_head=4, n_embd=128, learning_rate=3e-3, min_lr=3e-4),
    # the paper's (Appendix A): GPT-2 small, medium and large
    "S": Size(n_layer=6, n_head=8, n_embd=512, learning_rate=1e-3, min_lr=1e-4),
    "M": Size(n_layer=12, n_head=12, n_embd=768, learning_rate=6e-4, min_lr=6e-5),
    "L": Size(n_layer=24, n_head=16, n_embd=1024, learning_rate=3e-4, min_lr=3e-5),
    # ours past the paper: GPT-2 XL's shape and GPT-3 6.7B's (sharded on 8 x 80 GB), with the paper's
    # rule for the rates: GPT-3's for the nearest of its sizes, min lr / 10
    "XL": Size(n_layer=48, n_head=25, n_embd=1600, learning_rate=2e-4, min_lr=2e-5),
    "7B": Size(n_layer=32, n_head=32, n_embd=4096, learning_rate=1.2e-4, min_lr=1.2e-5),
}
DEFAULT_SIZE = "M"


def model_shape(size: str) -> dict:
    if size not in SIZES:
        raise ValueError(f"unknown size '{size}'; valid: {', '.join(SIZES)}")
    return SIZES[size].shape()


# ----------------------------------------------------------------------------------------------
# The model's settings

STREAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Architecture:
    """What the model is: its residual connection and its shape (the Hugging Face export keeps these)."""
    residual: str = setting("res", "the residual connection", choices=tuple(RESIDUALS))
    n_streams: int = setting(4, "residual streams n of the HC family (res has 1; kromhc: prime factors <= 5)",
                             **at_least(1))
    mhclite_perms: int | None = setting(None, "mhclite: permutations K in H_res; None: all n! (n <= 5)",
                                        **at_least(1, " (or None: all n! permutations)"))
    mhclite_perm_sampling: str = setting("uniform", "mhclite: how K < n! permutations are drawn (cover: the n "
                                         "shifts first)", choices=PERM_SAMPLINGS)
    perm_seed: int = setting(0, "mhclite: seed of the permutation draw")
    sinkhorn_iters: int = setting(20, "mhc: Sinkhorn-Knopp iterations", **at_least(1))
    mhc_eps: float = setting(0.0, "mhc: DeepSeek-V4's epsilon (its hc_eps: 1e-6), added to h_pre and floored into "
                             "its Sinkhorn; 0: the paper's", **at_least(0))
    block_size: int = setting(1024, "context length in tokens", **at_least(1))
    n_layer: int | None = setting(None, "transformer blocks; None: the size's", **at_least(1))
    n_head: int | None = setting(None, "attention heads; None: the size's", **at_least(1))
    n_embd: int | None = setting(None, "width C; None: the size's", **at_least(1))
    bias: bool = setting(False, "biases in the Linear and LayerNorm layers")
    stream_dtype: str = setting("float32", "storage of the HC family's n streams", choices=tuple(STREAM_DTYPES))


@dataclass
class AuthorsSwitches:
    """The paper as written (the defaults) or as the authors' code ran it (authors.py sets out both
    values of each; configs/authors.py sets them all to the authors'). All but the two of
    authors.TRAINING_ONLY change what the model computes."""
    final_norm: str = setting("after_sum", "final LayerNorm after the stream sum, or on each stream, then the "
                              "sum", choices=authors.SETTINGS["final_norm"])
    rms_eps: float = setting(RMS_EPS, "inside the connections' RMS root; 0: F.normalize, the authors'",
                             **at_least(0, " (0: the authors' F.normalize)"))
    sinkhorn_order: str = setting("cols_then_rows", "mhc: rows exact, or columns (the authors')",
                                  choices=authors.SETTINGS["sinkhorn_order"])
    init_stream: str = setting("wrapper_mod_n", "the stream a wrapper reads at init; drawn (the authors'): "
                               "seeded with seed", choices=authors.SETTINGS["init_stream"])
    connection_weight_decay: str = setting("projections", "decayed connection parameters; authors: every >= 2-D "
                                           "one", choices=authors.SETTINGS["connection_weight_decay"])
    h_res_dtype: str = setting("float32", "mhclite: the permutations combined in fp32, or in bf16 under "
                               "autocast (the authors')", choices=authors.SETTINGS["h_res_dtype"])
    mixing_dtype: str = setting("float32", "u and h_res x in fp32, or with bf16 operands and result under "
                                "autocast (the authors')", choices=authors.SETTINGS["mixing_dtype"])


@dataclass
class ModelTraining:
    """The model's settings that act on training only (regularisation)."""
    dropout: float = setting(0.0, "dropout probability", **in_unit_interval())


@dataclass
class ModelSettings(ModelTraining, AuthorsSwitches, Architecture):
    """Every model setting, as a user sets it (train.py's "model" group), flat: a checkpoint saves
    them by name (model_args)."""



GPT2_PADDED_VOCAB = 50304  # GPT-2's 50257 tokens padded to a multiple of 64 (nanoGPT's)


@dataclass
class GPTConfig(ModelSettings):
    """Everything GPT(config) needs: the model settings, with the shape given (None: M's), the
    vocabulary and the seed of drawn init streams."""
    vocab_size: int = setting(GPT2_PADDED_VOCAB, "the tokenizer's vocabulary (GPT-2's, padded)", **at_least(1))
    init_stream_seed: int = setting(0, "seed of init_stream=drawn")

    def __post_init__(self):
        for key, value in model_shape(DEFAULT_SIZE).items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        if self.residual == "res":
            self.n_streams = 1
        check_settings(self)
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")


def connection_options(config: GPTConfig) -> dict:
    """The variant-specific constructor arguments of residuals.py's connection modules."""
    if config.residual == "mhc":
        if config.mhc_eps and {"sinkhorn_order", "mixing_dtype"} & authors.arithmetic(config).keys():
            raise ValueError("mhc_eps (DeepSeek-V4's arithmetic) does not combine with the authors' sinkhorn_order "
                             "or mixing_dtype")
        return dict(sinkhorn_iters=config.sinkhorn_iters, mhc_eps=config.mhc_eps)
    if config.residual == "mhclite":
        return dict(num_perms=config.mhclite_perms, perm_sampling=config.mhclite_perm_sampling,
                    perm_seed=config.perm_seed)
    return {}


def build_connection(config: GPTConfig, wrapper_index: int, stream_index: int | None = None):
    """The connection of wrapper `wrapper_index`: residuals.py's, or with the authors' arithmetic
    when config sets it (authors.py); stream_index (None: wrapper index mod n) is read at init."""
    options = dict(**connection_options(config), **authors.arithmetic(config))
    connection = authors.connection_class(config)(config.n_embd, config.n_streams, wrapper_index, **options)
    if stream_index is not None:
        connection.stream_index = stream_index
        connection.reset_parameters()
    return connection


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, kv_cache=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        past = 0 if kv_cache is None else kv_cache.length
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)
        if past:  # query i (absolute position past + i) sees keys 0..past + i
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                               is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """A pre-norm transformer block; each sublayer is wrapped by its own connection."""

    def __init__(self, config, layer_index, stream_indices=(None, None)):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)
        self.attn_connection = build_connection(config, 2 * layer_index, stream_indices[0])
        self.mlp_connection = build_connection(config, 2 * layer_index + 1, stream_indices[1])

    def attn_branch(self, x):
        return self.attn(self.ln_1(x))

    def mlp_branch(self, x):
        return self.mlp(self.ln_2(x))

    def forward(self, x, kv_cache=None):
        attn_branch = self.attn_branch if kv_cache is None else lambda h: self.attn(self.ln_1(h), kv_cache)
        x = self.attn_connection(x, attn_branch)
        x = self.mlp_connection(x, self.mlp_branch)
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        streams = authors.init_streams(config)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, i, streams[2 * i: 2 * i + 2]) for i in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

        with torch.no_grad():
            for target, init in self.init_steps():
                init(target)

    def init_steps(self):
        """The initialisation after construction, in the order it draws from torch's generator:
        GPT-2's normal init of every Linear and Embedding (the tied weight twice, as nanoGPT's
        apply does), its scaled init of the residual projections, then the paper's init of the
        connections, which draws nothing. (parameter, init) pairs, init(tensor) filling a whole
        tensor in place, then (connection, init) pairs, init(connection) resetting its parameters.
        parallelize.materialise runs the same steps on whole copies and keeps each rank's shard."""
        def normal(std):
            return lambda tensor: nn.init.normal_(tensor, mean=0.0, std=std)

        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                yield module.weight, normal(0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                yield module.bias, nn.init.zeros_
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of the residual projections
                yield p, normal(0.02 / math.sqrt(2 * self.config.n_layer))
        for connection in self.connections():
            yield connection, type(connection).reset_parameters

    def fresh_connections(self):
        """The 2L connections as this config builds them on the CPU, with their buffers
        (mhclite's permutations) and the paper's init; for a model built on the meta device."""
        streams = authors.init_streams(self.config)
        return [build_connection(self.config, i, stream) for i, stream in enumerate(streams)]

    def connections(self):
        return [m for block in self.transformer.h for m in (block.attn_connection, block.mlp_connection)]

    def forward(self, idx, targets=None, kv_cache=None):
        """(logits, loss); logits of every position with targets, else of the last one. With a
        KV cache (sample.KVCache), idx continues the tokens the cache holds and is appended to it
        (inference only)."""
        B, T = idx.size()
        start = 0 if kv_cache is None else len(kv_cache)
        if start + T > self.config.block_size:
            raise ValueError(f"sequence length {start + T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        x = expand_streams(x, self.config.n_streams)
        # res keeps nanoGPT's fp32 residual stream; a float64 model (numerical checks) keeps float64 streams
        if self.config.residual != "res" and x.dtype != torch.float64:
            x = x.to(STREAM_DTYPES[self.config.stream_dtype])
        for i, block in enumerate(self.transformer.h):
            x = block(x) if kv_cache is None else block(x, kv_cache.layers[i])
        return self.head(x, targets)

    def head(self, x, targets):
        """The streams summed, the final LayerNorm, the LM head and the loss: (logits, loss)."""
        if self.config.final_norm == "per_stream":  # the authors' code: LayerNorm of each stream, then the sum
            x = self.transformer.ln_f(at_least_fp32(x)).sum(dim=-2)
        else:
            x = self.transformer.ln_f(reduce_streams(x))
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    # ------------------------------------------------------------------------------------------

    def parameter_counts(self) -> dict:
        """total; non_embedding (nanoGPT's count: all but the position embedding; the token
        embedding is the tied LM head); connections (the HC-family parameters)."""
        total = sum(p.numel() for p in self.parameters())
        connections = sum(p.numel() for m in self.connections() for p in m.parameters())
        return dict(total=total, non_embedding=total - self.transformer.wpe.weight.numel(), connections=connections)

    def get_num_params(self, non_embedding=True) -> int:
        counts = self.parameter_counts()
        return counts["non_embedding"] if non_embedding else counts["total"]

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW that decays only the 2-D projection weights (Linear and Embedding weights,
        connection projections included); biases, scales, static HC matrices and norm gains
        are never decayed (nanoGPT's rule; docs/training.md). With connection_weight_decay="authors" the
        connections' decay follows authors.decayed(); rows of a tensor decayed in part (hc's W_a in
        its fused projection) get AdamW's decoupled decay from a step pre-hook, which is the same
        update as being in the decayed group, since AdamW decays before its Adam step."""
        decay_ids = {id(m.weight) for m in self.modules() if isinstance(m, (nn.Linear, nn.Embedding))}
        decayed_rows = []
        if self.config.connection_weight_decay == "authors":
            for connection in self.connections():
                decay_ids.discard(id(connection.proj.weight))
                for param, rows in authors.decayed(connection):
                    if rows is None:
                        decay_ids.add(id(param))
                    else:
                        decayed_rows.append((param, rows))
        params = list(dict.fromkeys(p for p in self.parameters() if p.requires_grad))
        decay = [p for p in params if id(p) in decay_ids]
        no_decay = [p for p in params if id(p) not in decay_ids]
        groups = [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]
        optimizer = torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")
        if decayed_rows:
            @torch.no_grad()
            def decay_rows(optimizer, args, kwargs):
                factor = 1 - optimizer.param_groups[0]["lr"] * weight_decay
                for param, rows in decayed_rows:
                    if param.grad is not None:  # AdamW skips a parameter without a gradient
                        # a parameter sharded by columns (FSDP, parallelize.py) holds every row of its shard
                        local = param.to_local() if hasattr(param, "to_local") else param
                        local[rows].mul_(factor)
            optimizer.register_step_pre_hook(decay_rows)
        return optimizer

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward = 3x forward): 6N for the weights
        (connection projections included), attention scores 12 L T C as in nanoGPT (not halved
        for causality), and the stream mixing of the 2L connections."""
        cfg = self.config
        attention = 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
        mixing = 3 * sum(m.mixing_flops_per_token() for m in self.connections())
        return 6 * self.get_num_params() + attention + mixing

    def estimate_mfu(self, tokens_per_iter: int, dt: float, peak_flops: float) -> float:
        """Model FLOPs utilisation: achieved training FLOP/s over the device's peak."""
        return self.flops_per_token() * tokens_per_iter / dt / peak_flops
