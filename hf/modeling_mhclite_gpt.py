"""Our GPT as a transformers causal LM: the nanoGPT blocks of model.py, every sublayer wrapped by
its connection from residuals.py (res, hc, mhc, mhclite, kromhc or ihc), the same parameter names, so a
checkpoint's state dict loads as it is. Logits of every position; a KV cache for generate()
(attention only: the connections act per token). Positions are absolute: past block_size tokens
generate() crops the context and recomputes it, as sample.py does."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .authors import arithmetic, connection_class
from .configuration_mhclite_gpt import MHCLiteGPTConfig
from .residuals import at_least_fp32, expand_streams, reduce_streams

STREAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def connection_options(config):
    """The constructor arguments of the connection modules, as model.build_connection gives them:
    the variant's, and the authors' arithmetic where the run used it."""
    options = {}
    if config.residual == "mhc":
        options = dict(sinkhorn_iters=config.sinkhorn_iters, mhc_eps=config.mhc_eps)
    if config.residual == "mhclite":
        options = dict(num_perms=config.mhclite_perms, perm_sampling=config.mhclite_perm_sampling,
                       perm_seed=config.perm_seed)
    return {**options, **arithmetic(config)}


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_index):
        super().__init__()
        self.n_head, self.n_embd, self.layer_index = config.n_head, config.n_embd, layer_index
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x, cache=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        past = 0 if cache is None else cache.get_seq_length(self.layer_index)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_index)
        if past == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # query i (absolute position past + i) sees keys 0..past + i
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config, layer_index):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer_index)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)
        connection = connection_class(config)
        n_streams = 1 if config.residual == "res" else config.n_streams
        options = connection_options(config)
        # transformers builds the model on the meta device before loading; mhclite and kromhc build
        # their permutation sets with real tensors at construction, so the connections are built on the CPU
        with torch.device("cpu"):
            self.attn_connection = connection(config.n_embd, n_streams, 2 * layer_index, **options)
            self.mlp_connection = connection(config.n_embd, n_streams, 2 * layer_index + 1, **options)

    def forward(self, x, cache=None):
        x = self.attn_connection(x, lambda h: self.attn(self.ln_1(h), cache))
        return self.mlp_connection(x, lambda h: self.mlp(self.ln_2(h)))


class MHCLiteGPTForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MHCLiteGPTConfig
    base_model_prefix = "transformer"
    main_input_name = "input_ids"
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}
    _no_split_modules = ["Block"]

    def __init__(self, config):
        super().__init__(config)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight
        self.post_init()

    def _init_weights(self, module):
        """Nothing to draw: an export is always loaded with all its weights."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        model = super().from_pretrained(*args, **kwargs)
        model.rebuild_permutation_matrices()
        return model

    @torch.no_grad()
    def rebuild_permutation_matrices(self):
        """mhclite's 0/1 matrices from its saved permutation set (the `perms` buffers), kromhc's from n:
        they are not saved themselves, and transformers loads weights without the module's load hooks
        and leaves the buffers it does not load unset."""
        for block in self.transformer.h:
            for connection in (block.attn_connection, block.mlp_connection):
                if hasattr(connection, "rebuild_permutation_matrices"):
                    connection.rebuild_permutation_matrices()

    def get_input_embeddings(self):
        return self.transformer.wte

    def set_input_embeddings(self, value):
        self.transformer.wte = value

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=None, labels=None,
                return_dict=None, **kwargs):
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("padded batches are not supported (positions are absolute); pass sequences without "
                             "padding, or pad on the right where the padded positions are never read")
        use_cache = past_key_values is not None if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        start = past_key_values.get_seq_length() if use_cache else 0
        T = input_ids.size(1)
        if start + T > self.config.block_size:
            raise ValueError(f"sequence length {start + T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(start, start + T, dtype=torch.long, device=input_ids.device)
        x = self.transformer.wte(input_ids) + self.transformer.wpe(pos)
        n_streams = 1 if self.config.residual == "res" else self.config.n_streams
        x = expand_streams(x, n_streams)
        if self.config.residual != "res" and x.dtype != torch.float64:
            x = x.to(STREAM_DTYPES[self.config.stream_dtype])
        for block in self.transformer.h:
            x = block(x, past_key_values if use_cache else None)
        if self.config.final_norm == "per_stream":
            x = self.transformer.ln_f(at_least_fp32(x)).sum(dim=-2)
        else:
            x = self.transformer.ln_f(reduce_streams(x))
        logits = self.lm_head(x)
        loss = None
        if labels is not None:  # transformers' convention: labels are the inputs, shifted here
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=past_key_values if use_cache else None)

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, use_cache=True,
                                      **kwargs):
        """The tokens the next forward needs: the new ones on the cache, or, once the sequence is
        longer than block_size, the cropped context recomputed on a fresh cache (every position
        moved)."""
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("padded batches are not supported (positions are absolute); generate one prompt "
                             "at a time or prompts of one length")
        block_size = self.config.block_size
        if not use_cache:
            return dict(input_ids=input_ids[:, -block_size:], use_cache=False)
        if past_key_values is None or input_ids.size(1) > block_size:
            past_key_values = DynamicCache()
            input_ids = input_ids[:, -block_size:]
        else:
            input_ids = input_ids[:, past_key_values.get_seq_length():]
        return dict(input_ids=input_ids, past_key_values=past_key_values, use_cache=True)
