"""Triton kernels for the HC-family connections (placeholder until the kernels land)."""


def supported(module, x) -> bool:
    return False


def connection_forward(module, x, branch):
    raise NotImplementedError
