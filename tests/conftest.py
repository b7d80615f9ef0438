"""Shared test setup: offline environment variables, Triton's interpreter without a GPU, the tiny
char-level corpus fixture, tiny runs trained on the HellaSwag fixture (analysis/hellaswag.py,
export_hf.py), and helpers several test files use (`from conftest import ...`)."""

import dataclasses
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

# One thread per process, here and in every subprocess a test starts: pytest-xdist runs a worker per
# core, and a second thread per worker makes torch's tiny ops wait on a busy core (several times slower).
# Inductor likewise compiles in the process itself rather than starting a pool of compile workers,
# each of which imports torch again.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Inductor's CPU code without SIMD: g++ builds it in about half the time, and what the tests check of
# compiled models (graphs, gradients, caches, restarts) does not depend on it; GPUs never run it.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Tests never touch the network and never need wandb.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
# Without a GPU the fused kernels run in Triton's interpreter, which triton reads when it is imported:
# set here, before any test module is collected. With a GPU it stays off (it is process-wide and would
# also run inductor's Triton kernels).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

WORDS = ("the king and queen of a far land rode to the old castle where one bold knight kept "
         "watch over the river and the hills").split()


def write_char_dataset(root, name, text):
    """<root>/<name>/ in nanoGPT format: text's characters as the vocabulary, the last 10% val."""
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], dtype=np.uint16)
    n_train = int(0.9 * len(ids))
    folder = root / name
    folder.mkdir()
    ids[:n_train].tofile(folder / "train.bin")
    ids[n_train:].tofile(folder / "val.bin")
    meta = dict(dataset=name, tokenizer="char", vocab_size=len(chars), train_tokens=n_train,
                val_tokens=len(ids) - n_train, dtype="uint16", source="test", split_seed=0, val_fraction=0.1,
                itos=chars)
    (folder / "meta.json").write_text(json.dumps(meta))


FUSED_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fused")


# Fixtures that train or count for a while, shared by several tests: with pytest-xdist's
# --dist loadgroup (scripts/test.sh) the tests that use one run on one worker, which builds it once.
SHARED_FIXTURES = ("hellaswag_runs", "runs", "run_dirs", "study", "fresh", "slurm_env")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Everything under tests/fused/ is marked `fused` (pytest -m fused runs the kernels' tests alone);
    the tests of each of SHARED_FIXTURES form one xdist group, one per definition (test_sharded.py's
    and test_analysis.py's `runs` are two fixtures, built on two workers)."""
    for item in items:
        if str(item.path).startswith(FUSED_TESTS + os.sep):
            item.add_marker(pytest.mark.fused)
        shared = next((name for name in SHARED_FIXTURES if name in item.fixturenames), None)
        if shared:
            definition = item._fixtureinfo.name2fixturedefs[shared][-1]  # the one this test gets
            item.add_marker(pytest.mark.xdist_group(f"{definition.baseid}::{shared}"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A ~25 KB char-level corpus in nanoGPT format: seeded random lines of a few words."""
    root = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(450)) + "\n"
    write_char_dataset(root, "toy", text)
    return root


HELLASWAG_FIXTURE = Path(__file__).parent / "hellaswag_fixture.jsonl"
# (run name, train.py overrides): every variant, mhclite with n = 8 and 12 sampled permutations, and
# kromhc with n = 6 (a 2 x 2 and a 3 x 3 factor)
FIXTURE_RUNS = {"res": dict(residual="res"), "hc": dict(residual="hc"), "mhc": dict(residual="mhc"),
                "mhclite": dict(residual="mhclite"),
                "mhclite-n8": dict(residual="mhclite", n_streams=8, mhclite_perms=12),
                "kromhc-n6": dict(residual="kromhc", n_streams=6), "ihc": dict(residual="ihc")}


@pytest.fixture(scope="session")
def hellaswag_runs(tmp_path_factory):
    """{run name: run directory} of tiny char models trained on the HellaSwag fixture's texts (its
    contexts followed by the gold endings, and seeded shuffles of all endings), so their
    vocabulary covers the fixture."""
    import train

    root = tmp_path_factory.mktemp("hellaswag_runs")
    items = [json.loads(line) for line in HELLASWAG_FIXTURE.read_text().splitlines()]
    rng = random.Random(0)
    lines = []
    for _ in range(40):
        for item in items:
            lines.append(f"{item['activity_label']}: {item['ctx_a']} {item['ctx_b'].capitalize()} "
                         f"{item['endings'][int(item['label'])].strip()}")
            lines.append(" ".join(rng.sample(item["endings"], len(item["endings"]))))
    write_char_dataset(root, "fixture", "\n".join(lines) + "\n")
    runs = {}
    for name, overrides in FIXTURE_RUNS.items():
        runs[name] = root / name
        train.main(tiny_args(root, runs[name], dataset="fixture", max_iters=10, eval_interval=10, block_size=96,
                             **overrides))
    return runs


@pytest.fixture
def graph_counter():
    """A torch.compile backend that runs every graph dynamo hands it as traced and counts them
    (`.graphs`)."""
    class GraphCounter:
        graphs = 0

        def __call__(self, graph_module, example_inputs):
            self.graphs += 1
            return graph_module.forward

    return GraphCounter()


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread, and the CPU is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def randomise(module, scale, seed=0):
    """Every parameter of module moved off its init by scale * N(0, 1) (one seeded generator), so
    that every coefficient path matters and no setting hides behind a symmetric start."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator).to(p.device, p.dtype))
    return module


def assert_one_error_line(stderr, *words, alone=False):
    """stderr has no traceback and exactly one `error: ...` line, naming every one of words (alone:
    and nothing else; otherwise progress lines may come before it); returns that line."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, stderr
    assert not alone or stderr.strip() == lines[0], stderr
    for word in words:
        assert word in lines[0], stderr
    return lines[0]


def one_error_line(main, argv, capsys, *words, alone=True):
    """Runs a command line's main(argv) in this process, which must exit with code 2 after printing
    exactly one stderr line, `error: ...`, naming every one of words, and no traceback (alone: and
    nothing else; otherwise progress lines may come before it); returns that line. Each command's
    entry point is run as a process by another test."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return assert_one_error_line(capsys.readouterr().err, *words, alone=alone)


# ----------------------------------------------------------------------------------------------
# train.py's command line and metrics.jsonl (test_train.py and every test that trains a run)

# The keys of metrics.jsonl's one first-step record (its timing, apart from the step timings).
FIRST_STEP_KEYS = {"step", "first_step_s", "compiled"}


def tiny_args(data_dir, out_dir, **overrides):
    """train.py's flags for a tiny fp32 mhclite run on CPU over data_dir's toy corpus (seconds), with overrides."""
    settings = dict(dataset="toy", data_dir=data_dir, out_dir=out_dir, size="tiny", residual="mhclite",
                    n_layer=2, n_embd=64, block_size=32, batch_size=4, gradient_accumulation_steps=2,
                    max_iters=20, warmup_iters=4, learning_rate=3e-3, min_lr=3e-4, eval_interval=10,
                    eval_iters=2, log_interval=5, device="cpu", dtype="float32", compile=False)
    settings.update(overrides)
    return [f"--{key}={value}" for key, value in settings.items()]


def read_all_metrics(out_dir):
    """(train, eval, first-step) records of metrics.jsonl; every line is one of the three."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train_records = [r for r in records if "train_loss" in r]
    eval_records = [r for r in records if "val_loss" in r]
    first_records = [r for r in records if "first_step_s" in r]
    assert all(set(r) == FIRST_STEP_KEYS for r in first_records)
    assert len(train_records) + len(eval_records) + len(first_records) == len(records)
    return train_records, eval_records, first_records


def read_metrics(out_dir):
    """(train, eval) records of metrics.jsonl: read_all_metrics without the first-step record."""
    train_records, eval_records, _ = read_all_metrics(out_dir)
    return train_records, eval_records


# ----------------------------------------------------------------------------------------------
# Processes: the commands' entry points, ports for process groups


def run_script(script, *args, timeout=300):
    """`python script args` as a process from the repo root, on one thread (the commands' own entry
    points, which in-process tests of main() do not cover); the finished process, output as text."""
    from config import REPO_DIR
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, os.path.join(REPO_DIR, script), *args], cwd=REPO_DIR, env=env,
                          capture_output=True, text=True, timeout=timeout)


def free_port():
    """A TCP port free on this machine now, for a process group's or a rendezvous's store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------
# Runs that are stopped and continued (test_restarts.py, test_slurm.py, test_run_owner.py), each
# compared step by step with one uninterrupted run

# Saves at steps 0, 3 (interval), 4 (eval), 6 (interval) and 8 (eval, end); the schedule's
# horizon is fixed, so a shorter first leg follows the same lr.
RUN = dict(n_layer=1, n_embd=32, max_iters=8, lr_decay_iters=8, warmup_iters=2, eval_interval=4,
           log_interval=1, ckpt_interval=3)


def run_args(data_dir, out_dir, **overrides):
    """tiny_args of a RUN leg that starts or continues (init_from=auto), with overrides."""
    return tiny_args(data_dir, out_dir, **dict(RUN, init_from="auto", **overrides))


def trajectory(out_dir):
    """(train records, eval records) without the timings, each step once or the test fails."""
    train_records, eval_records, _ = read_all_metrics(out_dir)
    for records in (train_records, eval_records):
        steps = [r["step"] for r in records]
        assert len(steps) == len(set(steps)), steps
    return ([(r["step"], r["lr"], r["train_loss"], r["grad_norm"]) for r in train_records],
            [(r["step"], r["eval_train_loss"], r["val_loss"]) for r in eval_records])


def read_all_metrics_lines(out_dir):
    """Every whole record of metrics.jsonl, in order."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def temp_files(folder):
    """The names of folder's temporary checkpoint files (*.tmp), sorted."""
    return sorted(name for name in os.listdir(folder) if name.endswith(".tmp"))


def snapshot(folder):
    """Every file's modification time and bytes: what 'nothing changed on disk' compares."""
    return {path.name: (path.stat().st_mtime_ns, path.read_bytes()) for path in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    """One uninterrupted run from scratch: its folder."""
    import train

    out = tmp_path_factory.mktemp("reference") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every run compared with it
    try:
        train.main(tiny_args(data_dir, out, **dict(RUN, init_from="scratch")))
    finally:
        torch.set_num_threads(threads)
    return out


def assert_uninterrupted(out, reference):
    """The run's per-step records equal the uninterrupted run's exactly: with two micro-batches,
    two ranks' gradient sum and one process's sum of halves are the same floats (halving is
    exact), so an interruption is the only difference left."""
    from checkpoint import load_checkpoint
    train_steps, eval_steps = trajectory(out)
    assert [s[0] for s in train_steps] == list(range(1, 9)) and [s[0] for s in eval_steps] == [0, 4, 8]
    assert (train_steps, eval_steps) == trajectory(reference)
    assert load_checkpoint(str(out / "ckpt.pt"))["step"] == 8
    assert (out / "done").read_text() == "8\n" and temp_files(out) == []


def kill_process_tree(pid):
    """SIGKILL to pid and every process below it, found by parent pid (torchrun's workers run in
    sessions of their own, out of reach of a process-group kill)."""
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue  # exited meanwhile
            parent = int(stat[stat.rindex(")") + 2:].split()[1])  # "pid (comm) state ppid ..."
            children.setdefault(parent, []).append(int(name))
    todo = [pid]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ----------------------------------------------------------------------------------------------
# Tiny models and tokens (test_model.py, test_cuda.py; random_model: test_kv_cache.py,
# test_new_variants.py), each module at its own vocabulary and block size


def tiny_config(residual="res", *, vocab_size, block_size, **overrides):
    """GPTConfig of the tiny shape with residual at vocab_size and block_size, with overrides."""
    from model import GPTConfig, model_shape
    return GPTConfig(block_size=block_size, vocab_size=vocab_size, residual=residual,
                     **{**model_shape("tiny"), **overrides})


def random_tokens(vocab_size, block_size, b=2, seed=0, device="cpu"):
    """b seeded sequences of block_size token ids below vocab_size, on device."""
    return torch.randint(0, vocab_size, (b, block_size), generator=torch.Generator().manual_seed(seed)).to(device)


def random_model(residual, n_streams=4, block_size=16, **options):
    """A small fp32 model whose every parameter is drawn (not the identity-like init of the
    connections), so that the streams mix and the greedy choices are far from ties."""
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=block_size, vocab_size=48, n_layer=2, n_head=4, n_embd=32, residual=residual,
                          n_streams=n_streams, **options))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return model.eval()


# ----------------------------------------------------------------------------------------------
# Connection modules against the papers' math (test_residuals.py, test_new_variants.py)


def branch(u):
    """A stand-in sublayer for a connection to wrap: any (B, T, C) -> (B, T, C)."""
    return torch.tanh(u) * 0.5 + 0.1


def stream_state(b=2, t=5, n=4, c=8, seed=1):
    """Seeded N(0, 1) residual streams, (b, t, n, c)."""
    return torch.randn(b, t, n, c, generator=torch.Generator().manual_seed(seed))


def rms_norm(x, gain):
    """RMSNorm over the last dim with gain (eps 1e-6), as the references write it."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gain


def reference_manifold(module, x, h_res_fn):
    """The paper's equations (Sec. 2 and 3.2) for an mhc-family module, one token at a time, with
    h_res_fn making H_res from its logits: the literal transcription the modules are checked against."""
    n, c = module.n_streams, module.width
    w_pre, w_post, w_res = module.proj.weight.split([n, n, module.res_logits], dim=0)
    out = torch.empty_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            xl = x[b, t]
            xh = rms_norm(xl.reshape(n * c), module.norm_gain)
            h_pre = torch.sigmoid(module.scale_pre * (xh @ w_pre.t()) + module.bias_pre)
            h_post = 2 * torch.sigmoid(module.scale_post * (xh @ w_post.t()) + module.bias_post)
            h_res = h_res_fn(module.scale_res * (xh @ w_res.t()) + module.bias_res)
            u = sum(h_pre[i] * xl[i] for i in range(n))
            fu = branch(u)
            for i in range(n):
                out[b, t, i] = sum(h_res[i, j] * xl[j] for j in range(n)) + h_post[i] * fu
    return out


def connection_gradcheck(module, x):
    """torch.autograd.gradcheck of module(x, branch) in x and in every parameter (x and module in
    float64, x requiring grad)."""
    names = [name for name, _ in module.named_parameters()]

    def forward(x, *params):
        return torch.func.functional_call(module, dict(zip(names, params)), (x, branch))

    params = [p.detach().clone().requires_grad_() for p in module.parameters()]
    return torch.autograd.gradcheck(forward, (x, *params))


def forward_and_grads(module, x, grad_out):
    """The connection's output under bf16 autocast and the gradients of x and of every parameter."""
    x = x.detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(x, branch)
    return out, torch.autograd.grad(out, [x, *module.parameters()], grad_out.to(out.dtype))


def assert_doubly_stochastic(h, tol=1e-6):
    """h: float32 matrices with non-negative entries whose rows and columns each sum to 1 within tol."""
    assert h.dtype == torch.float32
    assert (h >= 0).all()
    assert (h.sum(-1) - 1).abs().max().item() < tol
    assert (h.sum(-2) - 1).abs().max().item() < tol


class ReducedPrecisionMatmuls(TorchDispatchMode):
    """Emulates TF32 (or bf16) float32 matmuls on a CPU: every float32 operand of a matmul-family
    op is rounded to `mantissa_bits` bits (round to nearest even) before the exact product, which is
    what tensor cores do with TF32 (10 bits) operands. Everything else runs unchanged."""

    OPS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
           torch.ops.aten.baddbmm.default, torch.ops.aten.mv.default, torch.ops.aten.dot.default}

    def __init__(self, mantissa_bits=10):
        super().__init__()
        self.drop = 23 - mantissa_bits
        self.calls = 0

    def round_operand(self, t):
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.float32):
            return t
        bits = t.contiguous().view(torch.int32)
        half, lsb = 1 << (self.drop - 1), (bits >> self.drop) & 1
        rounded = ((bits + half - 1 + lsb) >> self.drop) << self.drop
        return rounded.view(torch.float32).view(t.shape)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.OPS:
            self.calls += 1
            args = tuple(self.round_operand(a) for a in args)
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------------------------
# Fake training runs (test_depth_study.py, test_variants_study.py): checkpoints of real, perturbed
# models and metrics.jsonl files written here, with planted gradient spikes and val losses

FAKE_DATASET, FAKE_VOCAB, FAKE_BLOCK = "toy_char", 16, 32
FAKE_STEPS, FAKE_WARMUP = 40, 4
SPIKE_STEPS = (25, 33)  # 1-based steps whose gradient norm is planted at 5x the baseline


def write_fake_dataset(data_dir):
    """data_dir/FAKE_DATASET, the fake runs' corpus: seeded random ids below FAKE_VOCAB."""
    folder = data_dir / FAKE_DATASET
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, size in (("train", 4000), ("val", 2000)):
        rng.integers(0, FAKE_VOCAB, size).astype(np.uint16).tofile(folder / f"{split}.bin")
    (folder / "meta.json").write_text(json.dumps(dict(dataset=FAKE_DATASET, tokenizer="char", vocab_size=FAKE_VOCAB,
                                                      itos=[chr(97 + i) for i in range(FAKE_VOCAB)])))


def grad_norms(seed, nan_at=None):
    """A flat baseline with a 2x bump (below the spike factor) and 5x spikes at SPIKE_STEPS."""
    norms = [1.0 + 0.01 * ((step * 7 + seed) % 5) for step in range(1, FAKE_STEPS + 1)]
    norms[14] *= 2.0
    for step in SPIKE_STEPS:
        norms[step - 1] *= 5.0
    if nan_at is not None:
        norms[nan_at - 1:] = [float("nan")] * (FAKE_STEPS - nan_at + 1)
    return norms


def fake_run(root, data_dir, variant, depth, lr, seed, val_loss=None, nan_at=None):
    """A run folder as train.py leaves it: config.json, metrics.jsonl, ckpt.pt and a marker; the
    last eval's val loss is val_loss, and a run with nan_at stops on a NaN there before it."""
    from checkpoint import save_checkpoint
    from config import TrainConfig
    from model import GPT, GPTConfig

    assert val_loss is not None or nan_at is not None, "a finished fake run needs its val_loss"
    path = root / f"{variant}-L{depth}-lr{lr:g}-s{seed}"
    path.mkdir(parents=True)
    config = dataclasses.asdict(TrainConfig(
        dataset=FAKE_DATASET, data_dir=str(data_dir), size="tiny", residual=variant, n_layer=depth, n_head=2,
        n_embd=32, block_size=FAKE_BLOCK, batch_size=4, learning_rate=lr, min_lr=lr / 10, max_iters=FAKE_STEPS,
        warmup_iters=FAKE_WARMUP, seed=seed, device="cpu", dtype="float32", compile="false"))
    (path / "config.json").write_text(json.dumps(config))
    norms = grad_norms(seed, nan_at)
    records = [dict(step=s, train_loss=3.0 - s / 100 if math.isfinite(g) else g, lr=lr, grad_norm=g,
                    tokens_per_s=1000.0, step_ms=10.0) for s, g in zip(range(1, FAKE_STEPS + 1), norms)]
    if nan_at is not None:
        records = records[:nan_at]  # train.py stops at the window holding the NaN
    evals = [dict(step=FAKE_STEPS // 2, eval_train_loss=2.9, val_loss=2.9)]
    if nan_at is None:
        evals.append(dict(step=FAKE_STEPS, eval_train_loss=2.5, val_loss=val_loss))
    lines = [json.dumps(r) for r in sorted(records + evals, key=lambda r: r["step"])]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    torch.manual_seed(seed)
    model_args = dict(block_size=FAKE_BLOCK, vocab_size=FAKE_VOCAB, n_layer=depth, n_head=2, n_embd=32,
                      residual=variant)
    model = GPT(GPTConfig(**model_args))
    with torch.no_grad():  # away from the initial coefficients, so that mhc's Sinkhorn leaves visible errors
        for module in model.connections():
            for p in module.parameters():
                p.add_(torch.randn_like(p) * (3.0 if p.dim() == 0 or p.numel() < 40 else 0.3))
    save_checkpoint(str(path / "ckpt.pt"), dict(model=model.state_dict(), model_args=model_args, config=config,
                                                step=FAKE_STEPS))
    (path / ("diverged" if nan_at is not None else "done")).write_text(f"{FAKE_STEPS}\n")
    (path / "wall_s").write_text("7\n")
    return path


def with_settings(path, settings):
    """A fake run's config.json and checkpoint as a run with these model settings would have written them."""
    from checkpoint import load_checkpoint, save_checkpoint
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **settings}))
    ckpt = load_checkpoint(str(path / "ckpt.pt"))
    ckpt["model_args"].update(settings)
    save_checkpoint(str(path / "ckpt.pt"), ckpt)


# ----------------------------------------------------------------------------------------------
# Hugging Face exports (test_hf_export.py, test_sharded.py)


def load_export(folder):
    """An export_hf.py folder loaded offline by transformers: (model in eval mode, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    return model.eval(), AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
