"""The fused kernels on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported), for the tests, the byte counter and the benchmarks' CPU dry runs; and what that takes from
Triton's private interpreter API, for the triton versions it has been run with: 3.6 (the GPU
machines') to 3.9 (CI's). Nothing here runs on a GPU.
"""

import re

SUPPORTED_VERSIONS = ((3, 6), (3, 9))  # first and last (major, minor) it has been run with


def version_problem(version) -> str | None:
    """None when triton `version` (its __version__ string) is one the interpreter hooks support."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match and SUPPORTED_VERSIONS[0] <= (int(match[1]), int(match[2])) <= SUPPORTED_VERSIONS[1]:
        return None
    first, last = (".".join(map(str, v)) for v in SUPPORTED_VERSIONS)
    return f"Triton's interpreter hooks support triton {first} to {last}, not {version}"


def fix_scalar_index():
    """Interpreted scalars are 1-element arrays; triton 3.6 turns one into a Python int (the bounds of
    `for start in range(0, C, BLOCK_C)`) with int(array), which numpy >= 2.4 refuses for arrays that
    are not 0-dimensional. Its per-launch patch of tl.tensor gets an __index__ that takes the element."""
    from triton.runtime import interpreter
    patch_lang_tensor = interpreter._patch_lang_tensor
    if getattr(patch_lang_tensor, "takes_the_element", False):
        return

    def patch_with_element_index(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_with_element_index.takes_the_element = True
    interpreter._patch_lang_tensor = patch_with_element_index


def interpret_on_cpu():
    """Let connection_forward take CPU tensors (fused.INTERPRET_ON_CPU), with the interpreter fixed
    for this triton."""
    import fused
    fix_scalar_index()
    fused.INTERPRET_ON_CPU = True
