"""Our GPT against the authors' code (FFTYYY/mhc-lite at ea19775) with the same weights, as
docs/faithfulness.md's agreement tables report it: a tiny GPT (2 layers, width 32, 4 streams, vocabulary
64, batch 3 x 16) of each variant, our weights (moved off the init) mapped onto theirs. Prints (a) float64
with configs/authors.py: loss, logits, every gradient (ours in their layout); (b) float64 with the paper's
defaults, which differ; (c) float64 with every setting but one, the size of each setting's effect;
(d) the forward under CPU bf16 autocast against their code's one-ulp noise floor.

    git clone https://github.com/FFTYYY/mhc-lite && git -C mhc-lite checkout ea19775 && pip install einops
    python -m analysis.authors_agreement --authors_dir mhc-lite [--variants hc mhc mhclite] [--seed 0]
"""
import argparse
import contextlib
import copy
import functools
import importlib.util
import io
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
import torch
import torch.nn as nn

from analysis.common import authors_settings
from authors import SETTINGS
from model import GPT, GPTConfig

SHAPE = dict(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32)
N_STREAMS, BATCH = 4, 3
THEIR_TYPES = {"hc": "hc", "mhc": "mhc", "mhclite": "mhc_lite"}  # hyper_conn_type in their GPTConfig
SCALES = (0.5, 3.0)  # std of the connections' projections: x3 gives the wide logits training produces
# The settings that act on a float64 forward, and the variants each acts on; the others act under
# autocast (h_res_dtype, mixing_dtype: table (d)) or on training only (the init, the weight decay).
LEAVE_ONE_OUT = {"final_norm": ("hc", "mhc", "mhclite"), "rms_eps": ("hc", "mhc", "mhclite"),
                 "sinkhorn_order": ("mhc",)}
BF16_SCALES = (0.0, 0.5)  # projections zero or random, as docs/faithfulness.md's bf16 table
CHECKOUT = "git clone https://github.com/FFTYYY/mhc-lite && git -C mhc-lite checkout ea19775"


class AuthorsCodeMissing(Exception):
    """Their checkout or einops is missing; main prints it as one error line."""


@functools.cache
def load_authors(authors_dir):
    """(their model.py, loaded as `authors_model` since ours is `model`; their hyper_conn.mhc_lite)."""
    path = os.path.join(authors_dir, "model.py")
    if not (os.path.isfile(path) and os.path.isdir(os.path.join(authors_dir, "hyper_conn"))):
        raise AuthorsCodeMissing(f"no authors' code (model.py, hyper_conn/) in '{authors_dir}'; get it: {CHECKOUT}")
    if importlib.util.find_spec("einops") is None:
        raise AuthorsCodeMissing("the authors' code needs einops: pip install einops")
    # On sys.path only for this import: their model.py, train.py, sample.py would shadow ours later.
    sys.path.insert(0, os.path.abspath(authors_dir))
    try:
        lite = importlib.import_module("hyper_conn.mhc_lite")
    finally:
        sys.path.remove(os.path.abspath(authors_dir))
    spec = importlib.util.spec_from_file_location("authors_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its `from hyper_conn import ...` finds the package imported above
    return module, lite


def our_model(variant, settings, dtype, seed):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**SHAPE, n_streams=N_STREAMS, residual=variant, **settings)).to(dtype)


def their_model(authors_dir, variant, dtype, seed):
    their, lite = load_authors(authors_dir)
    random.seed(seed)  # their init stream is random.randrange (overwritten by the mapping anyway)
    with contextlib.redirect_stdout(io.StringIO()):  # they print the parameter count
        model = their.GPT(their.GPTConfig(**SHAPE, bias=False, dropout=0.0, hyper_conn_n=N_STREAMS,
                                          hyper_conn_type=THEIR_TYPES[variant]))
    # Their permutation matrices are a module-level cache, float32 unless we put them in our dtype.
    lite.perm_mats[(N_STREAMS, "cpu")] = lite.get_all_permutations(N_STREAMS).to(dtype)
    return model.to(dtype)


@torch.no_grad()
def move_weights(model, scale, seed):
    """Off the init: the connections' projections ~ N(0, scale^2), their biases, static matrices and
    scales moved by N(0, 0.5^2), norm gains and LayerNorm weights 1 + N(0, 0.1^2)."""
    generator = torch.Generator().manual_seed(seed)

    def normal(p):
        return torch.randn(p.shape, generator=generator, dtype=torch.float64).to(p.dtype)

    for connection in model.connections():
        for name, p in connection.named_parameters():
            noise = normal(p)
            p.copy_(scale * noise if name == "proj.weight" else 1 + 0.1 * noise if name == "norm_gain"
                    else p + 0.5 * noise)
    for norm in (m for m in model.modules() if isinstance(m, nn.LayerNorm)):
        norm.weight.copy_(1 + 0.1 * normal(norm.weight))


def connection_layout(c, of, gain_offset, their_perms):
    """One connection of ours in their layout: {their parameter name: tensor}. Their matrices are
    M[source, target], our h_res transposed; their norm gain is 1 + gamma."""
    n, w = c.n_streams, of(c.proj.weight)
    layout = {"norm.gamma": of(c.norm_gain) - gain_offset}
    if c.name == "hc":  # our static_alpha is theirs ([pre | into each target] per source); proj = [W_a | W_b]
        return layout | {"static_alpha": of(c.static_alpha), "dynamic_alpha_fn": w[: n + 1].T,
                         "dynamic_alpha_scale": of(c.scale_alpha), "static_beta": of(c.static_beta),
                         "dynamic_beta_fn": w[n + 1], "dynamic_beta_scale": of(c.scale_beta)}
    pre, post, res = w.split([n, n, w.shape[0] - 2 * n])
    if c.name == "mhc":  # their column s(1 + n) + t: t = 0 source s's pre weight, t = 1 + j its weight into j
        res = res.unflatten(0, (n, n)).transpose(0, 1)  # our row j n + s (logits[target j, source s]) -> [s, j]
        alpha_fn = torch.cat([pre.unsqueeze(1), res], dim=1).flatten(0, 1).T
        static_alpha = torch.cat([of(c.bias_pre).unsqueeze(1), of(c.bias_res).view(n, n).T], dim=1)
    else:  # mhclite: their weight r goes with their P_r = (our P_k)^T, i.e. our permutation k = inverse of r
        ours = c.perm_matrices.view(-1, n, n).to(their_perms.dtype)
        k = [int((ours == p.T).all(-1).all(-1).nonzero()) for p in their_perms]
        alpha_fn = torch.cat([pre, res[k]]).T
        static_alpha = torch.cat([of(c.bias_pre), of(c.bias_res)[k]])
    return layout | {"static_alpha": static_alpha, "dynamic_alpha_fn": alpha_fn, "static_beta": of(c.bias_post),
                     "dynamic_beta_fn": post.T, "pre_branch_scale": of(c.scale_pre).reshape(1),
                     "residual_scale": of(c.scale_res).reshape(1), "h_post_scale": of(c.scale_post)}


def their_layout(ours, authors_dir, grads=False):
    """Our parameters (or their gradients) as {their parameter name: tensor}; a name twice is an error."""
    of = (lambda p: p.grad) if grads else (lambda p: p.detach())
    their_perms = load_authors(authors_dir)[1].get_all_permutations(N_STREAMS)
    out = {}

    def put(name, tensor):
        assert name not in out, f"{name} written twice"
        out[name] = tensor

    t = ours.transformer
    for name in ("wte.weight", "wpe.weight", "ln_f.weight"):  # their lm_head is tied to wte, as ours
        put(f"transformer.{name}", of(t.get_parameter(name)))
    for i, block in enumerate(t.h):
        for branch, norm, sublayer in (("branch_attn", block.ln_1, block.attn), ("branch_mlp", block.ln_2, block.mlp)):
            put(f"transformer.h.{i}.{branch}.0.weight", of(norm.weight))
            for name, p in sublayer.named_parameters():
                put(f"transformer.h.{i}.{branch}.1.{name}", of(p))
        for wrapper, c in (("hc_attn", block.attn_connection), ("hc_mlp", block.mlp_connection)):
            for name, tensor in connection_layout(c, of, 0.0 if grads else 1.0, their_perms).items():
                put(f"transformer.h.{i}.{wrapper}.{name}", tensor)
    return out


@torch.no_grad()
def map_weights(ours, theirs, authors_dir):
    """Copies our weights onto their model; every one of their parameters is written exactly once."""
    mapped = their_layout(ours, authors_dir)
    params = dict(theirs.named_parameters())
    assert mapped.keys() == params.keys(), sorted(mapped.keys() ^ params.keys())
    for name, p in params.items():
        assert mapped[name].shape == p.shape, (name, mapped[name].shape, p.shape)
        p.copy_(mapped[name])
    return sorted(mapped)


def batch(seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(SHAPE["vocab_size"], (BATCH, SHAPE["block_size"]), generator=generator) for _ in range(2)]


def max_abs(a, b):
    return (a.double() - b.double()).abs().max().item()


def largest(t):
    return t.abs().max().item()


def both_models(authors_dir, variant, settings, dtype, scale, seed):
    """Ours with the weights moved off the init, and theirs with the same weights."""
    ours = our_model(variant, settings, dtype, seed)
    move_weights(ours, scale, seed)
    theirs = their_model(authors_dir, variant, dtype, seed)
    map_weights(ours, theirs, authors_dir)
    return ours, theirs


def compare(authors_dir, variant, settings, scale, seed=0):
    """One forward and backward of both models in float64: losses, logits' and gradients' differences."""
    ours, theirs = both_models(authors_dir, variant, settings, torch.float64, scale, seed)
    idx, targets = batch(seed)
    (logits, loss), (their_logits, their_loss) = ours(idx, targets), theirs(idx, targets)
    loss.backward()
    their_loss.backward()
    grads = their_layout(ours, authors_dir, grads=True)
    their_grads = {name: p.grad for name, p in theirs.named_parameters()}
    diffs = {name: max_abs(grads[name], g) for name, g in their_grads.items()}
    # Relative to the tensor's largest entry; a gradient that is 0 in exact arithmetic (the first
    # wrapper's residual_scale in mhclite: its input streams are equal) has no relative error.
    rel = [d / largest(their_grads[name]) for name, d in diffs.items() if largest(their_grads[name]) > 1e-14]
    return dict(loss=loss.item(), their_loss=their_loss.item(), dloss=abs(loss.item() - their_loss.item()),
                logits=max_abs(logits, their_logits), logits_rel=max_abs(logits, their_logits) / largest(their_logits),
                grads=max(diffs.values()), grads_rel=max(rel), n_grads=len(diffs), n_rel=len(rel))


@torch.no_grad()
def compare_bf16(authors_dir, variant, scale, seed=0):
    """Forward only, float32 models under CPU bf16 autocast, configs/authors.py: ours against theirs,
    and theirs against itself with every weight moved one ulp up (the noise floor)."""
    ours, theirs = both_models(authors_dir, variant, authors_settings(), torch.float32, scale, seed)
    moved = copy.deepcopy(theirs)
    for p in moved.parameters():
        p.copy_(torch.nextafter(p, torch.full_like(p, float("inf"))))
    idx, targets = batch(seed)
    with torch.autocast("cpu", torch.bfloat16):
        (logits, loss), (l1, loss1), (l2, loss2) = (m(idx, targets) for m in (ours, theirs, moved))
    return dict(dloss=abs(loss.item() - loss1.item()), logits=max_abs(logits, l1),
                floor_dloss=abs(loss2.item() - loss1.item()), floor_logits=max_abs(l2, l1))


def row(*cells):
    return "| " + " | ".join(cells) + " |"


def tables(authors_dir, variants, seed=0):
    runs = [(variant, scale) for variant in variants for scale in SCALES]
    lines = ["(a) float64, configs/authors.py: ours against theirs, same weights; gradients: ours in their layout", "",
             row("variant", "weights", "loss ours / theirs", "\\|dloss\\|", "logits max abs (rel)",
                 "gradients max abs (max rel)", "gradient tensors"), row(*["---"] * 7)]
    for variant, scale in runs:
        r = compare(authors_dir, variant, authors_settings(), scale, seed)
        lines.append(row(variant, f"x{scale:g}", f"{r['loss']:.6f} / {r['their_loss']:.6f}", f"{r['dloss']:.1e}",
                         f"{r['logits']:.1e} ({r['logits_rel']:.1e})", f"{r['grads']:.1e} ({r['grads_rel']:.1e})",
                         f"{r['n_grads']} ({r['n_rel']} in max rel)"))
    lines += ["", "(b) float64, the paper's defaults (our GPTConfig's) against theirs: the settings matter", "",
              row("variant", "weights", "loss ours / theirs", "\\|dloss\\|", "logits max abs", "gradients max abs"),
              row(*["---"] * 6)]
    results = [compare(authors_dir, variant, {}, scale, seed) for variant, scale in runs]
    for (variant, scale), r in zip(runs, results):
        lines.append(row(variant, f"x{scale:g}", f"{r['loss']:.6f} / {r['their_loss']:.6f}", f"{r['dloss']:.1e}",
                         f"{r['logits']:.1e}", f"{r['grads']:.1e}"))
    spans = {label: [r[key] for r in results] for key, label in
             (("dloss", "|dloss|"), ("logits", "logits max abs"), ("grads", "gradients max abs"))}
    lines += ["", "Ranges: " + ", ".join(f"{label} {min(v):.1e} to {max(v):.1e}" for label, v in spans.items()), "",
              "(c) float64, configs/authors.py but one setting at the paper's value: that setting's effect", "",
              row("all but", "variant", "weights", "\\|dloss\\|", "logits max abs"), row(*["---"] * 5)]
    defaults = {key: value for key, (value, _) in SETTINGS.items()}
    for key, acts_on in LEAVE_ONE_OUT.items():
        for variant, scale in ((v, s) for v, s in runs if v in acts_on):
            r = compare(authors_dir, variant, {**authors_settings(), key: defaults[key]}, scale, seed)
            lines.append(row(f"`{key}`", variant, f"x{scale:g}", f"{r['dloss']:.1e}", f"{r['logits']:.1e}"))
    lines += ["", "(d) bf16 autocast (CPU), float32 models, forward only, configs/authors.py; floor: their code "
              "against itself with every weight moved one ulp", "",
              row("variant", "projections", "\\|dloss\\| ours - theirs / floor",
                  "logits max abs ours - theirs / floor"), row(*["---"] * 4)]
    for variant, scale in ((variant, scale) for variant in variants for scale in BF16_SCALES):
        r = compare_bf16(authors_dir, variant, scale, seed)
        lines.append(row(variant, "zero" if scale == 0 else f"x{scale:g}", f"{r['dloss']:.1e} / {r['floor_dloss']:.1e}",
                         f"{r['logits']:.1e} / {r['floor_logits']:.1e}"))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--authors_dir", required=True, help=f"their checkout at ea19775 ({CHECKOUT})")
    parser.add_argument("--variants", nargs="+", default=list(THEIR_TYPES), choices=list(THEIR_TYPES))
    parser.add_argument("--seed", type=int, default=0, help="weights, data and inits")
    args = parser.parse_args(argv)
    try:
        load_authors(os.path.abspath(args.authors_dir))
    except AuthorsCodeMissing as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(1)
    print(tables(os.path.abspath(args.authors_dir), args.variants, args.seed))


if __name__ == "__main__":
    main()
