"""analysis/authors_agreement.py: our GPT with configs/authors.py computes what the authors' code
(FFTYYY/mhc-lite at ea19775) computes, in float64, with the same weights. Needs their checkout, named
by MHC_LITE_AUTHORS_DIR, and einops; without them only the command's error is tested."""

import importlib.util
import os

import pytest
import torch

from analysis import authors_agreement
from analysis.common import authors_settings
from conftest import one_error_line

AUTHORS_DIR = os.environ.get("MHC_LITE_AUTHORS_DIR")
needs_authors = pytest.mark.skipif(
    not AUTHORS_DIR or importlib.util.find_spec("einops") is None,
    reason="needs the authors' code and einops: set MHC_LITE_AUTHORS_DIR to a checkout "
           f"({authors_agreement.CHECKOUT}) and pip install einops")
VARIANTS = ("hc", "mhc", "mhclite")
# Measured (seed 0, both weight scales): |dloss| <= 9e-16, logits <= 1.5e-14, gradients <= 1.6e-13;
# over seeds 0-4 at most 9e-16, 2.9e-14 and 2.9e-12 (hc, x3: gradients of size 1e0).
LOSS_TOL, LOGITS_TOL, GRADS_TOL = 1e-13, 1e-12, 1e-10


def authors_dir():
    return os.path.abspath(AUTHORS_DIR)


def test_missing_authors_dir_is_one_error_line(tmp_path, capsys):
    argv = ["--authors_dir", str(tmp_path / "missing")]
    one_error_line(authors_agreement.main, argv, capsys, "missing", "git clone https://github.com/FFTYYY/mhc-lite",
                   "ea19775")


@needs_authors
@pytest.mark.parametrize("variant", VARIANTS)
def test_authors_settings_agree_in_float64(variant):
    for scale in authors_agreement.SCALES:
        r = authors_agreement.compare(authors_dir(), variant, authors_settings(), scale)
        assert r["dloss"] < LOSS_TOL and r["logits"] < LOGITS_TOL and r["grads"] < GRADS_TOL, (scale, r)
        assert r["n_grads"] == (43 if variant == "hc" else 47)


@needs_authors
def test_paper_defaults_differ():
    dloss = {variant: authors_agreement.compare(authors_dir(), variant, {}, 0.5)["dloss"] for variant in VARIANTS}
    assert max(dloss.values()) > 1e-3, dloss


@needs_authors
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_parameter_written_once(variant):
    ours = authors_agreement.our_model(variant, authors_settings(), torch.float64, 0)
    authors_agreement.move_weights(ours, 0.5, 0)
    theirs = authors_agreement.their_model(authors_dir(), variant, torch.float64, 0)
    written = authors_agreement.map_weights(ours, theirs, authors_dir())
    assert written == sorted(name for name, _ in theirs.named_parameters())
    # A bijection of entries: as many as ours (the tied embedding once in both), and none left at their init.
    assert sum(p.numel() for p in theirs.parameters()) == sum(p.numel() for p in ours.parameters())
    mapped = authors_agreement.their_layout(ours, authors_dir())
    for name, p in theirs.named_parameters():
        assert torch.equal(p, mapped[name]), name
