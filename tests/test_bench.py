"""The step benchmark (python bench.py, benchmarks/step.py) measures the models train.py trains, and
its pieces and the ones all benchmarks share (benchmarks/common.py) do what their columns claim.
Nothing here is timed."""
import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

import fused
from benchmarks import common
from benchmarks import micro as micro_bench
from benchmarks import step as bench
from conftest import assert_one_error_line, one_error_line
from model import GPT, GPTConfig, model_shape
from parallelize import compile_model

BLOCK, VOCAB, SEED = 16, 96, 3
DEVICE = torch.device("cpu")
SMALL_FLAGS = ["--size", "tiny", "--device", "cpu", "--batch_size", "2", "--block_size", str(BLOCK),
               "--vocab_size", str(VOCAB), "--steps", "2", "--warmup", "1", "--seed", str(SEED)]


def variants(recompute="both", residuals=("res", "hc", "mhc", "mhclite")):
    return common.main_variants(list(residuals), recompute, model_shape("tiny"), BLOCK, VOCAB)


def batch():
    return common.random_batches(1, 2, BLOCK, VOCAB, SEED, DEVICE)[0]


def test_bench_models_compute_the_plain_gpt_loss():
    x, y = batch()
    assert x.shape == y.shape == (2, BLOCK) and torch.equal(x[:, 1:], y[:, :-1])
    models = common.build_models(variants(), SEED, DEVICE)
    assert list(models) == ["res", "hc", "hc+recompute", "mhc", "mhc+recompute", "mhclite", "mhclite+recompute"]
    for name, model in models.items():
        torch.manual_seed(SEED)
        plain = GPT(GPTConfig(block_size=BLOCK, vocab_size=VOCAB, residual=name.split("+")[0], **model_shape("tiny")))
        _, expected = plain(x, y)
        _, loss = model(x, y)
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6, msg=name)


def test_recompute_rows_recompute_and_keep_the_gradients():
    x, y = batch()
    models = common.build_models(variants(residuals=("hc", "mhc", "mhclite")), SEED, DEVICE)
    for residual in ("hc", "mhc", "mhclite"):
        plain, recomputed = models[residual], models[residual + "+recompute"]
        saved = [bench.saved_activation_bytes(m, x, y, contextlib.nullcontext()) for m in (plain, recomputed)]
        assert saved[1] < saved[0], residual
        for model in (plain, recomputed):
            # a step moves the zero-initialised connection weights so their gradients matter too
            optimizer = common.make_optimizer(model, DEVICE)
            common.train_step(model, optimizer, x, y, contextlib.nullcontext())
            model(x, y)[1].backward()
        grads = [{n: p.grad for n, p in m.named_parameters()} for m in (plain, recomputed)]
        assert grads[0].keys() == grads[1].keys()
        for name in grads[0]:
            torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=f"{residual} {name}")


def test_saved_activations_shrink_with_recompute():
    x, y = batch()
    models = common.build_models(variants(residuals=("res", "mhc")), SEED, DEVICE)
    saved = {name: bench.saved_activation_bytes(model, x, y, contextlib.nullcontext()) for name, model in models.items()}
    assert 0 < saved["res"] < saved["mhc"]
    assert saved["mhc+recompute"] < saved["mhc"]


def test_saved_activations_exclude_parameters_and_count_shared_storage_once():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8, bias=False)

        def forward(self, x, y):
            h = self.linear(x)  # saves x and the weight (a parameter: not counted)
            return h * h  # saves h twice: one storage

    x = torch.randn(4, 8, requires_grad=True)
    expected = 2 * x.numel() * x.element_size()  # x and h
    assert bench.saved_activation_bytes(Model(), x, None, contextlib.nullcontext()) == expected


def test_interleaving_rotates_the_order_every_round():
    calls = []
    steps = {name: (lambda r, name=name: calls.append((r, name))) for name in "abc"}
    times = common.interleaved_times(steps, 4, 1, DEVICE, None)
    assert calls == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"),
                     (2, "c"), (2, "a"), (2, "b"), (3, "a"), (3, "b"), (3, "c")]
    assert {name: len(ms) for name, ms in times.items()} == {"a": 3, "b": 3, "c": 3}


def test_ratios_are_medians_of_per_round_ratios():
    summary = common.summarise({"res": [10.0, 20.0, 40.0], "mhc": [15.0, 20.0, 100.0]}, {"res": "res", "mhc": "res"})
    assert summary["res"]["time_ratio"] == 1.0
    assert summary["mhc"]["time_ratio"] == 1.5
    assert summary["mhc"]["median_ms"] == 20.0


@pytest.mark.slow
def test_main_writes_every_variant_with_ratios_to_res(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench.main(SMALL_FLAGS + ["--json", str(out)])
    result = json.loads(out.read_text())
    names = ["res", "hc", "hc+recompute", "mhc", "mhc+recompute", "mhclite", "mhclite+recompute"]
    assert list(result["variants"]) == names
    assert result["variants"]["res"]["time_ratio"] == 1.0
    assert result["variants"]["res"]["activation_ratio"] == 1.0
    for name in names:
        row = result["variants"][name]
        assert len(row["step_ms"]) == 2 and row["time_ratio"] > 0 and row["activation_ratio"] > 0
        assert row["mfu"] is None and row["cuda_peak_bytes"] is None  # CPU
    assert result["variants"]["mhc+recompute"]["activation_ratio"] < result["variants"]["mhc"]["activation_ratio"]
    assert result["command"].startswith("python bench.py --size tiny")
    for key in ("torch", "device_name", "cpu_count", "torch_threads", "date"):
        assert result[key]
    printed = capsys.readouterr().out
    assert "| mhclite+recompute |" in printed and "## Training step, tiny" in printed


@pytest.mark.slow
def test_n_sweep_compares_mhclite_budgets_to_mhc_per_n(tmp_path):
    out = tmp_path / "sweep.json"
    bench.main(SMALL_FLAGS + ["--n_sweep", "3,6", "--k_sweep", "4,8,700", "--json", str(out)])
    result = json.loads(out.read_text())
    rows = result["variants"]
    # n=3: 3! = 6 permutations, so K=8 and K=700 are out of range and "all" is K=6
    assert list(rows) == ["mhc n=3", "mhclite n=3 K=4", "mhclite n=3 K=6",
                          "mhc n=6", "mhclite n=6 K=4", "mhclite n=6 K=8", "mhclite n=6 K=700"]
    assert rows["mhc n=3"]["time_ratio"] == 1.0 and rows["mhc n=6"]["time_ratio"] == 1.0
    assert rows["mhclite n=6 K=8"]["n_streams"] == 6 and rows["mhclite n=6 K=8"]["mhclite_perms"] == 8
    assert rows["mhclite n=3 K=6"]["mhclite_perms"] is None
    assert all(r["time_ratio"] > 0 and r["activation_ratio"] > 0 for r in rows.values())


@pytest.mark.slow
def test_checkpointing_rows_keep_less_and_compare_to_the_same_variant_without(tmp_path, capsys):
    out = tmp_path / "ac.json"
    bench.main(SMALL_FLAGS + ["--residuals", "res,mhclite", "--recompute", "off", "--activation_checkpointing", "both",
                              "--json", str(out)])
    rows = json.loads(out.read_text())["variants"]
    assert list(rows) == ["res", "res+ac", "mhclite", "mhclite+ac"]
    assert [r["activation_checkpointing"] for r in rows.values()] == [False, True, False, True]
    assert rows["res+ac"]["time_ratio"] == 1.0  # the checkpointed rows compare to checkpointed res
    for name in ("res", "mhclite"):
        assert rows[name + "+ac"]["saved_activation_bytes"] < rows[name]["saved_activation_bytes"]
    table = capsys.readouterr().out.split("## Activation checkpointing against the same variant without")[1]
    assert "| res+ac |" in table and "| mhclite+ac |" in table


@pytest.mark.parametrize("flags, message", [
    (["--residuals", "res,foo"], "error: unknown residual 'foo'; valid: res, hc, mhc, mhclite"),
    (["--size", "XXL"], "error: unknown size 'XXL'"),
    (["--n_sweep", "3", "--activation_checkpointing", "on"], "error: --activation_checkpointing compares the"),
    (["--n_sweep", "3", "--stream_dtype", "both"], "error: --fused_connections both and --stream_dtype both compare"),
    (["--steps", "0"], "error: --steps must be >= 1"),
    (["--n_sweep", "6", "--k_sweep", "800"], "error: no mhclite permutation budget K <= 6! = 720"),
    (["--warmup", "-1"], "error: --warmup must be >= 0"),
    (["--path_rows", "mhclite,foo"], "error: unknown residual 'foo' in --path_rows"),
    (["--cuda_graphs", "both"], "error: --cuda_graphs compares the --residuals variants compiled: run it with "
                                "--compile on"),  # on CPU, compile is off unless asked for
    (["--compile", "on", "--cuda_graphs", "on", "--n_sweep", "3"], "error: --cuda_graphs compares"),
    (["--no-micro"], "error: --no-micro moved out of bench.py: use python -m benchmarks.micro"),
    (["--micro"], "error: --micro moved out of bench.py: use python -m benchmarks.micro"),
])
def test_bad_input_is_one_error_line(flags, message, tmp_path, capsys):
    assert one_error_line(bench.main, SMALL_FLAGS + flags + ["--json", str(tmp_path / "x.json")],
                          capsys).startswith(message)
    assert not (tmp_path / "x.json").exists()


def test_bench_py_is_the_step_benchmarks_command():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "bench.py", "--size", "XXL"], cwd=repo, capture_output=True, text=True)
    assert result.returncode == 2
    assert_one_error_line(result.stderr, "unknown size 'XXL'", alone=True)


GIB = 2**30


def test_timing_groups_keep_everything_together_when_it_fits():
    names = ["res", "hc", "mhc"]
    memory = {"res": (2 * GIB, 10 * GIB), "hc": (2 * GIB, 15 * GIB), "mhc": (2 * GIB, 16 * GIB)}
    baselines = {name: "res" for name in names}
    assert bench.timing_groups(names, baselines, memory, budget=30 * GIB) == [names]
    assert bench.timing_groups(names, baselines, {}, budget=0) == [names]  # CPU: no memory figures


def test_timing_groups_pair_each_variant_with_its_baseline_when_all_do_not_fit():
    names = ["res", "hc", "hc+recompute", "mhc"]
    memory = {name: (8 * GIB, 30 * GIB) for name in names}
    baselines = {name: "res" for name in names}
    assert bench.timing_groups(names, baselines, memory, budget=50 * GIB) == [
        ["res", "hc"], ["res", "hc+recompute"], ["res", "mhc"]]
    with pytest.raises(common.BenchError, match="do not fit"):
        bench.timing_groups(names, baselines, memory, budget=40 * GIB)


@pytest.mark.slow
def test_memory_probe_and_timing_share_one_compile_per_variant(monkeypatch, tmp_path, graph_counter):
    """Every variant is compiled once: the memory probe (CUDA; here a stand-in taking the same
    steps) and the timed rounds call the same compiled model, and the timing compiles nothing more."""
    torch._dynamo.reset()
    compiled, probed = [], []

    def compile_spy(model, mode):
        compiled.append(mode)
        return compile_model(model, mode, backend=graph_counter)

    def probe(variant, batches, ctx, device):
        for x, y in batches[:2]:
            common.train_step(variant.runner, variant.optimizer, x, y, ctx)
        probed.append(graph_counter.graphs)
        return bench.state_bytes(variant.model, variant.optimizer), 1

    monkeypatch.setattr(bench, "compile_model", compile_spy)
    monkeypatch.setattr(bench, "measures_memory", lambda device: True)
    monkeypatch.setattr(bench, "step_memory", probe)
    out = tmp_path / "bench.json"
    bench.main(SMALL_FLAGS + ["--residuals", "res,mhclite", "--recompute", "off", "--compile", "on",
                              "--compile_mode", "both", "--json", str(out)])
    rows = json.loads(out.read_text())["variants"]
    assert list(rows) == ["res", "res/blocks", "mhclite", "mhclite/blocks"]
    assert compiled == ["model", "blocks", "model", "blocks"]
    assert len(probed) == 4 and probed[0] > 0 and graph_counter.graphs == probed[-1]
    assert all(row["cuda_peak_bytes"] > row["params"] * 4 for row in rows.values())
    assert rows["mhclite/blocks"]["compile_mode"] == "blocks" and rows["mhclite/blocks"]["blocks_over_model"] > 0


def test_cuda_graphs_rows_compile_with_them_and_compare_to_res_with_them(monkeypatch, tmp_path, graph_counter):
    """--cuda_graphs both: a "+graphs" row next to each variant, compiled with inductor's CUDA graphs
    and marking each step as a new iteration; its ratio is to res run the same way, and its losses
    are the same variant's without (the same weights, the same batches in the same order)."""
    torch._dynamo.reset()
    compiled, step_marks = {}, []

    def compile_spy(model, mode, **options):
        compiled[model.config.residual] = compiled.get(model.config.residual, []) + [options]
        return compile_model(model, mode, backend=graph_counter)  # traced as is: inductor's options left out

    monkeypatch.setattr(bench, "compile_model", compile_spy)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: step_marks.append(1))
    out = tmp_path / "bench.json"
    bench.main(SMALL_FLAGS + ["--residuals", "res,mhclite", "--recompute", "off", "--compile", "on",
                              "--compile_mode", "blocks", "--cuda_graphs", "both", "--json", str(out)])
    result = json.loads(out.read_text())
    rows = result["variants"]
    assert list(rows) == ["res", "res+graphs", "mhclite", "mhclite+graphs"]
    assert [r["cuda_graphs"] for r in rows.values()] == [False, True, False, True]
    graphs = {"options": {"triton.cudagraphs": True}}
    assert compiled == {"res": [{}, graphs], "mhclite": [{}, graphs]}
    assert len(step_marks) == 2 * 3  # every step of the two graphed rows: 1 warm-up + 2 measured rounds
    assert rows["res"]["time_ratio"] == rows["res+graphs"]["time_ratio"] == 1.0
    for name in ("res", "mhclite"):
        assert len(rows[name]["losses"]) == 3 and rows[name]["losses"] == rows[name + "+graphs"]["losses"]
    assert rows["res"]["losses"] != rows["mhclite"]["losses"]
    assert result["settings"]["cuda_graphs"] == "both"


def test_each_row_is_compared_to_res_run_the_same_way():
    names = ["res", "res+graphs", "mhclite+bf16+graphs", "mhclite+ac", "mhclite+ac+graphs/blocks", "hc/blocks"]
    assert bench.same_kind_baselines(names, "res") == {
        "res": "res", "res+graphs": "res+graphs", "mhclite+bf16+graphs": "res+graphs", "mhclite+ac": "res+ac",
        "mhclite+ac+graphs/blocks": "res+ac+graphs/blocks", "hc/blocks": "res/blocks"}


@pytest.mark.parametrize("flags, rows", [
    ([], {"res": ("float32", False), "mhclite": ("float32", False)}),
    (["--fused_connections", "on", "--stream_dtype", "bfloat16"], {"res": ("float32", False),
                                                                   "mhclite": ("bfloat16", True)}),
    (["--fused_connections", "both", "--stream_dtype", "both"], {
        "res": ("float32", False), "mhclite": ("float32", False), "mhclite+bf16": ("bfloat16", False),
        "mhclite+fused": ("float32", True), "mhclite+fused+bf16": ("bfloat16", True)}),
    # the GPU check's rows: every variant, mhclite on each of its paths
    (["--residuals", "res,hc,mhclite", "--path_rows", "mhclite", "--fused_connections", "both", "--stream_dtype",
      "both"], {"res": ("float32", False), "hc": ("float32", False), "mhclite": ("float32", False),
                "mhclite+bf16": ("bfloat16", False), "mhclite+fused": ("float32", True),
                "mhclite+fused+bf16": ("bfloat16", True)}),
])
def test_both_puts_each_connection_path_in_a_row_of_its_own(flags, rows):
    """--fused_connections both and --stream_dtype both: a row per path, in one process; res stays nanoGPT's."""
    args = bench.resolve(bench.parse_args(SMALL_FLAGS + ["--residuals", "res,mhclite", "--recompute", "off", *flags]))
    variants = bench.path_variants(args, shape=args.shape, block_size=args.block_size, vocab_size=args.vocab_size)
    assert {name: (v.config.stream_dtype, v.fused_connections) for name, v in variants.items()} == rows


def test_bench_runs_bfloat16_streams_for_the_hc_family_only(tmp_path):
    out = tmp_path / "bench.json"
    bench.main(SMALL_FLAGS + ["--residuals", "res,mhclite", "--recompute", "off", "--stream_dtype", "bfloat16", "--json", str(out)])
    rows = json.loads(out.read_text())["variants"]
    assert rows["res"]["stream_dtype"] == "float32" and rows["mhclite"]["stream_dtype"] == "bfloat16"
    assert rows["mhclite"]["time_ratio"] > 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not fused.TRITON_AVAILABLE,
                    reason="needs Triton's interpreter (on a CUDA machine it is off)")
def test_a_dry_run_of_the_kernels_leaves_the_interpreter_off(tmp_path):
    """bench.py --fused_connections on --device cpu runs the kernels in Triton's interpreter and
    switches it off at the end: a later model in the same process takes residuals.py again."""
    out = tmp_path / "bench.json"
    bench.main(SMALL_FLAGS + ["--residuals", "mhclite", "--recompute", "off", "--fused_connections", "on",
                              "--steps", "1", "--warmup", "0", "--json", str(out)])
    assert json.loads(out.read_text())["variants"]["mhclite"]["connections"]["path"] == "fused"
    assert not fused.INTERPRET_ON_CPU


@pytest.mark.skipif(not fused.TRITON_AVAILABLE, reason="triton is not installed")
@pytest.mark.parametrize("interpret", [False, True])
def test_bench_and_micro_bench_record_the_path_that_ran_per_variant(interpret, tmp_path, monkeypatch, capsys,
                                                                     one_thread):
    """bench.py and python -m benchmarks.micro with --fused_connections on --device cpu: a dry run in
    Triton's interpreter under TRITON_INTERPRET=1, residuals.py without it; each row names the path
    its forward took (a spy on connection_forward)."""
    if interpret and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is off here (a CUDA machine)")
    if not interpret:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls = []
    forward = fused.connection_forward
    monkeypatch.setattr(fused, "connection_forward", lambda *args: calls.append(args[0]) or forward(*args))
    out = tmp_path / "bench.json"
    bench.main(["--size", "tiny", "--device", "cpu", "--batch_size", "1", "--block_size", "8", "--vocab_size", "32",
                "--steps", "1", "--warmup", "0", "--residuals", "res,mhclite", "--recompute", "off",
                "--fused_connections", "on", "--json", str(out)])
    result = json.loads(out.read_text())
    paths = {name: row["connections"]["path"] for name, row in result["variants"].items()}
    assert paths == {"res": "reference", "mhclite": "fused" if interpret else "reference"}
    assert (len(calls) > 0) == interpret
    assert bench.connections_line(result["variants"]) in capsys.readouterr().out
    calls.clear()
    micro_bench.main(["--size", "tiny", "--device", "cpu", "--batch_size", "1", "--block_size", "8", "--steps", "1",
                      "--warmup", "0", "--residuals", "res,mhclite", "--recompute", "off", "--fused_connections", "on",
                      "--json", str(tmp_path / "micro.json")])
    connections = json.loads((tmp_path / "micro.json").read_text())["connections"]
    assert {name: row["connections"]["path"] for name, row in connections.items()} == paths
    assert (len(calls) > 0) == interpret and not fused.INTERPRET_ON_CPU
