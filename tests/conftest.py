"""Shared test setup: offline environment variables, Triton's interpreter without a GPU, the tiny
char-level corpus fixture, tiny runs trained on the HellaSwag fixture (analysis/hellaswag.py,
export_hf.py), and helpers several test files use (`from conftest import ...`)."""

import json
import os
import random
import signal
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
    from test_train import tiny_args
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
# Runs that are stopped and continued (test_restarts.py, test_slurm.py, test_run_owner.py), each
# compared step by step with one uninterrupted run

# Saves at steps 0, 3 (interval), 4 (eval), 6 (interval) and 8 (eval, end); the schedule's
# horizon is fixed, so a shorter first leg follows the same lr.
RUN = dict(n_layer=1, n_embd=32, max_iters=8, lr_decay_iters=8, warmup_iters=2, eval_interval=4,
           log_interval=1, ckpt_interval=3)


def run_args(data_dir, out_dir, **overrides):
    from test_train import tiny_args
    return tiny_args(data_dir, out_dir, **dict(RUN, init_from="auto", **overrides))


def trajectory(out_dir):
    """(train records, eval records) without the timings, each step once or the test fails."""
    from test_train import read_all_metrics
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
    return sorted(name for name in os.listdir(folder) if name.endswith(".tmp"))


def snapshot(folder):
    """Every file's modification time and bytes: what 'nothing changed on disk' compares."""
    return {path.name: (path.stat().st_mtime_ns, path.read_bytes()) for path in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    """One uninterrupted run from scratch: its folder."""
    from test_train import tiny_args
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
