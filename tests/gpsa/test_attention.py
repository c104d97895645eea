"""GPSA / MHSA layers: hot path vs reference path, timm's layers as oracle, convolutional init, grids."""

import math

import pytest
import torch
from support.gpsa_cases import randomized_gpsa
from timm.models import convit as timm_convit
from torch.utils._python_dispatch import TorchDispatchMode

from convbias import gpsa
from convbias.gpsa import (
    PositionalFactors,
    gated_attention,
    grid_positions,
    kernel_offsets,
    paper_kernel_offsets,
    positional_mix,
    relative_encodings,
)
from convit import GPSA, MHSA, ConViT
from transformed_cnn import GPSAConv2d

pytestmark = pytest.mark.usefixtures("single_thread")


def _cotangent(out: torch.Tensor) -> torch.Tensor:
    """A non-trivial cotangent on the output's device, the same values whatever the output's dtype: made
    in float32 (integers above 256 are not exact in bf16) and rounded to bf16, which every dtype holds."""
    values = torch.cos(torch.arange(out.numel(), dtype=torch.float32, device=out.device)).to(torch.bfloat16)
    return values.view_as(out).to(out.dtype)


def _output_and_grads(layer: GPSA, x: torch.Tensor, grid_size, fused: bool, product: str = "auto"):
    layer.fused = fused
    layer.positional_product = product
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = layer(x, grid_size)
    out.backward(_cotangent(out))
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    return out.detach(), x.grad, grads


@pytest.mark.parametrize("product", ["kronecker", "dense"])
@pytest.mark.parametrize("grid_size", [(4, 4), (3, 5)])
def test_hot_path_matches_reference_path_in_outputs_and_gradients(grid_size, product):
    layer = randomized_gpsa(dim=24, heads=4).double()
    x = torch.randn(3, grid_size[0] * grid_size[1], 24, dtype=torch.float64)
    out_fused, dx_fused, grads_fused = _output_and_grads(layer, x, grid_size, fused=True, product=product)
    out_ref, dx_ref, grads_ref = _output_and_grads(layer, x, grid_size, fused=False)
    torch.testing.assert_close(out_fused, out_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(dx_fused, dx_ref, rtol=0, atol=1e-5)
    assert set(grads_fused) == {
        "qk.weight",
        "v.weight",
        "proj.weight",
        "proj.bias",
        "pos_proj.weight",
        "pos_proj.bias",
        "gating_param",
    }
    for name in grads_fused:
        torch.testing.assert_close(grads_fused[name], grads_ref[name], rtol=0, atol=1e-5, msg=name)
    assert grads_fused["gating_param"].abs().min() > 0  # the gate really is on the gradient path


def test_shared_value_path_matches_per_head_values():
    """gated_attention with one value for all heads (B, 1, N, dv) equals the expanded per-head value."""
    torch.manual_seed(0)
    b, h, n, d = 2, 4, 12, 5
    q, k = torch.randn(2, b, h, n, d, dtype=torch.float64)
    v = torch.randn(b, 1, n, 7, dtype=torch.float64)
    factors = PositionalFactors(
        rows=torch.randn(h, 3, 3, dtype=torch.float64).softmax(-1),
        cols=torch.randn(h, 4, 4, dtype=torch.float64).softmax(-1),
    )
    pos = factors.dense()
    gate = torch.rand(h, dtype=torch.float64)
    shared = gated_attention(q, k, v, factors, gate)
    expanded = gated_attention(q, k, v.expand(-1, h, -1, -1).contiguous(), factors, gate)
    content = (q @ k.transpose(-2, -1) / d**0.5).softmax(-1)
    explicit = ((1 - gate.view(1, h, 1, 1)) * content + gate.view(1, h, 1, 1) * pos) @ v
    torch.testing.assert_close(shared, expanded)
    torch.testing.assert_close(shared, explicit)


@pytest.mark.parametrize(
    "value_heads, split_k, product",
    [(3, False, "kronecker"), (1, False, "kronecker"), (3, True, "kronecker"), (1, True, "kronecker")]
    + [(3, False, "dense"), (1, True, "dense")],  # each product with both values and both contractions
    ids=lambda value: (
        {False: "cpu-schedule", True: "gpu-split-k"}.get(value, value) if isinstance(value, bool) else None
    ),
)
def test_factored_hot_path_gradients_on_a_strided_query_grid(value_heads, split_k, product, monkeypatch):
    """The custom backward against finite differences, for every input, on a T-CNN-like geometry:
    fewer query rows/columns than key rows/columns, per-head or shared value (dv < Nq), P applied in
    factors or dense. With split_k the gradients of P (or its factors) take the GPU's split-K contraction
    (forced here on the CPU, smallest split)."""
    if split_k:
        monkeypatch.setattr(
            positional_mix,
            "split_count",
            lambda length, device: next(n for n in range(2, length + 1) if length % n == 0),
        )
    torch.manual_seed(0)
    b, h, d, dv = 2, 3, 4, 5
    (qy, ky), (qx, kx) = (2, 4), (3, 5)
    q = torch.randn(b, h, qy * qx, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, h, ky * kx, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, value_heads, ky * kx, dv, dtype=torch.float64, requires_grad=True)
    rows = torch.randn(h, qy, ky, dtype=torch.float64).softmax(-1).requires_grad_(True)
    cols = torch.randn(h, qx, kx, dtype=torch.float64).softmax(-1).requires_grad_(True)
    gate = torch.rand(h, dtype=torch.float64, requires_grad=True)
    assert dv < qy * qx  # the factored schedule, not the mixed one

    def attention(q, k, v, rows, cols, gate):
        return gated_attention(q, k, v, PositionalFactors(rows, cols), gate, product)

    assert torch.autograd.gradcheck(attention, (q, k, v, rows, cols, gate))


@pytest.mark.parametrize("splits", [1, 3, 12])
def test_split_k_contraction_equals_one_product(splits):
    torch.manual_seed(0)
    a, b = torch.randn(4, 5, 36, dtype=torch.float64), torch.randn(4, 7, 36, dtype=torch.float64)
    torch.testing.assert_close(positional_mix.contract(a, b, splits), a @ b.transpose(1, 2))


def test_split_k_is_chosen_on_the_gpu_only():
    """ConViT-Ti at batch 256: K = 256 * 48 * 14 terms, cut into chunks of >= SPLIT_K_MIN_CHUNK on a GPU."""
    length = 256 * 48 * 14
    splits = positional_mix.split_count(length, torch.device("cuda"))
    assert length % splits == 0 and length // splits >= positional_mix.SPLIT_K_MIN_CHUNK and splits == 168
    assert positional_mix.split_count(length, torch.device("cpu")) == 1
    assert positional_mix.split_count(100, torch.device("cuda")) == 1  # too short to split


class _ShapeRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.add(tuple(t.shape))
        return out


def test_hot_path_never_builds_a_batched_attention_matrix():
    b, h, grid = 3, 4, (5, 7)  # B, H, N all distinct
    n = grid[0] * grid[1]
    layer = randomized_gpsa(dim=32, heads=h)
    x = torch.randn(b, n, 32, requires_grad=True)
    with _ShapeRecorder() as fused:
        layer(x, grid).sum().backward()
    layer.fused = False
    with _ShapeRecorder() as explicit:
        layer(x, grid).sum().backward()
    assert (b, h, n, n) in explicit.shapes  # the recorder does see it on the reference path
    assert (h, n, n) in explicit.shapes
    assert not {(b, h, n, n), (h, n, n)} & fused.shapes  # not even the batch-free (H, N, N) matrix
    assert {(h, grid[0], grid[0]), (h, grid[1], grid[1])} <= fused.shapes  # P's two factors


def test_dense_product_builds_one_batch_free_positional_matrix():
    """The dense form holds P as (H, N, N) and its gradient likewise, never a (B, H, N, N) tensor."""
    b, h, grid = 3, 4, (5, 7)
    n = grid[0] * grid[1]
    layer = randomized_gpsa(dim=32, heads=h)
    layer.positional_product = "dense"
    x = torch.randn(b, n, 32, requires_grad=True)
    with _ShapeRecorder() as dense:
        layer(x, grid).sum().backward()
    assert (h, n, n) in dense.shapes and (b, h, n, n) not in dense.shapes


def test_positional_product_is_chosen_per_device_and_validated():
    assert gpsa.resolve_positional_product("auto", torch.device("cpu")) == "kronecker"  # the CPU's default
    assert gpsa.resolve_positional_product("auto", torch.device("cuda")) == "kronecker"  # measured faster there
    assert gpsa.resolve_positional_product("dense", torch.device("cpu")) == "dense"
    assert gpsa.resolve_positional_product("kronecker", torch.device("cuda")) == "kronecker"
    model = ConViT(img_size=16, patch_size=4, embed_dim=8, depth=3, num_heads=4, local_up_to_layer=2)
    assert all(layer.positional_product == "auto" for layer in model.modules() if isinstance(layer, GPSA))
    assert gpsa.set_positional_product(model, "dense") == 2
    with pytest.raises(ValueError, match="positional_product='tiled'.*auto, kronecker, dense"):
        gpsa.set_positional_product(model, "tiled")
    assert [m.positional_product for m in model.modules() if isinstance(m, GPSA)] == ["dense", "dense"]
    model.blocks[0].attn.positional_product = "tiled"
    with pytest.raises(ValueError, match="positional_product='tiled'"):
        model(torch.randn(1, 3, 16, 16))


def test_dense_product_on_a_transformed_cnn_layer_matches_the_factored_one():
    """GPSAConv2d (value shared by the 9 heads, strided queries) in float64: the same outputs and gradients."""
    torch.manual_seed(0)
    layer = GPSAConv2d(20, 12, stride=2).double()
    with torch.no_grad():
        layer.qk.weight.normal_(0, 0.5)
        layer.gating_param.uniform_(-2, 2)
    x = torch.randn(2, 20, 9, 11, dtype=torch.float64)
    results = {}
    for product in ("kronecker", "dense"):
        layer.positional_product = product
        layer.zero_grad(set_to_none=True)
        inputs = x.clone().requires_grad_()
        out = layer(inputs)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        results[product] = [out.detach(), inputs.grad] + [p.grad for p in layer.parameters()]
    for dense, factored in zip(results["dense"], results["kronecker"]):
        torch.testing.assert_close(dense, factored, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("product", ["kronecker", "dense"])
def test_both_products_compile_to_one_graph_and_match_eager(product):
    """torch.compile(fullgraph=True) raises on any graph break, the autograd Functions' included. The
    aot_eager backend traces forward and backward as inductor receives them, without inductor's minute
    of code generation (tests/families/test_compile.py runs inductor on whole models)."""
    layer = randomized_gpsa(dim=24, heads=4)
    layer.positional_product = product
    x = torch.randn(2, 20, 24)
    eager_out, eager_dx, eager_grads = _output_and_grads(layer, x, (4, 5), fused=True, product=product)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    layer.zero_grad(set_to_none=True)
    inputs = x.clone().requires_grad_(True)
    out = compiled(inputs, (4, 5))
    out.backward(_cotangent(out))
    torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(inputs.grad, eager_dx, rtol=1e-5, atol=1e-5)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, eager_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def _bf16_errors(device: str, batch: int) -> dict[str, dict[str, float]]:
    """Per tensor (output, input gradient, parameter gradients): the largest error under bf16 autocast
    against the explicit path in fp32, as a fraction of the fp32 tensor's largest magnitude, for the
    explicit path itself ("explicit": the floor bf16 sets) and for each product. ConViT-Ti's layer shape.
    The bias of pos_proj cancels in the softmax (its exact gradient is 0): it is scaled by the weight's."""
    torch.manual_seed(0)
    layer = randomized_gpsa(dim=192, heads=4).to(device)
    x = torch.randn(batch, 196, 192, device=device)
    out, dx, grads = _output_and_grads(layer, x, (14, 14), fused=False)
    reference = {"out": out, "x": dx, **grads}
    scales = {name: want.abs().max().item() for name, want in reference.items()}
    scales["pos_proj.bias"] = scales["pos_proj.weight"]
    errors = {}
    for product in ["explicit"] + [p for p in gpsa.POSITIONAL_PRODUCTS if p != "auto"]:
        with torch.autocast(device, dtype=torch.bfloat16):
            out, dx, grads = _output_and_grads(layer, x, (14, 14), fused=product != "explicit", product=product)
        got = {"out": out, "x": dx, **grads}
        errors[product] = {
            name: (got[name].float() - want).abs().max().item() / scales[name] for name, want in reference.items()
        }
    return errors


# bf16 keeps 8 significant bits; the explicit path itself, in bf16, ends up to 2.1e-2 (of the largest
# magnitude) from its fp32 self on ConViT-Ti's layer (input and weight gradients: products of bf16
# operands over 196 tokens, then over batch x tokens). A product may add its own roundings on top.
BF16_FLOOR_LIMIT = 4e-2  # what the explicit path in bf16 must stay within
BF16_PRODUCT_OVER_FLOOR = 2.0  # a product's error at most this many times the explicit path's ...
BF16_PRODUCT_MIN_TOLERANCE = 1e-2  # ... or this fraction of the largest magnitude, whichever is larger


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_products_in_bf16_match_the_fp32_explicit_path(device):
    """ConViT-Ti's layer shape (192 wide, 4 heads, 14 x 14 tokens) under bf16 autocast, every product
    against the explicit path in fp32, outputs and every gradient. The tolerance is set by what bf16
    itself costs: the explicit path run in bf16 (the floor) is measured in the same run, within
    BF16_FLOOR_LIMIT of each tensor's largest magnitude; each product within twice that floor's
    error on the tensor (1e-2 at least). Measured on the CPU, batch 8 (16): the floor up to 2.1e-2
    (2.1e-2), on the input and weight gradients; the input gradient: kronecker 2.2e-2 (2.5e-2), dense
    2.0e-2 (2.0e-2), fused 2.2e-2 (2.5e-2); largest of each product: 2.8e-2 (3.0e-2), on the output
    projection's weight gradient. The factored dV rounds its intermediate (s rows)^T G to bf16 between
    its two GEMMs (the fused path shares that positional gradient): 1.1-1.2x the floor on dV and dx."""
    errors = _bf16_errors(device, batch=16 if device == "cuda" else 8)
    floor = errors.pop("explicit")
    for name, error in floor.items():
        assert error < BF16_FLOOR_LIMIT, f"explicit path in bf16: {name} off by {error:.2e}"
    for product, measured in errors.items():
        for name, error in measured.items():
            limit = max(BF16_PRODUCT_OVER_FLOOR * floor[name], BF16_PRODUCT_MIN_TOLERANCE)
            assert error < limit, f"{product}: {name} off by {error:.2e} (explicit path in bf16: {floor[name]:.2e})"


@pytest.mark.parametrize("gate_override", [0.0, 1.0])
def test_gate_override_selects_content_or_position(gate_override):
    layer = randomized_gpsa(dim=16, heads=4).double()
    grid = (3, 4)
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    q, k = layer.qk(x).view(2, 12, 2, 4, 4).permute(2, 0, 3, 1, 4)  # timm's ConViT: heads of 4 from qk and v
    v = layer.v(x).view(2, 12, 4, 4).transpose(1, 2)
    if gate_override == 0.0:
        attn = (q @ k.transpose(-2, -1) * layer.scale).softmax(-1)
    else:
        attn = layer.positional_attention(grid).double().expand(2, -1, -1, -1)
    expected = layer.proj((attn @ v).transpose(1, 2).reshape(2, 12, 16))
    layer.gate_override = gate_override
    for fused in (True, False):
        layer.fused = fused
        torch.testing.assert_close(layer(x, grid), expected)


def test_gpsa_and_mhsa_match_timm_layers():
    torch.manual_seed(0)
    grid, x = (6, 6), torch.randn(2, 36, 32)
    ours, theirs = randomized_gpsa(32, 4), timm_convit.GPSA(32, num_heads=4)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    torch.testing.assert_close(ours(x, grid), theirs(x), rtol=0, atol=1e-5)
    torch.testing.assert_close(ours.attention(x, grid), theirs.get_attention(x), rtol=0, atol=1e-6)

    ours_sa, theirs_sa = MHSA(32, 4), timm_convit.MHSA(32, num_heads=4)
    theirs_sa.load_state_dict(ours_sa.state_dict(), strict=True)
    x = torch.randn(2, 37, 32)  # 36 patches + class token
    torch.testing.assert_close(ours_sa(x, grid), theirs_sa(x), rtol=0, atol=1e-5)


def test_relative_encodings_of_a_rectangular_grid():
    height, width = 2, 3
    pos = grid_positions(height, width)
    rel = relative_encodings(pos, pos)
    tokens = [(x, y) for y in range(height) for x in range(width)]  # row-major
    for i, (xi, yi) in enumerate(tokens):
        for j, (xj, yj) in enumerate(tokens):
            dx, dy = xj - xi, yj - yi
            assert rel[i, j].tolist() == [dx, dy, dx * dx + dy * dy]


@pytest.mark.parametrize("heads,kernel", [(4, 2), (9, 3), (16, 4)])
def test_conv_init_with_large_alpha_attends_to_the_kernel_offset(heads, kernel):
    grid = (9, 8)  # rectangular on purpose: catches swapped x / y
    layer = GPSA(heads * 4, heads)
    layer.local_init(locality_strength=10.0, offsets="integer")
    offsets = kernel_offsets(heads).long()
    assert len({tuple(o) for o in offsets.tolist()}) == heads == kernel * kernel
    assert torch.equal(layer.v.weight, torch.eye(heads * 4))
    pos_attn = layer.positional_attention(grid)
    margin = kernel  # every offset of every query stays inside the grid
    for qy in range(margin, grid[0] - margin):
        for qx in range(margin, grid[1] - margin):
            query = qy * grid[1] + qx
            for h, (dx, dy) in enumerate(offsets.tolist()):
                target = (qy + dy) * grid[1] + (qx + dx)
                assert pos_attn[h, query, target] > 0.99, (h, qx, qy)


@pytest.mark.parametrize("heads,kernel", [(4, 2), (9, 3), (16, 4)])
def test_paper_conv_init_centers_each_head_as_timm(heads, kernel):
    """The paper's kernel (timm's `local_init`, head = col * k + row): at large alpha an odd kernel's head
    attends to one pixel, an even kernel's head splits evenly over the four pixels around its
    half-integer center."""
    grid = (9, 8)
    layer = GPSA(heads * 4, heads)
    layer.local_init(locality_strength=10.0)
    theirs = timm_convit.GPSA(heads * 4, heads, locality_strength=10.0)
    theirs.local_init()
    torch.testing.assert_close(layer.pos_proj.weight, theirs.pos_proj.weight)
    pos_attn = layer.positional_attention(grid)
    margin = kernel
    for h, (cx, cy) in enumerate(paper_kernel_offsets(heads).tolist()):
        assert (h % kernel, h // kernel) == (cy + (kernel - 1) / 2, cx + (kernel - 1) / 2)
        xs = sorted({math.floor(cx), math.ceil(cx)})
        ys = sorted({math.floor(cy), math.ceil(cy)})
        share = 1.0 / (len(xs) * len(ys))
        for qy in range(margin, grid[0] - margin):
            for qx in range(margin, grid[1] - margin):
                query = qy * grid[1] + qx
                for dy in ys:
                    for dx in xs:
                        target = (qy + dy) * grid[1] + (qx + dx)
                        assert abs(pos_attn[h, query, target] - share) < 0.01, (h, qx, qy)


def test_position_only_conv_init_shifts_the_values_by_each_offset():
    """With gate 1, identity value and output maps, head h copies its channels from query + Delta^h."""
    heads, per_head, grid = 9, 2, (5, 6)
    dim, n = heads * per_head, grid[0] * grid[1]
    layer = GPSA(dim, heads)
    layer.local_init(locality_strength=30.0, offsets="integer")
    layer.gate_override = 1.0
    with torch.no_grad():
        layer.proj.weight.copy_(torch.eye(dim))
        layer.proj.bias.zero_()
    x = torch.randn(1, n, dim)
    out = layer(x, grid).view(grid[0], grid[1], heads, per_head)
    image = x.view(grid[0], grid[1], heads, per_head)
    for h, (dx, dy) in enumerate(kernel_offsets(heads).long().tolist()):
        for qy in range(1, grid[0] - 1):
            for qx in range(1, grid[1] - 1):
                torch.testing.assert_close(out[qy, qx, h], image[qy + dy, qx + dx, h], atol=1e-4, rtol=0)


def test_head_count_that_is_not_a_square_still_initializes():
    layer = GPSA(36, 6)
    layer.local_init()
    offsets = kernel_offsets(6)
    assert offsets.shape == (6, 2) and len({tuple(o) for o in offsets.tolist()}) == 6
    assert torch.isfinite(layer(torch.randn(2, 12, 36), (3, 4))).all()


def test_head_count_not_dividing_the_width_is_a_value_error():
    with pytest.raises(ValueError, match="num_heads=5"):
        GPSA(32, 5)
    with pytest.raises(ValueError, match="num_heads=5"):
        MHSA(32, 5)


def test_positional_attention_has_no_tiny_weights():
    """Subnormal operands or products make the CPU GEMMs with P many times slower: weights of each
    factor below eps / K, which together change a row's output by less than rounding, are set to 0."""
    layer = GPSA(64, 16)
    layer.local_init()  # alpha = 1: weights fall below 1e-38 a few tokens away from the offset
    for factor in layer.positional_factors((14, 14)):
        threshold = torch.finfo(factor.dtype).eps / 14
        assert ((factor > 0) & (factor < threshold)).sum() == 0
        assert (factor == 0).any()
        torch.testing.assert_close(factor.sum(-1), torch.ones(16, 14))
    unmasked = layer.pos_proj(layer.relative_encodings((14, 14), "cpu")).permute(2, 0, 1).softmax(-1)
    x = torch.randn(196, 8)
    factored = layer.positional_factors((14, 14)).dense()
    torch.testing.assert_close(factored @ x, unmasked @ x, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("grid_size", [(14, 14), (3, 5), (1, 6)])
def test_factors_equal_the_dense_softmax_of_the_encodings(grid_size):
    """P_h = rows_h (x) cols_h exactly: the encodings' x and y parts separate (bias included)."""
    layer = randomized_gpsa(dim=24, heads=4).double()
    # both are computed in float32; masking differs only below eps / 14 per weight
    torch.testing.assert_close(
        layer.positional_factors(grid_size).dense(), layer.positional_attention(grid_size), rtol=0, atol=1e-6
    )
