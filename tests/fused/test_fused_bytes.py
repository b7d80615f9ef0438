"""The byte counter (python -m fused.tools.count_bytes) and the fused path's budget: per token and
connection, forward + backward, at most 7 nCs + 16 C bytes (n = 4, C = 768) for every variant and
stream dtype, read from fused/tools/kernel_bytes.json, which fresh counts keep equal to the kernels. The
kernels run in Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET)."""

import json
import os

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the byte counter needs Triton's interpreter (TRITON_INTERPRET=1)", allow_module_level=True)

import triton.language as tl  # noqa: E402

import fused  # noqa: E402
from benchmarks import kernels as bench_kernels  # noqa: E402
from fused import ops  # noqa: E402
from fused.tools import count_bytes  # noqa: E402
from residuals import RESIDUALS  # noqa: E402


@triton.jit
def copy_twice_kernel(src_ptr, dst_ptr, count, BLOCK: tl.constexpr):
    """Reads every element of src twice (the second read counts nothing) and writes dst."""
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = index < count
    first = tl.load(src_ptr + index, mask=ok)
    again = tl.load(src_ptr + index, mask=ok)
    tl.store(dst_ptr + index, first + again, mask=ok)


@triton.jit
def read_write_one_kernel(ptr):
    """Unmasked load and store of one address: one read and one write."""
    tl.store(ptr, tl.load(ptr) + 1)


def test_kernel_counter_counts_each_address_once_per_launch_and_direction():
    counter = count_bytes.KernelBytes()
    src, dst = torch.ones(37), torch.zeros(37, dtype=torch.bfloat16)
    with counter.patched():
        with counter.launch("copy"):
            copy_twice_kernel[(3,)](src, dst, 37, BLOCK=16)  # 48 lanes, 11 masked off
        with counter.launch("copy"):
            copy_twice_kernel[(1,)](src, dst, 5, BLOCK=16)
        with counter.launch("one"):
            read_write_one_kernel[(4,)](src)  # four programs, one address
    assert counter.bytes == {"copy": 37 * 4 + 37 * 2 + 5 * 4 + 5 * 2, "one": 4 + 4}
    assert torch.equal(dst[:37].float(), torch.full((37,), 2.0))


@triton.jit
def read_apart_kernel(src_ptr, pad_ptr, dst_ptr, BLOCK: tl.constexpr, PAD: tl.constexpr, PAD_STRIDE: tl.constexpr,
                      PAD_READS: tl.constexpr = 1):
    """Reads src, then PAD elements of pad (from program_id x PAD_STRIDE on) PAD_READS times, then
    src again (the re-read), and writes dst."""
    index = tl.arange(0, BLOCK)
    first = tl.load(src_ptr + index)
    between = 0.0
    for _ in tl.static_range(PAD_READS):
        between += tl.sum(tl.load(pad_ptr + tl.program_id(0) * PAD_STRIDE + tl.arange(0, PAD)))
    again = tl.load(src_ptr + index)
    tl.store(dst_ptr + index, first + again + between)


def test_executed_bytes_count_repeats_and_rereads_know_their_distance():
    counter = count_bytes.KernelBytes()
    src, dst = torch.ones(37), torch.zeros(37, dtype=torch.bfloat16)
    with counter.patched():
        with counter.launch("copy"):
            copy_twice_kernel[(3,)](src, dst, 37, BLOCK=16)
    # src read twice, dst written once: executed / unique is (2 * 4 + 2) / (4 + 2)
    assert counter.executed["copy"] == 2 * 37 * 4 + 37 * 2
    assert counter.executed["copy"] / counter.bytes["copy"] == pytest.approx(10 / 6)
    assert counter.loads["copy"] == 2 * 3  # two loads in each of three programs
    assert sum(counter.rereads["copy"].values()) == 37 * 4  # nothing in between: distance 1, bucket 0
    assert set(counter.rereads["copy"]) == {0}

    counter = count_bytes.KernelBytes()
    src, pad, dst = torch.ones(16), torch.ones(4 * 256), torch.zeros(16)
    with counter.patched():
        with counter.launch("apart"):  # four programs read the same src, each its own quarter of pad
            read_apart_kernel[(4,)](src, pad, dst, BLOCK=16, PAD=256, PAD_STRIDE=256)
        with counter.launch("shared"):  # the same, every program reading the first quarter of pad
            read_apart_kernel[(4,)](src, pad, dst, BLOCK=16, PAD=256, PAD_STRIDE=0)
    assert counter.bytes["apart"] == 16 * 4 + 4 * 256 * 4 + 16 * 4
    assert counter.bytes["shared"] == 16 * 4 + 256 * 4 + 16 * 4
    for name in ("apart", "shared"):
        assert counter.executed[name] == 4 * (2 * 16 * 4 + 256 * 4 + 16 * 4)
        assert counter.loads[name] == 4 * 3
    # Within a program, src comes back after the 1024 bytes of its own pad: distance 2^10; programs
    # never count each other's reads (nor pad and dst, touched once per program).
    assert counter.rereads["apart"] == {10: 4 * 16 * 4}
    # Bytes every program reads (a weight) take L2 once for all and count in no distance: 1, bucket 0.
    assert counter.rereads["shared"] == {0: 4 * 16 * 4}

    counter = count_bytes.KernelBytes()
    with counter.patched():
        with counter.launch("pad twice"):
            read_apart_kernel[(4,)](src, pad, dst, BLOCK=16, PAD=256, PAD_STRIDE=256, PAD_READS=2)
    # The distance is an LRU cache's: the pad read twice in between takes 1024 bytes of room, not
    # 2048; its own second read follows its first directly (bucket 0).
    assert counter.rereads["pad twice"] == {10: 4 * 16 * 4, 0: 4 * 256 * 4}


def test_torch_counter_counts_inputs_and_outputs_but_not_views_or_allocations():
    a, b = torch.ones(10), torch.ones(10, dtype=torch.float64)
    with count_bytes.TorchBytes() as counter:
        c = a + b  # 40 + 80 read, 80 written
        c.view(2, 5).t()  # views
        torch.empty(1000)  # allocation
        a.new_zeros(()).expand(100)  # a fill of 4 bytes, then a view
    assert c.dtype == torch.float64
    assert counter.bytes == 40 + 80 + 80 + 4


def test_the_reference_path_is_counted_op_by_op():
    """residuals.py's connection under bf16 autocast, its aten ops counted the same way: more than
    the fused path's floor, and x's cast to bf16 for the projection GEMM among its ops."""
    entry = count_bytes.reference_bytes_per_token("mhclite", torch.float32, token_counts=(16, 32))
    floor = count_bytes.budget(torch.float32)
    assert entry["total"] == pytest.approx(entry["forward"] + entry["backward"]) and entry["total"] > floor
    assert entry["total"] == pytest.approx(sum(entry["ops"].values()))
    stream = count_bytes.N_STREAMS * count_bytes.WIDTH * 4
    assert entry["ops"]["_to_copy"] >= stream * 6 // 4  # x (fp32) read and written as bf16, at least once


def test_compiled_counter_counts_each_generated_kernels_buffers_once():
    """x -> 2 x -> an opaque branch -> + 3 x: inductor makes one kernel before the branch (reads x,
    writes 2 x: 8 bytes per element) and one after it (reads the branch's bf16 output and x again,
    writes the sum: 10); backward, one that casts g to bf16 for the branch's backward (6) and one
    that adds 3 g to what that returns (12). The branch's own kernels are left out."""
    tokens, width = 64, 256
    x = torch.zeros(tokens, width, requires_grad=True)  # only scheduled: no values are read
    kernels = count_bytes.compiled_kernel_bytes(lambda x: count_bytes.compiled_stand_in_branch(x * 2).float() + x * 3, x)
    per_element = [(phase, moved / (tokens * width)) for phase, _, moved, _ in kernels if moved]
    assert per_element == [("forward", 8), ("forward", 10), ("backward", 6), ("backward", 12)]


@pytest.fixture(scope="module")
def compiled_mhclite():
    """One mhclite connection compiled as on CUDA (fp32 streams, bf16 autocast): its bytes and kernels."""
    return count_bytes.compiled_bytes_per_token("mhclite", torch.float32)


def test_compiled_reference_path_passes_over_the_streams_at_most_so_often(compiled_mhclite):
    """residuals.py compiled as on CUDA (mhclite, fp32 streams, bf16 autocast), scheduled by
    inductor's CUDA backend, in passes over the n x C streams (nCs bytes). Forward 5.5: x read once
    for its bf16 copy and the RMS factor together (the bf16 copy written: 1.5; inductor's CPU backend
    reads x apart for the RMS factor: 6.5), the copy read by the GEMM (0.5), x for u, and x for the
    add after the branch, which writes x_next. Backward 9.5 with torch 2.13: x and g for the mixing's
    coefficient grads, g for grad y, x for h_pre's, the forward's bf16 copy read by grad W's GEMM
    (0.5; cast again it was 2), the projection's gradient (0.5), and grad x written once from g, x,
    grad u and that gradient (3.5); torch 2.11's inductor writes h_res^T g apart and reads it back
    (10.5). u and h_res x as one product of the stacked coefficients made it 15.4: its gradient was
    concatenated and read twice more."""
    entry = compiled_mhclite
    stream = count_bytes.N_STREAMS * count_bytes.WIDTH * 4
    assert entry["forward"] <= 5.5 * stream
    assert entry["backward"] <= 10.5 * stream
    assert entry["total"] == pytest.approx(sum(moved for _, _, moved in entry["kernels"]))


def test_compiled_reference_connection_stays_within_its_kernel_budget(compiled_mhclite):
    """The kernels inductor's CUDA backend makes of one mhclite connection (fp32 streams, bf16
    autocast), forward and backward, as a budget: 7 streaming (the RMS factor with x's bf16 copy, u,
    h_res x with the post add; backward the coefficient grads that read g, grad y, h_pre's grad,
    grad x), 3 GEMMs (the projection, grad W, the projection's grad x) and 19 tiny ones on the
    (T, <= 32) coefficients and the parameters (23 when each scale and bias had its own
    multiply-add, and its own reductions backward)."""
    _, streaming, library, tiny = count_bytes.kernel_counts(compiled_mhclite)
    assert streaming <= 7 and library <= 3 and tiny <= 19


@pytest.mark.parametrize("stream_dtype", [torch.float32, torch.bfloat16])
def test_compiled_the_fused_path_adds_no_pass_over_the_streams_around_its_ops(stream_dtype):
    """The fused connection compiled as on CUDA: besides its custom ops, whose traffic the
    interpreter counts, inductor makes only kernels on the parameters (their packing, the sum of
    grad W's splits), none of which grows with the tokens: compiling adds no copy or cast of the
    streams around the kernels."""
    def build(tokens):
        module = RESIDUALS["mhclite"](count_bytes.WIDTH, count_bytes.N_STREAMS, 1)
        x = torch.zeros(1, tokens, count_bytes.N_STREAMS, count_bytes.WIDTH, dtype=stream_dtype, requires_grad=True)

        def connection(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fused.connection_forward(module, x, count_bytes.compiled_stand_in_branch)
        return connection, x
    entry = count_bytes.compiled_slope(build)
    around = [(phase, made_from, moved) for phase, made_from, moved in entry["kernels"]
              if not any(op.startswith("hcfused.") for op in made_from)]
    assert around and all(moved == 0 for _, _, moved in around)
    assert any(moved > count_bytes.budget(stream_dtype) / 16 for _, _, moved in entry["kernels"])


@pytest.mark.slow
def test_in_a_block_the_connections_move_no_more_than_alone(compiled_mhclite):
    """One compiled Block with mhclite's two connections moves more than res's Block by at most twice
    what one connection moves alone (the difference leaves out res's own adds, and inductor may fuse
    across a connection's edges) and by at least 3 nCs per connection (the floor is 7)."""
    block = count_bytes.compiled_block_bytes_per_token("mhclite", torch.float32)
    res_block = count_bytes.compiled_block_bytes_per_token("res", torch.float32)
    alone = compiled_mhclite
    stream = count_bytes.N_STREAMS * count_bytes.WIDTH * 4
    assert 2 * 3 * stream <= block["total"] - res_block["total"] <= 2 * alone["total"]
    assert block["total"] == pytest.approx(block["forward"] + block["backward"])


CARRIED = bench_kernels.read_kernel_bytes(bench_kernels.KERNEL_BYTES)
# One fresh count at the shipped tiles per kernel code path (hc's, the manifold variants') and stream dtype.
FRESH = [("hc", "float32"), ("mhclite", "bfloat16")]


@pytest.fixture(scope="module")
def fresh():
    """{(residual, stream dtype): entry} counted now in the interpreter, as the CLI counts them."""
    return {(residual, dtype): count_bytes.count_all([residual], [dtype])[residual][dtype] for residual, dtype in FRESH}


@pytest.mark.parametrize("residual, stream_dtype", FRESH)
def test_the_kernel_bytes_file_the_gpu_check_carries_is_a_fresh_count(fresh, residual, stream_dtype):
    """fused/tools/kernel_bytes.json (python -m fused.tools.count_bytes --json fused/tools/kernel_bytes.json)
    is what python -m benchmarks.kernels reads on the GPU machine, where the interpreter never runs, and
    what the budget tests below read: every number of it equal to a fresh count, unique and executed
    bytes, load instructions and re-reads by distance (what fused.tools.latency reads)."""
    assert set(CARRIED) == set(count_bytes.VARIANTS)
    assert all(set(per_dtype) == set(count_bytes.STREAM_DTYPES) for per_dtype in CARRIED.values())
    carried, counted = CARRIED[residual][stream_dtype], fresh[residual, stream_dtype]
    assert set(carried) == set(counted)
    for key in ("kernels", "executed", "loads", "torch", "forward", "backward", "total", "executed_total",
                "per_split_at_m", "executed_per_split_at_m"):
        assert carried[key] == pytest.approx(counted[key]), key
    assert carried["rereads"].keys() == counted["rereads"].keys()
    for kernel, by_distance in counted["rereads"].items():
        assert carried["rereads"][kernel] == pytest.approx(by_distance), kernel
    for kernel, unique in counted["kernels"].items():
        assert counted["executed"][kernel] >= unique, kernel


@pytest.mark.parametrize("stream_dtype", list(count_bytes.STREAM_DTYPES))
@pytest.mark.parametrize("residual", count_bytes.VARIANTS)
def test_bytes_per_token_within_the_floor_and_one_more_pass(residual, stream_dtype):
    """The forward within its share of the floor (3 nCs and the floor's 16 C of vectors). The backward
    passes over the streams 5 times where the floor has 4: post_backward reads g, the grad-x kernel
    reads x and g (its second pass over them is served by L2: executed, not unique, bytes) and writes
    grad x, the grad-W kernel reads x again (a token block's program would need a weight-sized
    partial of its own). In all at most the floor plus that nCs and 4 C. From the carried file."""
    entry = CARRIED[residual][stream_dtype]
    floor = count_bytes.budget(count_bytes.STREAM_DTYPES[stream_dtype])
    stream = count_bytes.N_STREAMS * count_bytes.WIDTH * torch.finfo(count_bytes.STREAM_DTYPES[stream_dtype]).bits // 8
    assert entry["forward"] <= 3 * stream + 16 * count_bytes.WIDTH, f"{residual} {stream_dtype}: {entry['forward']:.0f}"
    assert entry["backward"] <= 5 * stream + 16 * count_bytes.WIDTH, \
        f"{residual} {stream_dtype}: {entry['backward']:.0f}"
    assert entry["total"] <= floor + stream + 4 * 4 * count_bytes.WIDTH, \
        f"{residual} {stream_dtype}: {entry['total']:.0f} > {floor} + nCs + 4 C bytes per token"
    assert set(entry["kernels"]) == {"pre_kernel", "post_kernel", "post_backward_kernel", "pre_backward_grad_x_kernel",
                                     "pre_backward_weight_kernel"}
    assert entry["total"] == pytest.approx(entry["forward"] + entry["backward"])
    assert entry["forward"] + entry["backward"] == pytest.approx(sum(entry["kernels"].values()) + entry["torch"])
    # The floor's own terms: x read twice and x_next written once forward, 4 full passes backward.
    assert entry["forward"] >= 3 * stream and entry["backward"] >= 4 * stream


def test_cli_writes_the_json_schema(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(count_bytes, "count_all", lambda residuals, dtypes: {
        r: {d: CARRIED[r][d] for d in dtypes} for r in residuals})
    path = tmp_path / "bytes.json"
    count_bytes.main(["--json", str(path), "--residuals", "mhclite", "--stream_dtypes", "bfloat16"])
    data = json.loads(path.read_text())
    assert data == {"mhclite": {"bfloat16": CARRIED["mhclite"]["bfloat16"]}}
    assert "| mhclite | bfloat16 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        count_bytes.main(["--residuals", "res"])


def test_the_backward_kernels_execute_little_beyond_their_unique_bytes():
    """No weight-sized partial re-read per token block (the single kernel these replaced executed 3.5 x
    its unique bytes, 49 KB per token of it such re-reads): beyond the bytes they touch, the grad-x
    kernel executes its second pass over x, g and grad u and the weight once per token block, and
    the grad-W kernel the re-reads of each token's grad z (at most 64 fp32), one per further channel
    block. From the carried file."""
    record = 64 * 4
    for residual, per_dtype in CARRIED.items():
        module = RESIDUALS[residual](count_bytes.WIDTH, count_bytes.N_STREAMS, 1)
        _, weight, _, _, _, _ = fused.packed_parameters(module)
        for stream_dtype, entry in per_dtype.items():
            stream = count_bytes.N_STREAMS * count_bytes.WIDTH * count_bytes.STREAM_DTYPES[stream_dtype].itemsize
            extra = {k: entry["executed"][k] - entry["kernels"][k] for k in entry["kernels"]}
            second_pass = 2 * stream + 4 * count_bytes.WIDTH
            weight_per_token = 2 * weight.numel() / ops.TILES["pre_backward_grad_x_kernel"]["BLOCK_T"]  # bf16
            assert extra["pre_backward_grad_x_kernel"] <= second_pass + weight_per_token + record, \
                (residual, stream_dtype, extra)
            channel_blocks = -(-count_bytes.WIDTH // ops.TILES["pre_backward_weight_kernel"]["BLOCK_C"])
            assert extra["pre_backward_weight_kernel"] <= (channel_blocks - 1) * record, (residual, stream_dtype, extra)


@pytest.mark.parametrize("residual", count_bytes.VARIANTS)
def test_each_token_split_moves_its_weight_sized_bytes_once(residual):
    """Each token split of the grad-W kernel writes its partial once (no zero fill, never re-read
    per token block) and the sum reads it once: at M's tokens per micro-step that is per_split_at_m,
    executed as counted. From the carried file."""
    module = RESIDUALS[residual](count_bytes.WIDTH, count_bytes.N_STREAMS, 1)
    _, weight, _, _, _, _ = fused.packed_parameters(module)
    weight_splits = count_bytes.splits_at_m("WEIGHT_GRAD_SPLITS")
    one_split = ops.partial_bytes_per_split(weight)
    assert one_split == 2 * weight.numel() * 4
    for stream_dtype in count_bytes.STREAM_DTYPES:
        entry = CARRIED[residual][stream_dtype]
        assert entry["per_split_at_m"] == weight_splits * one_split / count_bytes.M_TOKENS
        assert entry["executed_per_split_at_m"] == entry["per_split_at_m"]
