"""The latency and occupancy model (python -m fused.tools.latency): its L2 model, its two bounds, and
the calibration's agreement measure, on made-up kernels (the compilation for sm_90 is the resource
check's: tests/fused/test_fused_resources.py)."""

import collections
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from fused.tools import latency

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENS = 16 * 1024


def counts(unique=10_000.0, executed=20_000.0, loads=1.0, rereads=None):
    return dict(kernels={"k": unique}, executed={"k": executed}, loads={"k": loads}, rereads={"k": rereads or {}})


def resources(ctas_per_sm=2, num_warps=8):
    return dict(registers=100, stack_bytes=0, local_bytes=0, num_warps=num_warps, ctas_per_sm=ctas_per_sm)


def test_a_reread_misses_l2_when_its_distance_times_the_resident_programs_exceeds_it():
    # 2^20 bytes between the reads: 50 programs x ~1.5 MB fit in 50 MB, 264 do not
    entry = counts(rereads={"20": 4000.0, "10": 1000.0})
    assert latency.dram_bytes_per_token(entry, "k", resident=30) == 10_000.0
    assert latency.dram_bytes_per_token(entry, "k", resident=264) == 14_000.0
    few = latency.profile(entry, "k", (30,), resources(), TOKENS)
    many = latency.profile(entry, "k", (4096,), resources(), TOKENS)
    assert (few["resident"], many["resident"]) == (30, 2 * latency.H200.sms)
    assert (few["dram_per_token"], many["dram_per_token"]) == (10_000.0, 14_000.0)


def test_the_machine_sets_the_resident_programs_and_what_its_l2_holds():
    entry = counts(loads=40.0, rereads={"17": 4000.0})  # 2^17.5 bytes apart: 264 programs' fit in 50 MB
    fewer_sms = latency.Machine("114 SMs", sms=114, l2_bytes=latency.H200.l2_bytes, cc=90)
    less_l2 = latency.Machine("25 MB of L2", sms=latency.H200.sms, l2_bytes=25 * 1000 ** 2, cc=90)
    h200, fewer, less = (latency.profile(entry, "k", (1024,), resources(), TOKENS, machine)
                         for machine in (latency.H200, fewer_sms, less_l2))
    assert (h200["resident"], fewer["resident"], less["resident"]) == (264, 228, 264)
    assert (h200["waves"], fewer["waves"]) == (1024 / 264, 1024 / 228)
    assert (h200["dram_per_token"], fewer["dram_per_token"], less["dram_per_token"]) == (10_000.0, 10_000.0, 14_000.0)


def test_the_visible_gpu_as_a_machine(monkeypatch):
    import torch
    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", multi_processor_count=132, L2_cache_size=52_428_800,
                            major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert latency.this_gpu() == latency.Machine("NVIDIA H100 80GB HBM3", sms=132, l2_bytes=52_428_800, cc=90)


def test_a_prediction_moves_to_another_copy_bandwidth_by_its_dram_term_alone():
    # 300 us of which 100 us are DRAM bytes at 4 TB/s: at 2 TB/s the bytes take 200 us, the round trips stay
    prediction = dict(us=300.0, dram_us=100.0)
    assert latency.at_copy_bandwidth(prediction, 4e12, 2e12) == pytest.approx(400.0)
    assert latency.at_copy_bandwidth(prediction, 4e12, 4e12) == 300.0


def test_a_streaming_kernel_is_dram_bound_and_a_serial_one_latency_bound():
    # one step per program, programs resident at once: the bytes at the copy's bandwidth, plus a round trip
    streaming = latency.profile(counts(loads=1 / 16), "k", (TOKENS // 16,), resources(ctas_per_sm=8), TOKENS)
    seconds, bound = latency.predict(streaming, step_latency=500e-9)
    assert streaming["waves"] == 1 and streaming["steps_per_program"] == 1
    assert bound == "DRAM" and seconds == pytest.approx(10_000.0 * TOKENS / latency.COPY_BANDWIDTH + 500e-9)
    # 128 programs of 16,384 x 40 / 128 steps each: the round trips one after another
    serial = latency.profile(counts(loads=40.0), "k", (128,), resources(ctas_per_sm=1), TOKENS)
    assert serial["steps_per_program"] == 40 * TOKENS / 128 and serial["waves"] == 1.0
    seconds, bound = latency.predict(serial, step_latency=500e-9)
    assert bound == "latency"
    assert seconds == pytest.approx(10_000.0 * TOKENS / latency.COPY_BANDWIDTH + serial["steps_per_program"] * 500e-9)
    # the same work in twice the programs, two resident per SM: half the serial steps
    wider = latency.profile(counts(loads=40.0), "k", (256,), resources(ctas_per_sm=2), TOKENS)
    assert wider["in_flight_per_sm"] == 2 * serial["in_flight_per_sm"]
    assert latency.predict(wider, 500e-9)[0] < seconds


def test_fit_recovers_the_latency_that_made_the_times():
    profiles = [latency.profile(counts(loads=loads), "k", (programs,), resources(ctas_per_sm=1), TOKENS)
                for loads, programs in ((40.0, 128), (10.0, 128), (20.0, 64))]
    pairs = [(p, latency.predict(p, 700e-9)[0]) for p in profiles]
    assert latency.fit_step_latency(pairs) == pytest.approx(700e-9, rel=0.02)


def test_rank_correlation():
    assert latency.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1
    assert latency.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == -1
    assert math.isclose(latency.spearman([1, 2, 3], [1, 3, 2]), 0.5)


def test_a_kernel_that_fits_no_cta_per_sm_is_an_error_not_a_profile(monkeypatch):
    """A tile whose registers or shared memory leave no CTA per SM has no waves to predict: the tool
    names the kernel and what it holds (the CLI prints it as a one-line error)."""
    monkeypatch.setattr(latency, "jit_specialisation", lambda fn, args, constexprs: [dict(BLOCK_C=256)])
    monkeypatch.setattr(latency, "compile_kernel", lambda kernel, specialisation, cc: dict(
        resources(ctas_per_sm=0), shared_bytes=240 * 1024))
    launch = SimpleNamespace(kernel="post_kernel", args=(), constexprs={})
    with pytest.raises(RuntimeError, match=r"post_kernel at its tile fits no CTA on an SM of sm_90 .*240\.0 KB"):
        latency.compiled(launch, {})
    monkeypatch.setattr(latency, "compile_kernel", lambda kernel, specialisation, cc: dict(resources(),
                                                                                         shared_bytes=1024))
    assert latency.compiled(launch, {})["ctas_per_sm"] == 2


def test_cli_refuses_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "fused.tools.latency"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: TRITON_INTERPRET=1")


def test_the_step_prediction_swaps_the_measured_kernels_for_the_predicted_ones_and_for_their_dram_bytes():
    bandwidth = latency.COPY_BANDWIDTH
    result = dict(steps=dict(connections_per_step=24, res_ms=30.0, reference_ms=60.0, fused_ms={"float32": 100.0},
                             run="then"),
                  calibration=[dict(kernel="a", stream_dtype="float32", us=3000.0, run="then"),
                               dict(kernel="a", stream_dtype="float32", tile=(32, 32, 4), us=1000.0, run="then"),
                               dict(kernel="a", stream_dtype="float32", us=700.0, run="a later run")],
                  profiles=[dict(residual="mhclite", stream_dtype="float32", predicted_us=500.0, tokens=1000,
                                 dram_per_token=0.2 * bandwidth / 1e6, copy_bandwidth=bandwidth),  # 200 us of bytes
                            dict(residual="mhclite", stream_dtype="float32", predicted_us=250.0, tokens=1000,
                                 dram_per_token=0.1 * bandwidth / 1e6, copy_bandwidth=bandwidth),
                            dict(residual="hc", stream_dtype="float32", predicted_us=9999.0, tokens=1000,
                                 dram_per_token=1e9, copy_bandwidth=bandwidth)])
    [prediction] = latency.step_predictions(result)
    assert prediction["connection_us_then"] == 3000.0 and prediction["connection_us_predicted"] == 750.0
    assert prediction["step_ms_predicted"] == pytest.approx(100.0 - 24 * 2.25)
    assert prediction["x_res"] == pytest.approx(46.0 / 30.0)
    # The least the bytes allow: each kernel at its DRAM bytes, no latency.
    assert prediction["connection_us_at_dram"] == pytest.approx(300.0)
    assert prediction["step_ms_at_dram"] == pytest.approx(100.0 - 24 * 2.7)
    assert prediction["x_res_at_dram"] == pytest.approx(35.2 / 30.0)


def test_the_calibration_file_holds_what_the_step_prediction_needs():
    """step_predictions swaps the connection kernels of the measured fused step for today's: for
    each stream dtype of that step, its run holds one untiled time of every kernel the step ran
    (none counted twice), forward and backward, the same kernels in both dtypes; the tiled rows
    are tries of those kernels; every row, of any run, has a time and a complete profile to fit."""
    with open(latency.CALIBRATION, encoding="utf-8") as f:
        data = json.load(f)
    steps = data["steps"]
    rows = [r for r in data["rows"] if r["run"] == steps["run"]]
    untiled = collections.Counter((r["stream_dtype"], r["kernel"]) for r in rows if "tile" not in r)
    assert set(untiled.values()) == {1}
    kernels = {dtype: {k for d, k in untiled if d == dtype} for dtype in steps["fused_ms"]}
    assert set(kernels) == {"float32", "bfloat16"} and kernels["float32"] == kernels["bfloat16"]
    assert {"pre_kernel", "post_kernel"} < kernels["float32"] and any("backward" in k for k in kernels["float32"])
    assert all(r["kernel"] in kernels[r["stream_dtype"]] and r["programs"] > 0 for r in rows if "tile" in r)
    keys = set(latency.profile(counts(), "k", (128,), resources(), TOKENS))
    assert all(r["us"] > 0 and keys <= set(r["profile"]) for r in data["rows"])


def gpu_check_folder(folder, dry_run=False, tokens=TOKENS, modelled="NVIDIA H100 80GB HBM3"):
    """A GPU check's kernels.json and latency.json as the GPU would leave them: two mhclite kernels timed
    on a GPU whose fp32 copy ran at 3,000 GB/s, and their profiles."""
    rows = [dict(residual="mhclite", stream_dtype="float32", kernel=k, phase="forward", launches=1, ms=ms)
            for k, ms in (("pre_kernel", 0.25), ("post_kernel", 0.125))]
    kernels = dict(device_name="NVIDIA H100 80GB HBM3", date="2026-12-01T10:00:00+00:00",
                   kernels=dict(rows=rows, copies={"float32": dict(gb_per_s=3000.0)}, tokens=tokens, width=768,
                                autocast="bfloat16", dry_run=dry_run))
    profiles = [dict(latency.profile(counts(), "k", (1024,), resources(), TOKENS), residual="mhclite",
                     stream_dtype="float32", kernel=k) for k in ("pre_kernel", "post_kernel")]
    (folder / "kernels.json").write_text(json.dumps(kernels))
    machine = latency.Machine(modelled, sms=132, l2_bytes=50 * 1000 ** 2, cc=90)._asdict()
    (folder / "latency.json").write_text(json.dumps(dict(profiles=profiles, triton="3.6.0", machine=machine)))


def test_a_gpu_checks_kernel_times_join_the_calibration_with_the_profiles_and_copy_made_there(tmp_path):
    calibration = tmp_path / "calibration.json"
    with open(latency.CALIBRATION, encoding="utf-8") as f:
        before = json.load(f)
    calibration.write_text(json.dumps(before))
    gpu_check_folder(tmp_path)
    run, added = latency.add_calibration(str(tmp_path), str(calibration))
    assert (run, added) == ("NVIDIA H100 80GB HBM3, 2026-12-01, triton 3.6.0", 2)
    rows = json.loads(calibration.read_text())["rows"]
    assert rows[:-2] == before["rows"]
    pre, post = rows[-2:]
    assert (pre["kernel"], pre["us"], post["kernel"], post["us"]) == ("pre_kernel", 250.0, "post_kernel", 125.0)
    assert pre["profile"]["copy_bandwidth"] == 3e12 and pre["profile"]["kernel"] == "pre_kernel"
    # the DRAM term at that GPU's copy: 10 KB per token of 16,384 tokens at 3 TB/s
    assert latency.dram_seconds(pre["profile"]) == pytest.approx(10_000.0 * TOKENS / 3e12)
    # the same folder again replaces its run's rows
    assert latency.add_calibration(str(tmp_path), str(calibration))[1] == 2
    assert json.loads(calibration.read_text())["rows"] == rows


@pytest.mark.parametrize("fault, message", [
    ("dry run", "not timed on a GPU at M"), ("not M", "not timed on a GPU at M"),
    ("the H200's profiles", "models H200, the kernels ran on NVIDIA H100")])
def test_only_gpu_times_at_m_with_that_gpus_profiles_join_the_calibration(tmp_path, fault, message):
    gpu_check_folder(tmp_path, dry_run=fault == "dry run", tokens=16 if fault == "not M" else TOKENS,
                     modelled="H200" if fault == "the H200's profiles" else "NVIDIA H100 80GB HBM3")
    calibration = tmp_path / "calibration.json"
    calibration.write_text(open(latency.CALIBRATION, encoding="utf-8").read())
    with pytest.raises(latency.CalibrationError, match=message):
        latency.add_calibration(str(tmp_path), str(calibration))
    assert calibration.read_text() == open(latency.CALIBRATION, encoding="utf-8").read()
