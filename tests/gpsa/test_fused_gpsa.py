"""The fused GPSA kernel (`convbias.gpsa.fused`) against the explicit path, forward and every gradient.

The Triton kernels run under Triton's interpreter, which needs TRITON_INTERPRET=1 in the environment
before triton is imported: those checks run in one child process (`_interpreted`), whose
measured errors the tests below assert on. The op's PyTorch reference (the CPU path without the
interpreter), its registration (fake implementation, autograd) and `torch.compile` run in this process.
"""

from pathlib import Path

import pytest
import torch
from support.gpsa_cases import randomized_gpsa
from support.interpreted import interpreted_results

from convbias import gpsa
from convbias.gpsa import fused as fused_gpsa
from convit import ConViT
from transformed_cnn import GPSAConv2d

pytestmark = pytest.mark.usefixtures("single_thread")

FP32_TOLERANCE = 2e-5  # of each tensor's largest magnitude: fp32 rounding over a few dozen terms
# bf16: the same rule as tests/gpsa/test_attention.py's oracle: within twice the error of the explicit path
# itself run in bf16 (the floor bf16 sets), or 1e-2 of the largest magnitude, whichever is larger
BF16_OVER_FLOOR, BF16_MIN_TOLERANCE = 2.0, 1e-2


def _run(module, x, *args, fused: bool = True, product: str = "fused", autocast: bool = False):
    """Output and gradients (input and every parameter) of one forward/backward with a fixed cotangent."""
    for layer in module.modules():
        if isinstance(layer, gpsa.GatedPositionalAttention):
            layer.fused, layer.positional_product = fused, product
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = module(x, *args)
    cotangent = torch.cos(torch.arange(out.numel(), dtype=torch.float32)).to(torch.bfloat16).view_as(out)
    out.backward(cotangent.to(out.dtype))
    results = {"out": out.detach().float(), "x": x.grad.float()}
    params = module.named_parameters()
    results.update({name.removeprefix("_orig_mod."): p.grad.float() for name, p in params if p.grad is not None})
    return results


def _relative_errors(got: dict, want: dict) -> dict:
    """Largest error per tensor as a fraction of the reference's largest magnitude; pos_proj's bias
    (whose exact gradient is 0: it cancels in the softmax) on the weight's scale."""
    scales = {name: want[name].abs().max().item() for name in want}
    for name in scales:
        if name.endswith("pos_proj.bias"):
            scales[name] = scales[name.replace(".bias", ".weight")]
    assert min(scales.values()) > 0, "a reference gradient is all zeros: the comparison would be empty"
    return {name: (got[name] - want[name]).abs().max().item() / scales[name] for name in want}


def interpreted_checks() -> dict:
    """Run in the child process (TRITON_INTERPRET=1): errors of the fused kernel against the references."""
    import triton

    torch.set_num_threads(1)
    jitted, jit = [], triton.jit

    def recorded_jit(fn=None, **options):  # the kernels the layers' launches make (`triton.jit`, on first use)
        jitted.extend([fn.__name__] if fn is not None else [])
        return jit(fn, **options)

    triton.jit = recorded_jit
    results = {}
    # a ConViT layer: 35 tokens (5 x 7), 2 heads of 16; fp32 and bf16 against the explicit path in fp32
    layer = randomized_gpsa(dim=32, heads=2)
    x = torch.randn(2, 35, 32)
    reference = _run(layer, x, (5, 7), fused=False)
    results["gpsa_fp32"] = {"fused": _relative_errors(_run(layer, x, (5, 7)), reference)}
    layer = randomized_gpsa(dim=64, heads=4, seed=1)  # 49 tokens, 4 heads of 16
    x = torch.randn(2, 49, 64)
    reference = _run(layer, x, (7, 7), fused=False)
    results["gpsa_bf16"] = {
        "fused": _relative_errors(_run(layer, x, (7, 7), autocast=True), reference),
        "explicit": _relative_errors(_run(layer, x, (7, 7), fused=False, autocast=True), reference),
    }
    # a Transformed CNN layer: 9 heads sharing one value, strided queries (3 x 4 over a padded 7 x 9: two key
    # blocks, the second partial; the interpreter's cost is its programs, one per key block, image and head)
    torch.manual_seed(2)
    conv = GPSAConv2d(18, 12, stride=2)
    with torch.no_grad():
        conv.qk.weight.normal_(0, 0.5)
        conv.gating_param.uniform_(-2, 2)
    x = torch.randn(2, 18, 5, 7)
    results["tcnn_fp32"] = {"fused": _relative_errors(_run(conv, x), _run(conv, x, product="kronecker"))}
    # a small ConViT, every GPSA block fused, against the default product
    torch.manual_seed(3)
    model = ConViT(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, local_up_to_layer=1, num_classes=5)
    x = torch.randn(2, 3, 16, 16)
    results["convit_fp32"] = {"fused": _relative_errors(_run(model, x), _run(model, x, product="auto"))}
    triton.jit = jit
    # the interpreter's kernels ran (made on their first launch), not the PyTorch reference
    results["kernel_ran"] = {"forward_kernel", "key_grad_kernel", "query_grad_kernel"} <= set(jitted)
    return results


def _interpreted() -> dict:
    return interpreted_results(Path(__file__), timeout=300)


@pytest.mark.slow
@pytest.mark.integration
def test_triton_kernels_under_the_interpreter_match_in_fp32_and_bf16():
    """One test, so that one child process runs every interpreter check whatever the test distribution.
    fp32: a ConViT layer against the explicit path, a strided T-CNN layer (shared value) and a whole
    ConViT against the default product; output, input gradient and every parameter's gradient within
    FP32_TOLERANCE. bf16 autocast: a ConViT layer against the explicit path in fp32, each tensor within
    twice the explicit path's own bf16 error (or 1e-2 of its largest magnitude)."""
    interpreted = _interpreted()
    assert interpreted["kernel_ran"]  # the interpreter's kernels ran, not the PyTorch reference
    failures = []
    for case in ("gpsa_fp32", "tcnn_fp32", "convit_fp32"):
        errors = interpreted[case]["fused"]
        for wanted in ("out", "x", "gating_param", "pos_proj.weight", "qk.weight", "v.weight"):
            assert any(name.endswith(wanted) for name in errors), (case, wanted)
        failures += [f"{case}: {n} off by {e:.2e}" for n, e in errors.items() if not e < FP32_TOLERANCE]
    errors, floor = interpreted["gpsa_bf16"]["fused"], interpreted["gpsa_bf16"]["explicit"]
    for name, error in errors.items():
        if not error < max(BF16_OVER_FLOOR * floor[name], BF16_MIN_TOLERANCE):
            failures.append(f"bf16: {name} off by {error:.2e} (explicit path in bf16: {floor[name]:.2e})")
    assert not failures, "\n".join(failures)


def test_reference_path_matches_the_explicit_path():
    """Without the interpreter a CPU runs the op's PyTorch reference: the same function."""
    layer = randomized_gpsa(dim=32, heads=4)
    x = torch.randn(2, 20, 32)
    errors = _relative_errors(_run(layer, x, (4, 5)), _run(layer, x, (4, 5), fused=False))
    for name, error in errors.items():
        assert error < FP32_TOLERANCE, f"{name} off by {error:.2e}"


@pytest.mark.slow
def test_custom_op_registration_passes_opcheck():
    """Schema, fake (meta) implementation and autograd registration, as torch.compile relies on them."""
    torch.manual_seed(0)
    heads = 2
    q, k = torch.randn(2, heads, 12, 8), torch.randn(2, heads, 20, 8)
    v = torch.randn(2, 1, 20, 6, requires_grad=True)
    rows = torch.rand(heads, 3, 4).softmax(-1).requires_grad_()
    cols = torch.rand(heads, 4, 5).softmax(-1).requires_grad_()
    gate = torch.rand(heads, requires_grad=True)
    args = (q.requires_grad_(), k.requires_grad_(), v, rows, cols, gate)
    torch.library.opcheck(fused_gpsa.gpsa_fused_attention, args)


@pytest.mark.slow
def test_backward_op_fake_strides_match_for_permuted_inputs():
    """The layer's q, k and v are views of one permuted qkv tensor: the backward's fake implementation
    must give the strides the real one returns, or inductor's stride assertions fail at run time."""
    torch.manual_seed(0)
    heads = 2
    q, k, v = torch.randn(2, 12, 3, heads, 8).permute(2, 0, 3, 1, 4)
    rows, cols, gate = torch.rand(heads, 3, 4).softmax(-1), torch.rand(heads, 4, 3).softmax(-1), torch.rand(heads)
    out, content, lse = fused_gpsa.gpsa_fused_attention(q, k, v, rows, cols, gate)
    args = (torch.randn_like(out), q, k, v, gate, content, lse)
    torch.library.opcheck(fused_gpsa.gpsa_fused_attention_backward, args)


def test_fused_layer_compiles_to_one_graph():
    """torch.compile(fullgraph=True) raises on any graph break; aot_eager traces forward and backward
    through the op's fake implementation and registered autograd, as inductor receives them."""
    layer = randomized_gpsa(dim=24, heads=4)
    x = torch.randn(2, 20, 24)
    eager = _run(layer, x, (4, 5))
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    explained = torch._dynamo.explain(layer)(x, (4, 5))
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    errors = _relative_errors(_run(compiled, x, (4, 5)), eager)
    for name, error in errors.items():
        assert error < 1e-5, f"{name} off by {error:.2e}"


def test_values_too_wide_for_the_kernel_fall_back_to_the_factored_product(monkeypatch):
    """A Transformed CNN layer whose value (C_in per head) exceeds FUSED_MAX_VALUE_WIDTH takes the
    unfused schedule: the same result as "kronecker", and the kernel is never called."""
    calls = []
    monkeypatch.setattr(fused_gpsa, "fused_gated_attention", lambda *args: calls.append(args))
    torch.manual_seed(0)
    conv = GPSAConv2d(fused_gpsa.FUSED_MAX_VALUE_WIDTH + 1, 4)
    x = torch.randn(1, fused_gpsa.FUSED_MAX_VALUE_WIDTH + 1, 5, 5)
    errors = _relative_errors(_run(conv, x), _run(conv, x, product="kronecker"))
    assert not calls and max(errors.values()) == 0.0


def _has_triton_cuda_backend() -> bool:
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


# a GPU architecture to compile for without one (compute capability 9.0: an H100 / H200)
HOPPER = 90


@pytest.mark.skipif(not _has_triton_cuda_backend(), reason="needs triton's CUDA backend (ptxas)")
def test_kernels_compile_for_a_cuda_gpu_without_one():
    """The interpreter checks the kernels' arithmetic, not that Triton's compiler accepts them: each is
    compiled here to a cubin for sm_90 (bf16, the GPU path's block sizes), and its bf16 dots become
    tensor-core mma instructions."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    from convbias.gpsa import fused_kernels

    fp32_pointers = {"rows_ptr", "cols_ptr", "gate_ptr", "lse_ptr", "delta_ptr"}
    constants = {
        "BLOCK_M": fused_gpsa.GPU_BLOCK_M,
        "BLOCK_N": fused_gpsa.GPU_BLOCK_N,
        "BLOCK_D": 16,
        "BLOCK_DV": fused_gpsa.GPU_WIDE_VALUE_BLOCK,
        "PRECISION": "tf32",
        "DOT_DTYPE": tl.bfloat16,
    }
    for name in ("forward_kernel", "key_grad_kernel", "query_grad_kernel"):
        kernel = triton.jit(getattr(fused_kernels, name))
        signature = {}
        for arg in kernel.arg_names:
            if arg in constants:
                signature[arg] = "constexpr"
            elif arg.endswith("_ptr"):
                signature[arg] = "*fp32" if arg in fp32_pointers else "*bf16"
            else:
                signature[arg] = "fp32" if arg == "scale" else "i32"
        compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", HOPPER, 32))
        assert compiled.asm["cubin"] and "mma" in compiled.asm["ptx"], name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_kernel_on_cuda_matches_the_explicit_path_in_fp32():
    """The compiled Triton kernels (not the interpreter) at ConViT-Ti's layer shape, 196 tokens over
    several 64-token blocks; bf16 is the oracle's in tests/gpsa/test_attention.py (every product, CUDA too)."""
    layer = randomized_gpsa(dim=192, heads=4).cuda()
    x = torch.randn(8, 196, 192, device="cuda")

    def run(fused: bool) -> dict:
        for attention in layer.modules():
            if isinstance(attention, gpsa.GatedPositionalAttention):
                attention.fused, attention.positional_product = fused, "fused"
        layer.zero_grad(set_to_none=True)
        inputs = x.clone().requires_grad_(True)
        out = layer(inputs, (14, 14))
        out.backward(torch.cos(torch.arange(out.numel(), device="cuda", dtype=torch.float32)).view_as(out))
        return {"out": out.detach(), "x": inputs.grad, **{n: p.grad for n, p in layer.named_parameters()}}

    errors = _relative_errors({k: v.cpu() for k, v in run(True).items()}, {k: v.cpu() for k, v in run(False).items()})
    for name, error in errors.items():
        assert error < 1e-4, f"{name} off by {error:.2e}"
