"""One script per table/figure of the paper, plus the H_res collector (see docs/analysis.md)."""
