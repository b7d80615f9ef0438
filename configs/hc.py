"""Hyper-Connections (dynamic, tanh) with 4 streams."""
residual = "hc"
n_streams = 4
