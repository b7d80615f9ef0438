"""python -m benchmarks.compile_time: each variant's compile probed in a fresh process, cold then warm."""

import json

import pytest

from benchmarks import compile_time
from conftest import one_error_line

FLAGS = ["--size", "tiny", "--device", "cpu", "--batch_size", "2", "--block_size", "16", "--vocab_size", "96",
         "--steps", "2", "--seed", "3"]


@pytest.mark.slow
def test_compile_time_probes_a_cold_then_a_warm_cache(tmp_path, capsys):
    """Each variant's compile is probed in a fresh process on empty caches, then in a second process
    on the caches the first filled: the second must find the compiled graphs there."""
    out = tmp_path / "compile.json"
    # block by block: the fewest graphs to compile (one Block, the head)
    compile_time.main(FLAGS + ["--residuals", "res", "--recompute", "off", "--compile_mode", "blocks",
                               "--json", str(out)])
    probe = json.loads(out.read_text())["compile_time"]["res"]
    assert probe["graphs"] == 2
    assert 0 < probe["warm_compile_s"] < 0.5 * probe["compile_s"]
    assert probe["warm_first_step_s"] < probe["first_step_s"]
    assert "| warm-cache compile s |" in capsys.readouterr().out


def test_bad_input_is_one_error_line(capsys):
    assert "unknown residual 'foo'" in one_error_line(compile_time.main, FLAGS + ["--residuals", "foo"], capsys)
