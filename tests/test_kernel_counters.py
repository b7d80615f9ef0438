"""python -m benchmarks.kernel_counters: the fused kernels' hardware counters read by Nsight Compute,
against the CPU proxies. No GPU or ncu here: the process ncu would profile runs on CPU in Triton's
interpreter, under tests/ncu/ncu, a stand-in that writes ncu's CSV for the launches it ran."""

import json
import os

import pytest

from benchmarks import kernel_counters as counters

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDIN = os.path.join(REPO, "tests", "ncu", "ncu")
TINY = ["--device", "cpu", "--size", "tiny", "--batch_size", "1", "--block_size", "16"]

RAW_PAGE = """==PROF== Connected to process 7 (python3)
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","dram__bytes_read.sum","gpu__time_duration.sum","sm__warps_active.avg.pct_of_peak_sustained_active"
"","","","","","","","","","","","Kbyte","usecond","%"
"0","7","python3","h","pre_kernel","1","7","(128, 1, 1)","(1024, 1, 1)","0","9.0","1,536.5","238.25","61.3"
"1","7","python3","h","post_kernel","1","7","(128, 1, 1)","(1024, 1, 1)","0","9.0","12","n/a","40"
==PROF== Disconnected from process 7
"""
DETAILS_PAGE = """"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","7","python3","h","pre_kernel","1","7","(128, 1, 1)","(1024, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","Mbyte","1.50"
"0","7","python3","h","pre_kernel","1","7","(128, 1, 1)","(1024, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","238,250"
"1","7","python3","h","post_kernel","1","7","(128, 1, 1)","(1024, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","12,000"
"""


def test_reads_both_pages_of_ncu_csv_in_base_units():
    raw = counters.read_ncu_csv(RAW_PAGE)
    assert raw == [{"kernel": "pre_kernel", "dram__bytes_read.sum": 1_536_500.0,
                    "gpu__time_duration.sum": pytest.approx(238.25e-6),
                    "sm__warps_active.avg.pct_of_peak_sustained_active": 61.3},
                   {"kernel": "post_kernel", "dram__bytes_read.sum": 12_000.0,
                    "sm__warps_active.avg.pct_of_peak_sustained_active": 40.0}]
    details = counters.read_ncu_csv(DETAILS_PAGE)
    assert details == [{"kernel": "pre_kernel", "dram__bytes_read.sum": 1_500_000.0,
                        "gpu__time_duration.sum": pytest.approx(238.25e-6)},
                       {"kernel": "post_kernel", "dram__bytes_read.sum": 12_000.0}]
    assert counters.read_ncu_csv("==ERROR== ERR_NVGPUCTRPERM") == []


def test_asks_only_for_the_metrics_this_ncu_knows():
    listing = ("Device NVIDIA H100 80GB HBM3 (GH100)\nMetric Name      Metric Description\n"
               "dram__bytes_read     Counter   byte   # of bytes read from DRAM\n"
               "gpu__time_duration   # of nanoseconds\n")
    assert counters.known_metrics(listing) == {"dram__bytes_read", "gpu__time_duration"}
    usable, missing = counters.usable_metrics({"dram__bytes_read", "gpu__time_duration"})
    assert usable == ["gpu__time_duration.sum", "dram__bytes_read.sum", "launch__registers_per_thread"]
    assert "dram__bytes_write.sum" in missing and "lts__t_bytes.sum" in missing


def test_each_replayed_launch_is_read_once_beside_its_proxies(tmp_path, monkeypatch):
    """Under the stand-in, the process ncu profiles records mhclite's connection (five kernels),
    replays each launch twice, and the second replay's counters are kept, per token, beside the
    proxies' numbers for the same launch."""
    monkeypatch.chdir(REPO)
    args = counters.resolve(counters.parse_args([*TINY, "--stream_dtypes", "float32"]))
    ran, profiled, missing = counters.run_under_ncu(STANDIN, counters.child_argv(args), str(tmp_path))
    kernels = ["pre_kernel", "post_kernel", "post_backward_kernel", "pre_backward_grad_x_kernel",
               "pre_backward_weight_kernel"]
    assert [kernel for _, _, kernel, _ in ran] == kernels + [k for k in kernels for _ in range(counters.REPLAYS)]
    assert missing == [m for m in counters.METRICS["global"] if "ldgsts" in m]  # the stand-in does not know them
    kept = counters.kept_launches(ran, profiled)
    assert [k["kernel"] for k in kept] == kernels
    # the stand-in's counter of launch i, metric j is 1000 (i + 1) + j + 1 (bytes here: j = 1, DRAM read): the
    # kept ones are the second replays, after the recording's launches
    assert [k["dram__bytes_read.sum"] for k in kept] == [1000 * (len(kernels) + 2 * i + 2) + 2
                                                         for i in range(len(kernels))]
    tokens = args.batch_size * args.block_size
    profile = dict(residual="mhclite", stream_dtype="float32", kernel="post_kernel", dram_per_token=100.0,
                   executed_per_token=150.0, unique_per_token=90.0, registers=40)
    rows = {r["kernel"]: r for r in counters.compare(kept, tokens, [profile])}
    post = next(k for k in kept if k["kernel"] == "post_kernel")
    dram = (post["dram__bytes_read.sum"] + post["dram__bytes_write.sum"]) / tokens
    assert rows["post_kernel"]["dram_per_token"] == dram
    assert rows["post_kernel"]["dram_over_predicted"] == pytest.approx(dram / 100.0)
    assert rows["post_kernel"]["compiled_registers"] == 40
    assert rows["pre_kernel"]["predicted_dram_per_token"] is None  # no profile given for it
    assert "| mhclite | float32 | post |" in counters.counters_table(list(rows.values()))

    with pytest.raises(counters.BenchError, match="ncu profiled 14 launches"):
        counters.kept_launches(ran, profiled[1:])


def test_without_a_gpu_or_ncu_it_says_so_and_succeeds(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    counters.main([*TINY, "--json", str(tmp_path / "counters.json")])
    assert capsys.readouterr().out.startswith("skipped: no hardware counters here: needs a CUDA GPU and ncu")
    assert not (tmp_path / "counters.json").exists()


def test_the_profiled_process_lists_what_ran(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    counters.main([*TINY, "--residuals", "hc", "--stream_dtypes", "bfloat16", "--launches", str(tmp_path / "ran")])
    ran = json.loads((tmp_path / "ran").read_text())
    assert {tuple(r[:2]) for r in ran} == {("hc", "bfloat16")}
    assert sum(kept for *_, kept in ran) == len(ran) // (1 + counters.REPLAYS)
